"""Figure 1: host memory vs model size, with the paper's 1.5 TB line.

  python experiments/figures/host_memory.py --out_dir=figures   # seconds

Predicted: the planner's host bytes by kind (fp32 masters, AdamW moments, gradient
buffers, bf16 pinned copies) for Llama-shaped models from 7B to 200B. Measured: the
bytes the engine allocates on this machine for small presets (masters, optimizer state,
streaming copies), beside the planner's count for the same configs.
"""

from __future__ import annotations

import jax

from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.engine.plan import memory
from megatrain_jax.figures import common as figures
from megatrain_jax.models.config import preset
from megatrain_jax.optim import adamw

LIMIT = 1.5e12


def rows(quick: bool) -> list[dict]:
  """Host memory by model size, predicted and measured.

  Predicted: the planner's host bytes by kind, in GB, for each of `PAPER_MODELS` as
  on an accelerator. Measured: the masters, optimizer state and streaming copies
  the engine allocates for small presets, beside the planner's count of the same.

  Args:
    quick: the "tiny" preset only, instead of "tiny", "small" and "medium".

  Returns:
    One row per model, with `source` "predicted" or "measured".
  """
  ec = EngineConfig(compute_dtype="bfloat16")
  out = []
  for name, cfg in figures.PAPER_MODELS.items():  # on an accelerator: copies kept
    h = memory.host_bytes(cfg, adamw(1e-4), ec, on_cpu=False)
    out.append({"source": "predicted", "model": name, "params_b": cfg.param_count() / 1e9,
                **{f"{k}_gb": v / 1e9 for k, v in h.items()}})
  for name in (["tiny"] if quick else ["tiny", "small", "medium"]):
    cfg = preset(name)
    h = memory.host_bytes(cfg, adamw(1e-4), ec)
    with StreamingTrainer.from_config(cfg, adamw(1e-4), ec, jax.random.key(0)) as eng:
      allocated = (eng.host_optimizer.store.master_bytes() + eng.host_optimizer.store.state_bytes()
                   + eng.stats()["stream_bytes"])
    out.append({"source": "measured", "model": name, "params_b": cfg.param_count() / 1e9,
                "total_gb": allocated / 1e9,
                "planner_masters_state_copies_gb":
                    (h["masters"] + h["optimizer_state"] + h["pinned_copies"]) / 1e9})
  return out


def draw(axes, rs) -> None:
  """Left: predicted host GB, total and by kind, against the 1.5 TB line; right: what
  the engine allocates here beside the planner's count.

  Args:
    axes: the two panels' axes.
    rs: the rows of `rows`.
  """
  ax0, ax1 = axes
  x, y = figures.points(rs, "params_b", "total_gb", source="predicted")
  ax0.plot(x, y, "o-", label="predicted total (planner)")
  for kind in ("masters", "optimizer_state", "pinned_copies"):
    ax0.plot(*figures.points(rs, "params_b", f"{kind}_gb", source="predicted"), ".--",
             label=f"predicted {kind}")
  ax0.axhline(LIMIT / 1e9, color="r", label="1.5 TB host (paper)")
  ax0.set_xlabel("parameters (B)")
  ax0.set_ylabel("host memory (GB)")
  ax0.legend(fontsize=7)
  x, y = figures.points(rs, "params_b", "total_gb", source="measured")
  _, p = figures.points(rs, "params_b", "planner_masters_state_copies_gb", source="measured")
  ax1.plot(x, y, "o", label="measured: allocated by the engine")
  ax1.plot(x, p, "x", label="planner, same kinds")
  ax1.set_xlabel("parameters (B)")
  ax1.set_ylabel("GB")
  ax1.legend(fontsize=7)
  ax1.set_title("this machine", fontsize=9)


TITLE = "Host memory vs model size (AdamW, fp32 masters, bf16 copies)"
PANELS = 2


def make(out_dir: str, quick: bool = False) -> tuple[str, str]:
  """Writes host_memory.csv and host_memory.png under out_dir; returns their paths.

  Args:
    out_dir: the folder (made if missing).
    quick: fewer and smaller measured points (for tests).

  Returns:
    (CSV path, PNG path).
  """
  return figures.write(out_dir, "host_memory", rows(quick), draw, TITLE, PANELS)
