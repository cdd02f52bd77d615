"""Figure 5: sequence length 1K -> 512K for a 7B model on GH200: batch, step time, device memory.

  python experiments/figures/seqlen.py --out_dir=figures

Predicted: for each length the planner's settings on `gh200` (`planner.fit_compute`:
attention in blocks, cuDNN's kernel there, then the feed-forward in chunks, as each
becomes needed; activation checkpoints in host memory when the device is short),
and the largest batch under them. Where nothing fits, the row says so. Measured: one
sequence per step of a tiny model on this machine, 512 to 8192 tokens, with
blockwise attention, a chunked feed-forward and checkpoints in host memory.
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

  Args:
    quick: measured at 512 tokens only, instead of 512 to 8192, with one timed step
      instead of 3.

  Returns:
    One row per length, with `source` "predicted" or "measured".
  """
  out = []
  hw = planner.PROFILES["gh200"]
  ec = EngineConfig(compute_dtype="bfloat16")
  for seq in (1 * K, 4 * K, 16 * K, 64 * K, 128 * K, 256 * K, 512 * K):
    cfg = figures.PAPER_MODELS["7B"].replace(max_seq_len=seq)
    cfg = planner.fit_compute(cfg, ec, hw, 1, seq)
    b = planner.largest_batch(cfg, ec, hw.device_bytes, seq, hw.flash_attention)
    row = {"source": "predicted", "seq_len": seq, "fits": b > 0}
    if b:
      p = planner.plan(cfg, adamw(1e-4), ec, hw, b, seq)
      row.update(batch=b, step_time_s=p.step_s, tflops=p.model_tflops_per_s,
                 device_gb=p.device["total"] / 1e9, activations=p.activations,
                 attention=p.attention, mlp_chunk=cfg.mlp_chunk or 0,
                 host_checkpoint_gb=p.host["activation_checkpoints"] / 1e9)
    out.append(row)
  cfg = preset("tiny").replace(max_seq_len=8 * K, attention_block=256, mlp_chunk=1024)
  measured_ec = EngineConfig(activations="host")
  for seq in ((512,) if quick else (512, 1 * K, 2 * K, 4 * K, 8 * K)):
    m = figures.measure_streaming(cfg, 1, seq, measured_ec, steps=1 if quick else 3)
    out.append({"source": "measured", "seq_len": seq, "batch": 1,
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
           label="measured step time (s), 1 sequence/step")
  ax2.plot(*figures.points(rs, "seq_len", "device_peak_mb", source="measured"), "s--",
           label="measured device peak (MB)")
  ax2.set_xscale("log", base=2)
  ax2.set_yscale("log")
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
