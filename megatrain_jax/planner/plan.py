"""Will it fit, and how fast will it be? The plan for a model on a `Hardware` profile.

`plan(cfg, optimizer, engine_config, hardware, batch_size, seq_len)` predicts:

- host bytes by kind (masters, optimizer state, gradient buffers, pinned copies,
  checkpoint copies) and device bytes by kind (`engine.memory`), plus the device
  peak the engine's ledger can reach (`engine.memory.step_plan`);
- the largest batch that fits the device and the host;
- the step time as the slowest of compute, host->device, device->host, the host
  optimizer and the drives (with the state on disk), plus what cannot overlap (the
  first fetch, the last update), or where device and host share cores, their sum;
- the bottleneck, and the break-even tokens per step at which the link stops
  limiting (compute time grows with tokens, transfer time does not).

Data parallel (`ec.data_parallel` devices on each of `hosts` hosts): the global batch
splits evenly over every device; device bytes are one device's, host bytes one
host's (each holds the whole state). Each device fetches every unit over its own
link; gradients come back once per host. The all-reduce of each unit's
gradient runs inside its backward, after the compute: a reduce-scatter and an
all-gather between the devices of a host, 2 (D - 1) / D x the bytes over the
interconnect, with an all-reduce of each device's 1/D between hosts, 2 (H - 1) / H
x the bytes / D over each device's network adapter.

Costs (bytes, FLOPs, times) are in `planner/cost.py`, profiles in `planner/hardware.py`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import optax

from megatrain_jax.engine.config import RECOMPUTE
from megatrain_jax.engine.plan import memory, preflight, sizes, workspace
from megatrain_jax.engine.plan import pinned as pinned_lib
from megatrain_jax.metrics import model_flops_per_token
from megatrain_jax.models import layers
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.planner import cost
from megatrain_jax.planner.hardware import Hardware

TB = 1e12


# -- Memory ---------------------------------------------------------------------

def device_peak(cfg: LlamaConfig, ec, batch_size: int, seq_len: int,
                flash_attention: bool = True, deferred: bool | None = None,
                packed: bool | None = None) -> int:
  """The device bytes the engine's ledger can peak at for this shape
  (`engine.plan.memory.step_plan`, the one device model).

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    flash_attention: the hardware is a GPU (see `workspace_bytes`).
    deferred: the updates wait for the whole sweep (a transform that needs the
      whole tree; None: only with `nonfinite="skip"`).
    packed: the batches carry packed-document ids (None: the larger of both).

  Returns:
    The step plan's peak total, in bytes.
  """
  return memory.step_plan(cfg, ec, batch_size, seq_len, _platform(flash_attention),
                          deferred=deferred, packed=packed).peak["total"]


def workspace_bytes(cfg: LlamaConfig, ec, batch_size: int, seq_len: int,
                    flash_attention: bool) -> int:
  """One layer's scratch inside its backward template (`engine.workspace`).

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    flash_attention: the hardware has cuDNN's fused attention (a GPU).

  Returns:
    The estimate, in bytes.
  """
  return workspace.workspace_bytes(cfg, ec, batch_size, seq_len, _platform(flash_attention))


def _platform(flash_attention: bool) -> str:
  return "gpu" if flash_attention else "cpu"


def resolve(cfg: LlamaConfig, ec, batch_size: int, seq_len: int, device_bytes: int,
            flash_attention: bool = True):
  """`ec` with `activations="auto"` decided for a device of `device_bytes`: "host"
  when the step with its checkpoints on the device, workspace included, would not
  fit (`engine.memory.resolve_activations`).

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    device_bytes: the device memory.
    flash_attention: the hardware has a fused attention kernel.

  Returns:
    The engine config, activations "device" or "host".
  """
  where = memory.resolve_activations(cfg, ec, batch_size, seq_len, limit=device_bytes,
                                     platform=_platform(flash_attention))
  return dataclasses.replace(ec, activations=where)


def device_total(cfg, ec, batch_size: int, seq_len: int, flash_attention: bool = True,
                 device_bytes: int | None = None) -> dict[str, int]:
  """`engine.memory.device_bytes` on this hardware, by kind (the workspace of one
  layer included).

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    flash_attention: the hardware has a fused attention kernel (see
      `workspace_bytes`).
    device_bytes: the device memory `activations="auto"` is decided for (`resolve`;
      None: this process's budget or accelerator).

  Returns:
    Kind -> bytes, and "total".
  """
  if device_bytes is not None:
    ec = resolve(cfg, ec, batch_size, seq_len, device_bytes, flash_attention)
  return dict(memory.device_bytes(cfg, ec, batch_size, seq_len, _platform(flash_attention)))


# -- The plan -------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
  """What `plan` predicts; `table()` formats it."""
  hardware: str
  batch_size: int
  seq_len: int
  hosts: int
  devices_per_host: int
  params: int
  activations: str
  recompute: str
  recompute_options: dict[str, tuple[bool, float]]
  attention: str
  mlp_chunk: int | None
  host: dict[str, int]
  disk_bytes: int  # the disk tier's state files (0: the state is in RAM)
  disk: dict[str, int]  # the disk tier's bytes by kind (`cost.disk_figures`)
  pinned: dict[str, int]
  device: dict[str, int]
  device_peak: int
  fits: bool
  largest_batch: int
  times: dict[str, float]
  step_s: float
  bottleneck: str
  break_even_tokens: float
  tokens_per_s: float
  model_tflops_per_s: float
  mfu: float

  def table(self) -> str:
    """The plan as a two-column text table.

    Returns:
      One line per figure, names padded to a common width.
    """
    devices = self.hosts * self.devices_per_host
    rows = [("hardware", self.hardware), ("parameters", f"{self.params / 1e9:.3f} B"),
            ("batch", f"{self.batch_size} x {self.seq_len} tokens"),
            ("devices", f"{self.hosts} host(s) x {self.devices_per_host}: "
             f"{self.batch_size // devices} sequence(s) per device")]
    rows += [("fits", "yes" if self.fits else "NO"),
            ("largest batch that fits", str(self.largest_batch)),
            ("activation checkpoints wait on", self.activations),
            ("recompute", self.recompute)]
    rows += [(f"recompute={m}", f"{'fits' if ok else 'does NOT fit'}, step "
              f"{t * 1e3:,.1f} ms") for m, (ok, t) in self.recompute_options.items()]
    rows += [("fastest recompute that fits", fastest(self.recompute_options) or "none fits"),
            ("attention kernel", self.attention),
            ("feed-forward chunk", f"{self.mlp_chunk:,} tokens" if self.mlp_chunk
             else "whole sequence")]
    rows += [("fp32 masters and optimizer state in", "disk (state files)" if self.disk_bytes
              else "host RAM")]
    if self.disk:
      rows += [("compute-dtype copies in", "disk (copy files)" if self.disk["copy files"]
                else "host RAM")]
    rows += [(f"host (each): {k}", f"{v / 2**30:,.2f} GiB") for k, v in self.host.items()]
    rows += [(f"disk: {k}", f"{v / 2**30:,.2f} GiB") for k, v in self.disk.items()]
    rows += [(f"pinned host: {k}", f"{v / 2**30:,.2f} GiB") for k, v in self.pinned.items()]
    rows += [(f"{pinned_lib.ENV} (GPU)", str(pinned_lib.limit_for(self.pinned["total"])))]
    rows += [(f"device (each): {k}", f"{v / 2**30:,.3f} GiB") for k, v in self.device.items()]
    rows += [("device: predicted peak (ledger)", f"{self.device_peak / 2**30:,.3f} GiB")]
    rows += [(f"time: {k}", f"{v * 1e3:,.1f} ms") for k, v in self.times.items()]
    rows += [("step time", f"{self.step_s * 1e3:,.1f} ms"), ("bottleneck", self.bottleneck),
             ("break-even tokens/step (link = compute)", f"{self.break_even_tokens:,.0f}"),
             ("tokens/s", f"{self.tokens_per_s:,.0f}"),
             ("model TFLOPS", f"{self.model_tflops_per_s:,.2f}"),
             ("MFU (of stated peak)", f"{100 * self.mfu:.1f}%")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def largest_batch(cfg, ec, device_bytes: int, seq_len: int, flash_attention: bool = True,
                  limit: int = 1 << 16, hosts: int = 1, optimizer=None, hw=None) -> int:
  """The largest global batch (a multiple of grad_accum x the devices) whose share
  per device, workspace included, fits in `device_bytes`, and with `optimizer` and
  `hw` whose host bytes (the activation checkpoints grow with the batch) fit the
  host too; 0 when not even one micro-batch fits.

  Args:
    cfg: the model.
    ec: the engine config.
    device_bytes: the device memory.
    seq_len: tokens per sequence.
    flash_attention: attention is fused (see `workspace_bytes`).
    limit: the batch is doubled only while it stays within this; the bisection
      after can pass it, staying below twice it.
    hosts: hosts, each with `ec.data_parallel` devices.
    optimizer: the transform the engine runs (None: the device alone is checked).
    hw: the hardware profile whose host (and drives) must hold the run too.

  Returns:
    The batch size, or 0.

  Raises:
    ValueError: only one of `optimizer` and `hw` given.
  """
  if (optimizer is None) != (hw is None):
    raise ValueError("largest_batch checks the host only with both optimizer= and hw=: "
                     "pass both, or neither for the device alone.")
  devices = max(ec.data_parallel, 1) * hosts
  fits = lambda b: (device_total(cfg, ec, b // devices, seq_len, flash_attention,
                                device_bytes)["total"] <= device_bytes and (
      optimizer is None or _evaluate(cfg, optimizer, ec, hw, b, seq_len, hosts).fits))
  step = ec.grad_accum * devices  # micro-batches split over devices
  if not fits(step):
    return 0
  lo, hi = 1, 2
  while hi * step <= limit and fits(hi * step):
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
  return lo * step


def plan(cfg: LlamaConfig, optimizer: optax.GradientTransformation, ec, hw: Hardware,
         batch_size: int, seq_len: int, hosts: int = 1) -> Plan:
  """Memory and step time of a streaming run on `hw` (see the module docstring).

  Args:
    cfg: the model.
    optimizer: the transform the engine runs (its state counts in the host bytes).
    ec: the engine config (`data_parallel`: devices per host).
    hw: the hardware profile (of one device and its host).
    batch_size: sequences per step, over every device.
    seq_len: tokens per sequence.
    hosts: hosts (processes), each with the whole host state.

  Returns:
    The plan.

  Raises:
    ValueError: a batch that does not split evenly over the devices.
  """
  per_host = max(ec.data_parallel, 1)
  devices = per_host * hosts
  if batch_size % devices:
    raise ValueError(f"A batch of {batch_size} does not split over {hosts} host(s) x "
                     f"{per_host} device(s): make it a multiple of {devices}.")
  # The disk tier's stream_copy "auto", as the engine decides it on this host.
  ec = preflight.resolve_stream_copy(cfg, optimizer, ec, hw.host_bytes, batch_size // hosts,
                                     seq_len, on_cpu=hw.shared)
  options = {}
  for m in RECOMPUTE:
    e = _evaluate(cfg, optimizer, dataclasses.replace(
        ec, recompute=m, checkpoint_every=ec.checkpoint_every if m == "full" else 1),
        hw, batch_size, seq_len, hosts)
    options[m] = (e.fits, e.step_s)
  share = batch_size // devices
  ec = resolve(cfg, ec, share, seq_len, hw.device_bytes, hw.flash_attention)
  dev, fits, step, t, bottleneck, host = _evaluate(cfg, optimizer, ec, hw, batch_size,
                                                   seq_len, hosts)
  counts = sizes.unit_sizes(cfg)
  tokens = batch_size * seq_len
  per_token = t["compute"] / (share * seq_len)  # each device computes its share
  break_even = devices * t["h2d"] / per_token if per_token > 0 else float("inf")
  model_flops = model_flops_per_token(cfg, seq_len) * tokens
  return Plan(
      hardware=hw.name, batch_size=batch_size, seq_len=seq_len, hosts=hosts,
      devices_per_host=per_host, params=sum(counts),
      activations=ec.activations, recompute=ec.recompute, recompute_options=options,
      host=host, mlp_chunk=cfg.mlp_chunk, disk_bytes=cost.disk_state_bytes(cfg, ec),
      disk=cost.disk_figures(cfg, ec),
      attention=layers.attention_kernel(cfg, ec.compute_dtype, False, seq_len,
                                        _platform(hw.flash_attention)),
      pinned=pinned_lib.pinned_bytes(cfg, ec, batch_size // hosts, seq_len,
                                     on_cpu=hw.shared),
      device=dev, device_peak=device_peak(cfg, ec, share, seq_len, hw.flash_attention),
      fits=fits,
      largest_batch=largest_batch(cfg, ec, hw.device_bytes, seq_len, hw.flash_attention,
                                  hosts=hosts, optimizer=optimizer, hw=hw),
      times=t, step_s=step, bottleneck=bottleneck, break_even_tokens=break_even,
      tokens_per_s=tokens / step, model_tflops_per_s=model_flops / step / TB,
      mfu=model_flops / step / (hw.peak_flops * devices))


def fastest(options: dict[str, tuple[bool, float]]) -> str | None:
  """The recompute mode with the shortest predicted step among those that fit.

  Args:
    options: `Plan.recompute_options`.

  Returns:
    The mode, or None when none fits.
  """
  fitting = {m: t for m, (ok, t) in options.items() if ok}
  return min(fitting, key=fitting.get) if fitting else None


class _Evaluation(NamedTuple):
  device: dict[str, int]
  fits: bool
  step_s: float
  times: dict[str, float]
  bottleneck: str
  host: dict[str, int]


def _evaluate(cfg, optimizer, ec, hw: Hardware, batch_size: int, seq_len: int,
              hosts: int = 1) -> _Evaluation:
  """Memory, fit and step time of one engine config (activations "auto" decided)."""
  per_device = batch_size // (max(ec.data_parallel, 1) * hosts)
  ec = resolve(cfg, ec, per_device, seq_len, hw.device_bytes, hw.flash_attention)
  host = memory.host_bytes(cfg, optimizer, ec, hw.shared, batch_size // hosts, seq_len)
  dev = device_total(cfg, ec, per_device, seq_len, hw.flash_attention)
  t = cost.times(cfg, ec, hw, batch_size, seq_len, hosts)
  counts = sizes.unit_sizes(cfg)
  cd = jnp.dtype(ec.compute_dtype).itemsize
  if hw.shared:
    step = sum(t.values())
    bottleneck = "shared cores: " + max(t, key=t.get)
  else:
    # The first unit's fetch and the last unit's update cannot overlap anything.
    exposed = cd * counts[0] / hw.h2d_bytes_per_s + t["host_opt"] * counts[0] / sum(counts)
    t["not_overlapped"] = exposed
    device = t["compute"] + t["collectives"]  # the all-reduce runs inside the backward
    if ec.prefetch_depth == 0:  # each fetch waits for the previous compute: no overlap
      step = max(device + t["h2d"], t["d2h"], t["host_opt"], t.get("disk", 0)) + exposed
      bottleneck = "compute + h2d (no prefetch)"
    else:
      busy = {"compute": device, "h2d": t["h2d"], "d2h": t["d2h"], "host_opt": t["host_opt"],
              **({"disk": t["disk"]} if "disk" in t else {})}  # overlaps the backward
      step = max(busy.values()) + exposed
      bottleneck = max(busy, key=busy.get)
      if bottleneck == "compute" and t["collectives"] > 0:
        bottleneck = "compute + collectives"
  host_need = host["total"] + (dev["total"] if hw.shared else 0)
  fits = (host_need <= hw.host_bytes and dev["total"] <= hw.device_bytes
          and sum(cost.disk_figures(cfg, ec, files=True).values())
          <= hw.disk_drives * hw.disk_bytes)
  return _Evaluation(dev, fits, step, t, bottleneck, host)
