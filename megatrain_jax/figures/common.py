"""Shared pieces of the figure scripts in `experiments/figures/`.

Each figure is a CSV (one row per point, with a `source` column saying
"measured" or "predicted") and a PNG drawn from the same rows. Measured points
come from runs on the machine at hand; predicted points come from the planner
at paper scale.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Callable, Sequence

import jax

from megatrain_jax.bench.timing import median_times, synthetic_batch
from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.metrics import model_flops_per_token
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.optim import adamw

# Llama-shaped models at the paper's scales (GQA with 8 KV heads above 7B). Attention in
# blocks, as the paper's fused attention: on a GPU in bf16 that is cuDNN's kernel
# (`models.layers.attention_kernel`), and the planner counts no [T, T] scores.
PAPER_MODELS: dict[str, LlamaConfig] = {
    "7B": LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      d_ff=11008, max_seq_len=4096, attention_block=1024),
    "14B": LlamaConfig(vocab_size=32000, d_model=5120, n_layers=48, n_heads=40, n_kv_heads=8,
                       d_ff=13824, max_seq_len=4096, attention_block=1024),
    "32B": LlamaConfig(vocab_size=32000, d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8,
                       d_ff=27648, max_seq_len=4096, attention_block=1024),
    "70B": LlamaConfig(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       d_ff=28672, max_seq_len=4096, attention_block=1024),
    "120B": LlamaConfig(vocab_size=32000, d_model=10240, n_layers=88, n_heads=80, n_kv_heads=8,
                        d_ff=36864, max_seq_len=4096, attention_block=1024),
    "200B": LlamaConfig(vocab_size=32000, d_model=12288, n_layers=118, n_heads=96,
                        n_kv_heads=8, d_ff=36864, max_seq_len=4096, attention_block=1024),
}


def write(out_dir: str, name: str, rows: Sequence[dict[str, Any]],
          draw: Callable[[Any, Sequence[dict[str, Any]]], None], title: str,
          panels: int = 1) -> tuple[str, str]:
  """Writes <out_dir>/<name>.csv and <name>.png; returns their paths.

  Args:
    out_dir: the folder (made if missing).
    name: the files' name, without extension.
    rows: the points; the CSV's columns are every key of any row, in first-seen order.
    draw: draws the rows, given the panel's axes (an array of them when panels > 1).
    title: the figure's title.
    panels: subplots side by side.

  Returns:
    (CSV path, PNG path).
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  os.makedirs(out_dir, exist_ok=True)
  csv_path = os.path.join(out_dir, f"{name}.csv")
  keys = list(dict.fromkeys(k for r in rows for k in r))
  with open(csv_path, "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
  fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
  draw(axes, rows)
  fig.suptitle(title)
  fig.tight_layout()
  png_path = os.path.join(out_dir, f"{name}.png")
  fig.savefig(png_path, dpi=100)
  plt.close(fig)
  return csv_path, png_path


def measure_streaming(cfg: LlamaConfig, batch_size: int, seq_len: int,
                      ec: EngineConfig | None = None, steps: int = 3) -> dict[str, Any]:
  """Median step time (after one warm-up step), device peak and throughput, measured.

  Trains with AdamW on a synthetic batch, from a fresh model.

  Args:
    cfg: the model.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    ec: the engine config (default: `EngineConfig()`).
    steps: timed steps.

  Returns:
    {"step_time_s", "device_peak_bytes", "tokens_per_s", "model_tflops_per_s",
    "params"}.
  """
  ec = ec or EngineConfig()
  batch = synthetic_batch(cfg, batch_size, seq_len)
  with StreamingTrainer.from_config(cfg, adamw(1e-4), ec, jax.random.key(0)) as eng:
    t = median_times({"step": lambda: eng.step(batch)}, 1, steps)["step"]
    st = eng.stats()
  tokens = batch_size * seq_len
  return {"step_time_s": t, "device_peak_bytes": st["device_peak_bytes"],
          "tokens_per_s": tokens / t,
          "model_tflops_per_s": model_flops_per_token(cfg, seq_len) * tokens / t / 1e12,
          "params": st["param_count"]}


def points(rows, x: str, y: str, **match) -> tuple[list, list]:
  """The (x, y) values of the rows matching every `key=value` in `match`.

  Args:
    rows: the figure's rows.
    x: the column of the x values.
    y: the column of the y values; rows where it is missing or None are left out.
    **match: column -> the value a row must have.

  Returns:
    (x values, y values), in row order.
  """
  sel = [r for r in rows if all(r.get(k) == v for k, v in match.items())
         and r.get(y) is not None]
  return [r[x] for r in sel], [r[y] for r in sel]


def draw_tflops(axes, rows, x: str, xlabels: tuple[str, str], paper=None) -> None:
  """Left: predicted model TFLOPS on h200 and gh200 (and a paper point); right: measured.

  Args:
    axes: the two panels' axes.
    rows: the figure's rows, with a "tflops" column.
    x: the column on the x axis.
    xlabels: the left and right x-axis labels.
    paper: ((x, y), label) of the paper's point, or None for none.
  """
  ax0, ax1 = axes
  for hw in ("h200", "gh200"):
    ax0.plot(*points(rows, x, "tflops", source="predicted", hardware=hw), "o-",
             label=f"predicted, {hw}")
  if paper is not None:
    (px, py), label = paper
    ax0.plot([px], [py], "r*", markersize=12, label=label)
  ax1.plot(*points(rows, x, "tflops", source="measured"), "o-", label="measured, this machine")
  for ax, xlabel in zip(axes, xlabels):
    ax.set_xlabel(xlabel)
    ax.set_ylabel("model TFLOPS")
    ax.legend(fontsize=7)
