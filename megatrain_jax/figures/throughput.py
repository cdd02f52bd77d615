"""Figure 2: throughput (model TFLOPS) vs model size on H200 and GH200.

  python experiments/figures/throughput.py --out_dir=figures   # about a minute

Predicted: the planner at the largest batch that fits, capped at 64K tokens per step,
bf16 compute, for 7B..200B on the `h200` and `gh200` profiles. Measured: model TFLOPS
of the streaming engine on this machine for small presets.
"""

from __future__ import annotations

from megatrain_jax import planner
from megatrain_jax.engine import EngineConfig
from megatrain_jax.figures import common as figures
from megatrain_jax.models.config import preset
from megatrain_jax.optim import adamw

SEQ = 4096
MAX_TOKENS = 65536


def rows(quick: bool) -> list[dict]:
  """Model TFLOPS by model size, predicted and measured.

  Predicted: each of `PAPER_MODELS` on `h200` and `gh200` at 4096 tokens per
  sequence, at the largest batch that fits the device up to MAX_TOKENS per step
  (a model with none is left out), with its bottleneck and whether it fits. Measured:
  small presets at 8 x 128 tokens.

  Args:
    quick: the "tiny" preset only, instead of "tiny", "small" and "medium", one timed
      step instead of 3.

  Returns:
    One row per hardware and model, with `source` "predicted" or "measured".
  """
  ec = EngineConfig(compute_dtype="bfloat16")
  out = []
  for hw_name in ("h200", "gh200"):
    hw = planner.PROFILES[hw_name]
    for name, cfg in figures.PAPER_MODELS.items():
      b = min(planner.largest_batch(cfg, ec, hw.device_bytes, SEQ, hw.flash_attention),
              MAX_TOKENS // SEQ)
      if b == 0:
        continue
      p = planner.plan(cfg, adamw(1e-4), ec, hw, b, SEQ)
      out.append({"source": "predicted", "hardware": hw_name, "model": name,
                  "params_b": cfg.param_count() / 1e9, "batch": b,
                  "tflops": p.model_tflops_per_s, "bottleneck": p.bottleneck,
                  "fits_host": p.fits})
  for name in (["tiny"] if quick else ["tiny", "small", "medium"]):
    cfg = preset(name)
    m = figures.measure_streaming(cfg, 8, 128, steps=1 if quick else 3)
    out.append({"source": "measured", "hardware": "this machine", "model": name,
                "params_b": cfg.param_count() / 1e9, "batch": 8,
                "tflops": m["model_tflops_per_s"]})
  return out


def draw(axes, rs) -> None:
  """`draw_tflops` by parameters, with the paper's 14B point on GH200.

  Args:
    axes: the two panels' axes.
    rs: the rows of `rows`.
  """
  figures.draw_tflops(axes, rs, "params_b", ("parameters (B)", "parameters (B)"), paper=((14.0, 264.0), "paper: 264 TFLOPS, 14B, GH200"))


TITLE = "Throughput vs model size"
PANELS = 2


def make(out_dir: str, quick: bool = False) -> tuple[str, str]:
  """Writes throughput.csv and throughput.png under out_dir; returns their paths.

  Args:
    out_dir: the folder (made if missing).
    quick: fewer and smaller measured points (for tests).

  Returns:
    (CSV path, PNG path).
  """
  return figures.write(out_dir, "throughput", rows(quick), draw, TITLE, PANELS)
