"""A calibration of this machine: the planner's `Hardware` record, measured.

The planner holds published profiles (`planner.hardware`); this module times the
engine itself, the link and the host update on the machine it runs on, and fills
the same record (`--hardware=measured` in `experiments/plan.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.bench import timing
from megatrain_jax.engine import EngineConfig, StreamingTrainer, platform
from megatrain_jax.engine.device.transport import DeviceTransport
from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.optim import adamw
from megatrain_jax.planner.hardware import Hardware
from megatrain_jax.planner.cost import step_flops


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
    points.append((d, step_flops(cfg, ec, b, t) / step_s))

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
    return opt.store.parts[0]

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
