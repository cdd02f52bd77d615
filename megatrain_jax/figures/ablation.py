"""Figure 6: the double-buffering ablation, measured under a simulated link and predicted.

  python experiments/figures/ablation.py --out_dir=figures   # a few minutes

Measured: step time with prefetch_depth 0, 1, 2 under a `SimulatedLink` set so one
layer's transfer takes about as long as its backward compute. Predicted: the same
depths for 14B on `h200` at 8 x 4096 tokens and at 1 x 1024 tokens (link-bound).
The paper lost 31% without double buffering.
"""

from __future__ import annotations

from megatrain_jax import bench, planner
from megatrain_jax.bench import link
from megatrain_jax.engine import EngineConfig, SimulatedLink
from megatrain_jax.figures import common as figures
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.optim import adamw


def rows(quick: bool) -> list[dict]:
  """Step time by prefetch_depth, predicted and measured.

  Predicted: 14B on `h200` at depths 0, 1 and 2, at 8 x 4096 and at 1 x 1024 tokens.
  Measured: the streaming engine under a `SimulatedLink` whose speed makes one
  layer's fp32 parameters take that layer's backward time.

  Args:
    quick: a 3-layer, d_model 128 model at 2 x 64 tokens instead of `BENCH_MODEL` at
      4 x 512, measured at depths 0 and 2 only, and 2 timed steps instead of 3.

  Returns:
    One row per setting and depth: source, setting, prefetch_depth, step_time_s and
    relative_to_depth_2 (the step time over the same setting's at depth 2).
  """
  out = []
  for tokens in ((8, 4096), (1, 1024)):
    for depth in (0, 1, 2):
      ec = EngineConfig(compute_dtype="bfloat16", prefetch_depth=depth)
      p = planner.plan(figures.PAPER_MODELS["14B"], adamw(1e-4), ec, planner.PROFILES["h200"],
                       *tokens)
      out.append({"source": "predicted", "setting": f"14B h200 {tokens[0]}x{tokens[1]}",
                  "prefetch_depth": depth, "step_time_s": p.step_s})
  cfg = (LlamaConfig(vocab_size=260, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2,
                     d_ff=384, max_seq_len=256) if quick else bench.BENCH_MODEL)
  b, t = (2, 64) if quick else (4, 512)
  layer_s = link.layer_backward_time(cfg, b, t, 1, 3)
  layer_bytes = cfg.block_param_count() * 4
  gbps = layer_bytes / layer_s / 1e9
  for depth in ((0, 2) if quick else (0, 1, 2)):
    m = figures.measure_streaming(cfg, b, t, EngineConfig(prefetch_depth=depth,
                                                          transport=SimulatedLink(gbps)),
                                  steps=2 if quick else 3)
    out.append({"source": "measured", "setting": f"SimulatedLink {gbps:.2f} GB/s",
                "prefetch_depth": depth, "step_time_s": m["step_time_s"]})
  for r in out:
    base = next(x["step_time_s"] for x in out
                if x["setting"] == r["setting"] and x["prefetch_depth"] == 2)
    r["relative_to_depth_2"] = r["step_time_s"] / base
  return out


def draw(ax, rs) -> None:
  """Bars of step time relative to depth 2, one per setting, and the paper's slowdown.

  Args:
    ax: the panel's axes.
    rs: the rows of `rows`.
  """
  settings = list(dict.fromkeys(r["setting"] for r in rs))
  for i, s in enumerate(settings):
    x, y = figures.points(rs, "prefetch_depth", "relative_to_depth_2", setting=s)
    kind = next(r["source"] for r in rs if r["setting"] == s)
    ax.bar([v + 0.25 * i for v in x], y, width=0.25, label=f"{kind}: {s}")
  ax.axhline(1 / 0.69, color="r", linestyle=":", label="paper: -31% without (x1.45)")
  ax.set_xlabel("prefetch_depth")
  ax.set_ylabel("step time / step time at depth 2")
  ax.legend(fontsize=7)


TITLE = "Double-buffering ablation"
PANELS = 1


def make(out_dir: str, quick: bool = False) -> tuple[str, str]:
  """Writes ablation.csv and ablation.png under out_dir; returns their paths.

  Args:
    out_dir: the folder (made if missing).
    quick: fewer and smaller measured points (for tests).

  Returns:
    (CSV path, PNG path).
  """
  return figures.write(out_dir, "ablation", rows(quick), draw, TITLE, PANELS)
