"""Will it fit, and how fast will it be? A model of the hardware, checked against measurement.

`plan(cfg, optimizer, engine_config, hardware, batch_size, seq_len)` predicts:

- host bytes by kind (masters, optimizer state, gradient buffers, pinned copies)
  and device bytes by kind (`engine.memory`), plus the device peak the engine
  will actually reach (`device_peak`, which replays the engine's schedule);
- the largest batch that fits the device and the host;
- the step time as the slowest of compute, host->device, device->host and the
  host optimizer, plus what cannot overlap (the first fetch and the last update),
  or, where device and host share the same cores (the CPU backend), their sum;
- the bottleneck, and the break-even tokens per step at which the link stops
  limiting (compute time grows with tokens, transfer time does not).

Hardware profiles hold published peak figures (sources beside each). The host
side of a machine (optimizer bandwidth, RAM) is not on any datasheet: those
values are stated assumptions, marked as such. `measure_hardware()` fills the
`measured` profile from a short calibration of the machine it runs on.
"""

from __future__ import annotations

import dataclasses
import math
import time
import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine import memory
from megatrain_jax.engine.workers import MAX_PENDING
from megatrain_jax.metrics import model_flops_per_token, recompute_flops_per_token
from megatrain_jax.models.config import LlamaConfig

GB = 1e9
TB = 1e12


@dataclasses.dataclass(frozen=True)
class Hardware:
  """What the planner needs to know about a machine.

  layer_flops: FLOP/s the device reaches on a decoder layer's own mix of work
    (matmuls, attention, norms; forward, recompute and backward), as (d_model,
    FLOP/s) points interpolated in log-space by the model's width. Published
    profiles give one point: peak x `mfu`.
  shared: device compute and host work run on the same cores (CPU backend), so
    their times add instead of overlapping.
  call_overhead_s: host time per template call of a step (dispatch and the
    engine's per-unit bookkeeping); 0 in the measured profile, whose rate holds it.
  """

  name: str
  layer_flops: tuple[tuple[int, float], ...]
  h2d_bytes_per_s: float
  d2h_bytes_per_s: float
  host_opt_bytes_per_s: float
  device_bytes: int
  host_bytes: int
  peak_flops: float
  shared: bool = False
  call_overhead_s: float = 20e-6
  # Fused (flash) attention: the [T, T] probabilities never exist in device memory.
  flash_attention: bool = True
  source: str = ""

  def flops_at(self, d_model: int) -> float:
    pts = sorted(self.layer_flops)
    if len(pts) == 1 or d_model <= pts[0][0]:
      return pts[0][1]
    if d_model >= pts[-1][0]:
      return pts[-1][1]
    for (d0, f0), (d1, f1) in zip(pts, pts[1:]):
      if d0 <= d_model <= d1:
        w = (math.log(d_model) - math.log(d0)) / (math.log(d1) - math.log(d0))
        return math.exp((1 - w) * math.log(f0) + w * math.log(f1))
    return pts[-1][1]


def _published(name, peak_flops, link, device_bytes, host_bytes, host_opt, source,
               mfu=0.6, d2h=None):
  return Hardware(name=name, layer_flops=((1, peak_flops * mfu),), h2d_bytes_per_s=link,
                  d2h_bytes_per_s=d2h or link, host_opt_bytes_per_s=host_opt,
                  device_bytes=device_bytes, host_bytes=host_bytes, peak_flops=peak_flops,
                  source=source)


# Dense BF16 tensor-core peaks and host links from the vendors' datasheets. The
# compute time assumes 60% of peak on a streamed layer (`mfu`), PCIe links 80% of
# their x16 rate. Host RAM and host-optimizer bandwidth are assumptions (marked).
PROFILES: dict[str, Hardware] = {
    # NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity), 141 GB
    # HBM3e; PCIe Gen5 x16 64 GB/s per direction. Host: the paper's 1.5 TB server;
    # optimizer bandwidth assumed 200 GB/s (dual-socket DDR5, about half of peak).
    "h200": _published("H200 + 1.5 TB host", 989e12, 0.8 * 64 * GB, 141 * GB, 1500 * GB,
                       200 * GB, "NVIDIA H200 datasheet; PCIe Gen5 x16; host assumed"),
    # NVIDIA GH200 datasheet: H100-class GPU, 989 TFLOPS BF16 dense, 96 GB HBM3;
    # NVLink-C2C 900 GB/s total (450 GB/s each way); 480 GB LPDDR5X at up to 512 GB/s,
    # optimizer bandwidth assumed 250 GB/s.
    "gh200": _published("GH200 (NVLink-C2C)", 989e12, 450 * GB, 96 * GB, 480 * GB,
                        250 * GB, "NVIDIA GH200 datasheet; host optimizer assumed"),
    # NVIDIA H100 PCIe datasheet: 756 TFLOPS BF16 dense, 80 GB; PCIe Gen5 x16.
    "h100_pcie": _published("H100 PCIe Gen5", 756e12, 0.8 * 64 * GB, 80 * GB, 512 * GB,
                            150 * GB, "NVIDIA H100 PCIe datasheet; host assumed"),
    # NVIDIA A100 80GB datasheet: 312 TFLOPS BF16 dense; PCIe Gen4 x16 32 GB/s.
    "a100": _published("A100 80GB", 312e12, 0.8 * 32 * GB, 80 * GB, 512 * GB, 150 * GB,
                       "NVIDIA A100 datasheet; host assumed"),
    # NVIDIA GA102 whitepaper: RTX 3090 71 TFLOPS BF16 with FP32 accumulate, 24 GB;
    # PCIe Gen4 x16.
    "rtx3090": _published("RTX 3090", 71e12, 0.8 * 32 * GB, 24 * GB, 128 * GB, 40 * GB,
                          "NVIDIA GA102 whitepaper; host assumed"),
    # NVIDIA RTX A6000 datasheet: 309.7 TFLOPS tensor with sparsity (154.8 dense),
    # 48 GB; PCIe Gen4 x16.
    "rtx_a6000": _published("RTX A6000", 154.8e12, 0.8 * 32 * GB, 48 * GB, 256 * GB,
                            60 * GB, "NVIDIA RTX A6000 datasheet; host assumed"),
}


# -----------------------------------------------------------------------------
# Calibration.
# -----------------------------------------------------------------------------

def _median_time(fn, reps: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def measure_hardware(quick: bool = False, dtype=jnp.float32,
                     widths: tuple[int, ...] | None = None, batch_size: int = 4,
                     seq_len: int = 256) -> Hardware:
  """The `measured` profile: a short calibration of this machine (seconds).

  - FLOP/s of the engine itself, for several widths (`widths`, or a default
    spread): a streaming step of a 2-layer model of that width at `batch_size` x
    `seq_len` tokens, timed whole. The rate between two measured widths is
    interpolated, and attention's share grows with the sequence, so pass the
    widths and shape you will plan for. The engine's per-call work is inside this
    rate, so the profile's `call_overhead_s` is 0. (On the CPU backend that step
    also holds its own copies and updates, which the plan adds again: a few
    percent at these sizes.)
  - host->device and device->host GB/s through `DeviceTransport`;
  - the fused host AdamW's bytes/s (28 B per parameter).
  """
  from megatrain_jax.engine.flat import FlatSpec  # pylint: disable=import-outside-toplevel
  from megatrain_jax.engine.host_optimizer import HostOptimizer  # pylint: disable=import-outside-toplevel
  from megatrain_jax.engine.trainer import EngineConfig, StreamingTrainer  # pylint: disable=import-outside-toplevel
  from megatrain_jax.engine.transport import DeviceTransport  # pylint: disable=import-outside-toplevel
  from megatrain_jax.optim import adamw  # pylint: disable=import-outside-toplevel

  reps = 3 if quick else 5
  dev = jax.devices()[0]
  b, t = batch_size, seq_len
  ids = np.zeros((b, t + 1), np.int32)
  sample = {"input_ids": ids[:, :-1], "labels": ids[:, 1:],
            "loss_mask": np.ones((b, t), np.float32)}
  points = []
  for d in widths or ((128, 512) if quick else (128, 256, 512, 1024)):
    cfg = LlamaConfig(vocab_size=256, d_model=d, n_layers=2, n_heads=max(d // 64, 2),
                      n_kv_heads=max(d // 128, 1), d_ff=3 * d, max_seq_len=t)
    with StreamingTrainer.from_config(cfg, adamw(1e-4), EngineConfig(compute_dtype=dtype),
                                      jax.random.key(0)) as eng:
      step_s = _median_time(lambda: (eng.step(sample), eng.wait()), reps)
    flops = b * t * (model_flops_per_token(cfg, t) + recompute_flops_per_token(cfg, t))
    points.append((d, flops / step_s))

  tp = DeviceTransport()
  n = (4 if quick else 16) * 2**20
  host = jax.sharding.SingleDeviceSharding(tp.host_device)
  staged = tp.stage(jax.device_put(np.ones(n, np.float32), host))
  h2d = 4 * n / _median_time(lambda: tp.h2d(staged), reps)
  on_dev = tp.h2d(staged)
  d2h = 4 * n / max(_median_time(lambda: tp.d2h(on_dev), reps), 1e-9)

  spec = FlatSpec({"w": np.zeros(n, np.float32)})
  normal = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32), device=tp.host_device)
  opt = HostOptimizer(adamw(1e-4), [spec], [normal(jax.random.key(0))], assemble=lambda u: u[0],
                      split=lambda t: [t], compute_dtype=jnp.float32, mode="per_unit",
                      host_device=tp.host_device)
  g = normal(jax.random.key(1))

  def update():
    opt.update_unit(0, g, stream=False)
    return opt.parts[0]

  host_opt = 28 * n / _median_time(update, reps)
  shared = dev.platform == "cpu"
  return Hardware(name=f"measured ({dev.device_kind})", layer_flops=tuple(points),
                  h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, host_opt_bytes_per_s=host_opt,
                  device_bytes=memory.accelerator_bytes() or memory.available_host_bytes(),
                  host_bytes=memory.available_host_bytes(),
                  peak_flops=max(f for _, f in points), shared=shared,
                  flash_attention=dev.platform != "cpu",
                  call_overhead_s=0.0, source="calibrated on this machine")


def hardware(name: str, quick: bool = False) -> Hardware:
  """A profile by name: one of PROFILES, or "measured"."""
  if name == "measured":
    return measure_hardware(quick)
  if name not in PROFILES:
    raise ValueError(f"Unknown hardware {name!r}; choose one of "
                     f"{sorted(PROFILES) + ['measured']}.")
  return PROFILES[name]


# -----------------------------------------------------------------------------
# Memory.
# -----------------------------------------------------------------------------

def device_peak(cfg: LlamaConfig, ec, batch_size: int, seq_len: int) -> int:
  """The device bytes the engine's ledger will peak at for this shape.

  Replays the step's schedule: activation checkpoints, the running activation
  and gradient, a group's recomputed inputs, every prefetch slot full (a buffer
  stays held until the compute using it is done, and dispatch runs ahead of
  compute), and up to MAX_PENDING + 1 gradients waiting for the link.
  XLA's scratch inside a template is not part of it (nor of the ledger).
  """
  cd = jnp.dtype(ec.compute_dtype).itemsize
  sizes = memory.unit_sizes(cfg)
  L, c = cfg.n_layers, ec.checkpoint_every
  head = L + 1
  unit = [s * cd for s in sizes]
  grad = [s * (4 if u == 0 else cd) for u, s in enumerate(sizes)]
  act = (batch_size // ec.grad_accum) * seq_len * cfg.d_model * cd
  slots = memory.prefetch_slots(cfg, ec)
  streamed = (lambda u: True) if ec.stream_embed_head else (lambda u: u not in (0, head))
  resident = 0 if ec.stream_embed_head else unit[0] + unit[head]
  groups = memory.checkpoint_groups(cfg, ec)
  order = memory.schedule(cfg, ec)
  pos_of = {}
  for p, u in enumerate(order):
    pos_of.setdefault(u, []).append(p)

  def in_flight(p):  # the fullest window of `slots` buffers around position p
    return max(sum(unit[u] for u in order[max(k, 0):k + slots])
               for k in range(p - slots + 1, p + 1))

  peak = 0
  for i in range(L):
    p = pos_of[1 + i][0]
    peak = max(peak, (i // c + 1) * act + (act if i else 0) + in_flight(p))
  p_head = pos_of[head][0] if streamed(head) else pos_of[L][0]
  sent = [grad[head]]
  peak = max(peak, len(groups) * act + 2 * act + in_flight(p_head) + grad[head])
  for gi, (s, e) in enumerate(reversed(groups)):
    for j in reversed(range(e - s)):
      sent.append(grad[1 + s + j])
      p = pos_of[1 + s + j][-1]
      held = ((len(groups) - gi) * act + 2 * act + (e - s - 1) * act + in_flight(p)
              + sum(sent[-(MAX_PENDING + 1):]))
      peak = max(peak, held)
  return peak + resident


def workspace_bytes(cfg: LlamaConfig, ec, batch_size: int, seq_len: int,
                    flash_attention: bool) -> int:
  """XLA's scratch inside one layer's backward template (estimated): the values the
  vjp keeps (norm outputs, q/k/v, attention output, the MLP's three d_ff-wide
  intermediates) and their cotangents, plus the [T, T] attention probabilities
  and their gradient in fp32 unless attention is fused."""
  cd = jnp.dtype(ec.compute_dtype).itemsize
  tokens = (batch_size // ec.grad_accum) * seq_len
  kv = cfg.n_kv_heads * cfg.head_dim
  per_token = 2 * cfg.d_model + cfg.d_model + 2 * kv + cfg.d_model + 3 * cfg.d_ff
  out = 2 * tokens * per_token * cd
  if not flash_attention:
    out += 2 * (batch_size // ec.grad_accum) * cfg.n_heads * seq_len * seq_len * 4
  return out


def device_total(cfg, ec, batch_size: int, seq_len: int, flash_attention: bool = True
                 ) -> dict[str, int]:
  """`engine.memory.device_bytes` plus the workspace of one layer, by kind."""
  dev = dict(memory.device_bytes(cfg, ec, batch_size, seq_len))
  dev["workspace"] = workspace_bytes(cfg, ec, batch_size, seq_len, flash_attention)
  dev["total"] += dev["workspace"]
  return dev


# -----------------------------------------------------------------------------
# The plan.
# -----------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
  """What `plan` predicts; `table()` formats it."""
  hardware: str
  batch_size: int
  seq_len: int
  params: int
  host: dict[str, int]
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
    rows = [("hardware", self.hardware), ("parameters", f"{self.params / 1e9:.3f} B"),
            ("batch", f"{self.batch_size} x {self.seq_len} tokens"),
            ("fits", "yes" if self.fits else "NO"),
            ("largest batch that fits", str(self.largest_batch))]
    rows += [(f"host: {k}", f"{v / 2**30:,.2f} GiB") for k, v in self.host.items()]
    rows += [(f"device: {k}", f"{v / 2**30:,.3f} GiB") for k, v in self.device.items()]
    rows += [("device: predicted peak (ledger)", f"{self.device_peak / 2**30:,.3f} GiB")]
    rows += [(f"time: {k}", f"{v * 1e3:,.1f} ms") for k, v in self.times.items()]
    rows += [("step time", f"{self.step_s * 1e3:,.1f} ms"), ("bottleneck", self.bottleneck),
             ("break-even tokens/step (link = compute)", f"{self.break_even_tokens:,.0f}"),
             ("tokens/s", f"{self.tokens_per_s:,.0f}"),
             ("model TFLOPS", f"{self.model_tflops_per_s:,.2f}"),
             ("MFU (of stated peak)", f"{100 * self.mfu:.1f}%")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def step_bytes(cfg: LlamaConfig, ec) -> dict[str, int]:
  """Bytes one step moves each way, and the host optimizer's traffic."""
  cd = jnp.dtype(ec.compute_dtype).itemsize
  sizes = memory.unit_sizes(cfg)
  L, n = cfg.n_layers, sum(sizes)
  embed, head, block = sizes[0], sizes[-1], sizes[1] if L else 0
  fetched = 2 * L * block + (embed + head if ec.stream_embed_head else 0)
  if cfg.tie_embeddings and ec.stream_embed_head:
    fetched += embed
  grads = cd * (n - embed) + 4 * embed
  # AdamW-class: read master, grad, 2 moments; write master, 2 moments; write the copy.
  opt = n * (4 + 4 + 16 + cd) + (4 * n * 2 * (ec.grad_accum - 1))
  return {"h2d": ec.grad_accum * cd * fetched, "d2h": ec.grad_accum * grads, "host_opt": opt}


def _times(cfg, ec, hw: Hardware, batch_size: int, seq_len: int) -> dict[str, float]:
  tokens = batch_size * seq_len
  recompute = recompute_flops_per_token(cfg, seq_len) * (1 if ec.checkpoint_every == 1 else 2)
  flops = (model_flops_per_token(cfg, seq_len) + recompute) * tokens
  per_micro_calls = 3 + cfg.n_layers * (3 if ec.checkpoint_every == 1 else 4)
  b = step_bytes(cfg, ec)
  return {
      "compute": flops / hw.flops_at(cfg.d_model)
                 + ec.grad_accum * per_micro_calls * hw.call_overhead_s,
      "h2d": b["h2d"] / hw.h2d_bytes_per_s,
      "d2h": b["d2h"] / hw.d2h_bytes_per_s,
      "host_opt": b["host_opt"] / hw.host_opt_bytes_per_s,
  }


def largest_batch(cfg, ec, device_bytes: int, seq_len: int, flash_attention: bool = True,
                  limit: int = 1 << 16) -> int:
  """The largest batch (a multiple of grad_accum) whose device bytes, workspace
  included, fit in `device_bytes`; 0 when not even one micro-batch fits."""
  fits = lambda b: (device_total(cfg, ec, b, seq_len, flash_attention)["total"]
                    <= device_bytes)
  step = ec.grad_accum
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
         batch_size: int, seq_len: int) -> Plan:
  """Memory and step time of a streaming run on `hw` (see the module docstring)."""
  host = memory.host_bytes(cfg, optimizer, ec, on_cpu=hw.shared)
  dev = device_total(cfg, ec, batch_size, seq_len, hw.flash_attention)
  t = _times(cfg, ec, hw, batch_size, seq_len)
  sizes = memory.unit_sizes(cfg)
  cd = jnp.dtype(ec.compute_dtype).itemsize
  if hw.shared:
    step = sum(t.values())
    bottleneck = "shared cores: " + max(t, key=t.get)
  else:
    # The first unit's fetch and the last unit's update cannot overlap anything.
    exposed = cd * sizes[0] / hw.h2d_bytes_per_s + t["host_opt"] * sizes[0] / sum(sizes)
    t["not_overlapped"] = exposed
    if ec.prefetch_depth == 0:  # each fetch waits for the previous compute: no overlap
      step = max(t["compute"] + t["h2d"], t["d2h"], t["host_opt"]) + exposed
      bottleneck = "compute + h2d (no prefetch)"
    else:
      step = max(t["compute"], t["h2d"], t["d2h"], t["host_opt"]) + exposed
      bottleneck = max(("compute", "h2d", "d2h", "host_opt"), key=t.get)
  tokens = batch_size * seq_len
  per_token = (t["compute"]) / tokens
  break_even = t["h2d"] / per_token if per_token > 0 else float("inf")
  model_flops = model_flops_per_token(cfg, seq_len) * tokens
  host_need = host["total"] + (dev["total"] if hw.shared else 0)
  return Plan(
      hardware=hw.name, batch_size=batch_size, seq_len=seq_len, params=sum(sizes),
      host=host, device=dev, device_peak=device_peak(cfg, ec, batch_size, seq_len),
      fits=host_need <= hw.host_bytes and dev["total"] <= hw.device_bytes,
      largest_batch=largest_batch(cfg, ec, hw.device_bytes, seq_len, hw.flash_attention),
      times=t, step_s=step, bottleneck=bottleneck, break_even_tokens=break_even,
      tokens_per_s=tokens / step, model_tflops_per_s=model_flops / step / TB,
      mfu=model_flops / step / hw.peak_flops)


def config_from_hf_json(path: str) -> LlamaConfig:
  """A LlamaConfig from a Hugging Face config.json file."""
  import json  # pylint: disable=import-outside-toplevel
  from megatrain_jax import hf  # pylint: disable=import-outside-toplevel
  with open(path, encoding="utf-8") as f:
    return hf.config_from_hf(json.load(f))[0]
