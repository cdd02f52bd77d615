"""Figure 5: sequence length 1K -> 512K for a 7B model on GH200: batch, step time, device memory.

  python experiments/figures/seqlen.py --out_dir=figures   # about a minute

Predicted: for each length, the smallest checkpoint_every (1, 2, 4, 8, 16, 32) at
which one sequence fits, then the largest batch at that setting, on `gh200`. Where
nothing fits, the row says so. Measured: a tiny model on this machine from 64 to 1024
tokens at a fixed 4K tokens per step.
"""

from __future__ import annotations

from megatrain_jax import planner
from megatrain_jax.engine import EngineConfig
from megatrain_jax.figures import common as figures
from megatrain_jax.models.config import preset
from megatrain_jax.optim import adamw

K = 1024


def rows(quick: bool) -> list[dict]:
  """Batch, step time and memory by sequence length, predicted and measured.

  Predicted: 7B on `gh200` from 1K to 512K tokens, at the smallest checkpoint_every
  at which one sequence fits and the largest batch there; a length where none fits
  has fits False and no figures. Measured: the "tiny" preset at 4K tokens per step.

  Args:
    quick: measured at 64 tokens only, instead of 64 to 1024, with one timed step
      instead of 3.

  Returns:
    One row per length, with `source` "predicted" or "measured".
  """
  out = []
  hw = planner.PROFILES["gh200"]
  for seq in (1 * K, 4 * K, 16 * K, 64 * K, 128 * K, 256 * K, 512 * K):
    cfg = figures.PAPER_MODELS["7B"].replace(max_seq_len=seq)
    row = {"source": "predicted", "seq_len": seq, "fits": False}
    for every in (1, 2, 4, 8, 16, 32):
      ec = EngineConfig(compute_dtype="bfloat16", checkpoint_every=every)
      b = planner.largest_batch(cfg, ec, hw.device_bytes, seq, hw.flash_attention)
      if b:
        p = planner.plan(cfg, adamw(1e-4), ec, hw, b, seq)
        row.update(fits=True, checkpoint_every=every, batch=b, step_time_s=p.step_s,
                   tflops=p.model_tflops_per_s, device_gb=p.device["total"] / 1e9)
        break
    out.append(row)
  cfg = preset("tiny").replace(max_seq_len=1024)
  for seq in ((64,) if quick else (64, 128, 256, 512, 1024)):
    b = max(4096 // seq, 1)
    m = figures.measure_streaming(cfg, b, seq, steps=1 if quick else 3)
    out.append({"source": "measured", "seq_len": seq, "batch": b,
                "step_time_s": m["step_time_s"], "tflops": m["model_tflops_per_s"],
                "device_peak_mb": m["device_peak_bytes"] / 1e6})
  return out


def draw(axes, rs) -> None:
  """Predicted TFLOPS (with the paper's points), predicted batch and device GB, and
  the measured step time, each by sequence length.

  Args:
    axes: the three panels' axes.
    rs: the rows of `rows`.
  """
  ax0, ax1, ax2 = axes
  x, y = figures.points(rs, "seq_len", "tflops", source="predicted")
  ax0.plot(x, y, "o-", label="predicted, gh200")
  ax0.plot([1 * K, 512 * K], [284.7, 407], "r*", markersize=10, label="paper: 284.7 -> 407")
  ax0.set_xscale("log", base=2)
  ax0.set_xlabel("sequence length (7B)")
  ax0.set_ylabel("model TFLOPS")
  ax0.legend(fontsize=7)
  ax1.plot(*figures.points(rs, "seq_len", "batch", source="predicted"), "o-", label="batch")
  ax1.plot(*figures.points(rs, "seq_len", "device_gb", source="predicted"), "s--",
           label="device GB")
  ax1.set_xscale("log", base=2)
  ax1.set_yscale("log")
  ax1.set_xlabel("sequence length (7B, gh200)")
  ax1.legend(fontsize=7)
  ax2.plot(*figures.points(rs, "seq_len", "step_time_s", source="measured"), "o-",
           label="measured step time (s), 4K tokens/step")
  ax2.set_xscale("log", base=2)
  ax2.set_xlabel("sequence length (tiny, this machine)")
  ax2.legend(fontsize=7)


TITLE = "Sequence length scaling"
PANELS = 3


def make(out_dir: str, quick: bool = False) -> tuple[str, str]:
  """Writes seqlen.csv and seqlen.png under out_dir; returns their paths.

  Args:
    out_dir: the folder (made if missing).
    quick: fewer and smaller measured points (for tests).

  Returns:
    (CSV path, PNG path).
  """
  return figures.write(out_dir, "seqlen", rows(quick), draw, TITLE, PANELS)
