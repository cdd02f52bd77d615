"""Figure 4: width scaling at fixed depth.

  python experiments/figures/width.py --out_dir=figures   # a few minutes

Predicted: 32 layers, d_model 2048 to 12288 (d_ff = 2.6875 x d), on `h200` and `gh200`,
batch 8 x 4096. Measured: 4 layers, d_model 64 to 256, on this machine.
"""

from __future__ import annotations

from megatrain_jax import planner
from megatrain_jax.engine import EngineConfig
from megatrain_jax.figures import common as figures
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.optim import adamw


def _cfg(d, layers, vocab=32000, seq=4096):
  heads = max(d // 128, 2)
  return LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                     n_kv_heads=max(heads // 4, 1), d_ff=int(2.6875 * d) // 64 * 64,
                     max_seq_len=seq)


def rows(quick: bool) -> list[dict]:
  """Model TFLOPS by width, predicted and measured.

  Predicted: 32 layers, d_model 2048 to 12288, on `h200` and `gh200` at 8 x 4096
  tokens, with the bottleneck and device GB. Measured: 4 layers at 8 x 128 tokens,
  with the device peak MB.

  Args:
    quick: d_model 64 only, instead of 64 to 256, one timed step instead of 3.

  Returns:
    One row per hardware and width, with `source` "predicted" or "measured".
  """
  out = []
  ec = EngineConfig(compute_dtype="bfloat16")
  for hw in ("h200", "gh200"):
    for d in (2048, 4096, 6144, 8192, 12288):
      p = planner.plan(_cfg(d, 32), adamw(1e-4), ec, planner.PROFILES[hw], 8, 4096)
      out.append({"source": "predicted", "hardware": hw, "d_model": d,
                  "params_b": p.params / 1e9, "tflops": p.model_tflops_per_s,
                  "bottleneck": p.bottleneck, "device_gb": p.device["total"] / 1e9})
  for d in ((64,) if quick else (64, 128, 192, 256)):
    m = figures.measure_streaming(_cfg(d, 4, vocab=260, seq=256), 8, 128,
                                  steps=1 if quick else 3)
    out.append({"source": "measured", "hardware": "this machine", "d_model": d,
                "params_b": m["params"] / 1e9, "tflops": m["model_tflops_per_s"],
                "device_peak_mb": m["device_peak_bytes"] / 1e6})
  return out


def draw(axes, rs) -> None:
  """`draw_tflops` by d_model, without a paper point.

  Args:
    axes: the two panels' axes.
    rs: the rows of `rows`.
  """
  figures.draw_tflops(axes, rs, "d_model", ("d_model (32 layers)", "d_model (4 layers)"), paper=None)


TITLE = "Width scaling at fixed depth"
PANELS = 2


def make(out_dir: str, quick: bool = False) -> tuple[str, str]:
  """Writes width.csv and width.png under out_dir; returns their paths.

  Args:
    out_dir: the folder (made if missing).
    quick: fewer and smaller measured points (for tests).

  Returns:
    (CSV path, PNG path).
  """
  return figures.write(out_dir, "width", rows(quick), draw, TITLE, PANELS)
