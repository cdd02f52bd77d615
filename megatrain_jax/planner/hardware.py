"""Hardware profiles for the planner: published peaks, or a calibration of this machine.

Profiles hold published peak figures (sources beside each). The host side of a
machine (optimizer bandwidth, RAM) is not on any datasheet: those values are stated
assumptions, marked as such. `measure_hardware()` fills the `measured` profile from
a short calibration of the machine it runs on.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.bench import timing
from megatrain_jax.engine import EngineConfig, StreamingTrainer, platform
from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.engine.plan.schedule import Schedule
from megatrain_jax.engine.device.transport import DeviceTransport
from megatrain_jax.metrics import model_flops_per_token, recompute_flops_per_token
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.optim import adamw

GB = 1e9


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
  interconnect_bytes_per_s: between two devices of one host, one direction (the
    gradient all-reduce of data parallelism).
  network_bytes_per_s: between hosts, per device, one direction.
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
  interconnect_bytes_per_s: float = 0.8 * 64 * GB
  network_bytes_per_s: float = 0.8 * 50 * GB
  source: str = ""

  def flops_at(self, d_model: int) -> float:
    """The layer FLOP/s at a width, from `layer_flops`.

    Args:
      d_model: the model's width.

    Returns:
      The rate interpolated in log-space between the two points around `d_model`;
      outside their range, the nearest end's rate (a single point's everywhere).
    """
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
               mfu=0.6, d2h=None, interconnect=None):
  return Hardware(name=name, layer_flops=((1, peak_flops * mfu),), h2d_bytes_per_s=link,
                  d2h_bytes_per_s=d2h or link, host_opt_bytes_per_s=host_opt,
                  device_bytes=device_bytes, host_bytes=host_bytes, peak_flops=peak_flops,
                  interconnect_bytes_per_s=interconnect or link, source=source)


# Dense BF16 tensor-core peaks and host links from the vendors' datasheets. The
# compute time assumes 60% of peak on a streamed layer (`mfu`), PCIe links 80% of
# their x16 rate. Host RAM and host-optimizer bandwidth are assumptions (marked).
# Between devices of a host: NVLink where the part has it (900 GB/s total on
# H100/H200 SXM, 450 GB/s each way), else the PCIe link; between hosts, for every
# profile, an assumed 400 Gb/s InfiniBand NDR adapter per device at 80%.
PROFILES: dict[str, Hardware] = {
    # NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity), 141 GB
    # HBM3e; PCIe Gen5 x16 64 GB/s per direction. Host: the paper's 1.5 TB server;
    # optimizer bandwidth assumed 200 GB/s (dual-socket DDR5, about half of peak).
    "h200": _published("H200 + 1.5 TB host", 989e12, 0.8 * 64 * GB, 141 * GB, 1500 * GB,
                       200 * GB, "NVIDIA H200 datasheet; PCIe Gen5 x16; host assumed",
                       interconnect=450 * GB),
    # NVIDIA GH200 datasheet: H100-class GPU, 989 TFLOPS BF16 dense, 96 GB HBM3;
    # NVLink-C2C 900 GB/s total (450 GB/s each way); 480 GB LPDDR5X at up to 512 GB/s,
    # optimizer bandwidth assumed 250 GB/s.
    "gh200": _published("GH200 (NVLink-C2C)", 989e12, 450 * GB, 96 * GB, 480 * GB,
                        250 * GB, "NVIDIA GH200 datasheet; host optimizer assumed",
                        interconnect=450 * GB),
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

  Args:
    quick: 3 timed calls instead of 5, two default widths instead of four, and 4 Mi
      instead of 16 Mi elements for the link and optimizer.
    dtype: the compute dtype of the timed steps.
    widths: the d_model of each timed model (default (128, 256, 512, 1024), or
      (128, 512) when quick).
    batch_size: sequences per timed step.
    seq_len: tokens per sequence.

  Returns:
    The profile, named after the device kind; device bytes are the accelerator's,
    or the available host memory where there is none.
  """
  reps = 3 if quick else 5
  dev = jax.devices()[0]
  b, t = batch_size, seq_len
  sample = timing.synthetic_batch(LlamaConfig(vocab_size=256, max_seq_len=t), b, t)
  points = []
  for d in widths or ((128, 512) if quick else (128, 256, 512, 1024)):
    cfg = LlamaConfig(vocab_size=256, d_model=d, n_layers=2, n_heads=max(d // 64, 2),
                      n_kv_heads=max(d // 128, 1), d_ff=3 * d, max_seq_len=t)
    ec = EngineConfig(compute_dtype=dtype)
    with StreamingTrainer.from_config(cfg, adamw(1e-4), ec, jax.random.key(0)) as eng:
      step_s = timing.median_time(lambda: (eng.step(sample), eng.wait()), reps)
    # A fused tail runs the last layer's forward once (`Schedule.fused_tail`).
    again = cfg.n_layers - Schedule.build(cfg, ec).fused_tail
    flops = b * t * (model_flops_per_token(cfg, t) + recompute_flops_per_token(cfg, t, again))
    points.append((d, flops / step_s))

  tp = DeviceTransport()
  n = (4 if quick else 16) * 2**20
  host = jax.sharding.SingleDeviceSharding(tp.host_device)
  staged = tp.stage(jax.device_put(np.ones(n, np.float32), host))
  h2d = 4 * n / timing.median_time(lambda: tp.h2d(staged), reps)
  on_dev = tp.h2d(staged)
  d2h = 4 * n / max(timing.median_time(lambda: tp.d2h(on_dev), reps), 1e-9)

  opt = HostOptimizer.of_buffers(adamw(1e-4), [timing.host_normal(n, 0)], mode="per_unit")
  g = timing.host_normal(n, 1)

  def update():
    opt.update_unit(0, g, stream=False)
    return opt.parts[0]

  host_opt = 28 * n / timing.median_time(update, reps)
  opt.close()
  shared = dev.platform == "cpu"
  return Hardware(name=f"measured ({dev.device_kind})", layer_flops=tuple(points),
                  h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, host_opt_bytes_per_s=host_opt,
                  device_bytes=platform.accelerator_bytes() or platform.available_host_bytes(),
                  host_bytes=platform.available_host_bytes(),
                  peak_flops=max(f for _, f in points), shared=shared,
                  flash_attention=dev.platform != "cpu", interconnect_bytes_per_s=h2d,
                  call_overhead_s=0.0, source="calibrated on this machine")


def hardware(name: str, quick: bool = False) -> Hardware:
  """A profile by name: one of PROFILES, or "measured".

  Args:
    name: a key of PROFILES, or "measured" to calibrate this machine.
    quick: for "measured", the quick calibration.

  Returns:
    The profile.

  Raises:
    ValueError: an unknown name.
  """
  if name == "measured":
    return measure_hardware(quick)
  if name not in PROFILES:
    raise ValueError(f"Unknown hardware {name!r}; choose one of "
                     f"{sorted(PROFILES) + ['measured']}.")
  return PROFILES[name]
