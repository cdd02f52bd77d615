"""The planner's step time on a calibrated profile of this machine against the engine's
measured step, for three shapes."""

from __future__ import annotations

from typing import Any

import jax

from megatrain_jax import planner
from megatrain_jax.bench import calibrate
from megatrain_jax.bench.suite import Suite
from megatrain_jax.bench.timing import median_times, synthetic_batch
from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.optim import adamw

# (model, batch size, sequence length): small enough for a few seconds a shape.
CONFIGS = [
    (LlamaConfig(vocab_size=260, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                 d_ff=384, max_seq_len=512), 8, 128),
    (LlamaConfig(vocab_size=1024, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4,
                 d_ff=768, max_seq_len=512), 4, 256),
    (LlamaConfig(vocab_size=512, d_model=384, n_layers=3, n_heads=6, n_kv_heads=6,
                 d_ff=1024, max_seq_len=512), 2, 512),
]


def planner_accuracy(s: Suite) -> dict[str, Any]:
  """The plan's step time over the measured one, per shape (1.0: exact).

  Each shape calibrates the `measured` profile at its own width and shape, plans,
  then times the engine's step and its last updates (as the calibration does).

  Args:
    s: the suite (its warm-up and repetitions).

  Returns:
    planner_step_over_measured_<i> for each shape, and their worst distance from 1.
  """
  out: dict[str, Any] = {}
  opt = adamw(1e-4)
  for i, (cfg, b, t) in enumerate(CONFIGS):
    hw = calibrate.measure_hardware(quick=True, widths=(cfg.d_model,), batch_size=b,
                                  seq_len=t)
    predicted = planner.plan(cfg, opt, EngineConfig(), hw, b, t).step_s
    with StreamingTrainer.from_config(cfg, opt, EngineConfig(), jax.random.key(0)) as eng:
      batch = synthetic_batch(cfg, b, t)
      measured = median_times({"step": lambda: (eng.step(batch), eng.wait())},
                              s.warmup, s.reps)["step"]
    out[f"planner_step_over_measured_{i}"] = predicted / measured
  out["planner_worst_step_error"] = max(abs(v - 1) for v in out.values())
  return out
