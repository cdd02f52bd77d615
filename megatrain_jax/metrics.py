"""Throughput accounting and the run's metric files (metrics.jsonl, loss.png, and
TensorBoard event files when asked)."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from megatrain_jax.models.config import LlamaConfig


def model_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
  """Model FLOPs per trained token, forward + backward, recompute excluded.

  6 x non-embedding parameters a token runs through (blocks and final norm; of
  an MoE layer, the router and its top-k experts), plus the LM head's [D, V]
  matmul (6 x D x V: real work, unlike the embedding lookup), plus attention
  scores and weighted values: 4 x T x (heads x head width) per layer forward, x3
  for forward + backward. Causal masking and sliding windows are not discounted,
  as in the usual MFU convention.

  Args:
    cfg: the model.
    seq_len: tokens per sequence.

  Returns:
    The FLOPs of one token.
  """
  n = cfg.param_count(include_embeddings=False, active=True)
  head = cfg.d_model * cfg.vocab_size
  return 6.0 * (n + head) + 12.0 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim


def layer_forward_flops_per_token(cfg: LlamaConfig, seq_len: int, layer: int) -> float:
  """Hardware FLOPs per token of one block's forward (what recomputing it costs).

  Args:
    cfg: the model.
    seq_len: tokens per sequence.
    layer: the block (of an MoE layer, its router and top-k experts count).

  Returns:
    2 x the parameters a token runs through, plus attention's scores and weighted
    values (4 x T x heads x head width).
  """
  return (2.0 * cfg.block_param_count(layer, active=True)
          + 4.0 * seq_len * cfg.n_heads * cfg.head_dim)


class MetricsWriter:
  """Appends one JSON object per logged step (or evaluation) to
  `<workdir>/metrics.jsonl`, and with `tensorboard_dir` each of its numbers as a
  TensorBoard scalar at the record's step (tensorboardX's event writer)."""

  def __init__(self, workdir: str, append: bool = False, tensorboard_dir: str | None = None):
    """Opens the file (and the event writer).

    Args:
      workdir: where metrics.jsonl goes.
      append: keep the records already there (a resumed run).
      tensorboard_dir: where event files go (None: none are written).

    Raises:
      ImportError: `tensorboard_dir` without tensorboardX installed.
    """
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a" if append else "w", encoding="utf-8")
    self._events = None
    if tensorboard_dir:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._events = SummaryWriter(tensorboard_dir)

  def write(self, record: dict[str, Any]) -> None:
    """Appends `record` as one line and flushes it (and its numbers as scalars).

    Args:
      record: the step's metrics, with "step"; JSON-serializable.
    """
    self._file.write(json.dumps(record, sort_keys=True) + "\n")
    self._file.flush()
    if self._events is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._events.add_scalar(k.replace("eval_", "eval/", 1) if k.startswith("eval_")
                                  else f"train/{k}", v, record["step"])
      self._events.flush()

  def close(self) -> None:
    """Closes the file (and the event writer)."""
    self._file.close()
    if self._events is not None:
      self._events.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
  """The records of a metrics.jsonl file.

  Args:
    path: the file.

  Returns:
    One dict per non-empty line, in file order.
  """
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_loss(records: Sequence[dict[str, Any]], out_png: str, title: str = ""
              ) -> dict[str, list[tuple[int, float]]]:
  """Plots loss against step and saves the figure as a PNG.

  Args:
    records: metric records, each with "step" and "loss" (a training step) or
      "eval_loss" (an evaluation, drawn as a second line).
    out_png: the image file to write.
    title: the plot's title; empty gives "training loss".

  Returns:
    Each line drawn by its label ("train", "held out"): its (step, loss) points.
  """
  return plot_series(records, {"train": "loss", "held out": "eval_loss"}, out_png,
                     "loss (nats/token)", title or "training loss")


def plot_series(records: Sequence[dict[str, Any]], series: dict[str, str], out_png: str,
                ylabel: str, title: str) -> dict[str, list[tuple[int, float]]]:
  """Plots metrics against step and saves the figure as a PNG.

  Args:
    records: metric records, each with "step".
    series: line label -> the record key it draws (records without it are skipped;
      a key starting with "eval_" is drawn with markers).
    out_png: the image file to write.
    ylabel: the y axis's label.
    title: the plot's title.

  Returns:
    Each line drawn by its label: its (step, value) points.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  lines = {label: [(r["step"], r[key]) for r in records if key in r]
           for label, key in series.items()}
  lines = {k: v for k, v in lines.items() if v}
  for label, points in lines.items():
    ax.plot(*zip(*points), "o-" if series[label].startswith("eval_") else "-", label=label)
  if len(lines) > 1:
    ax.legend()
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
  return lines
