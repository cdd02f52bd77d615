"""Throughput accounting and the run's metric files (metrics.jsonl, loss.png)."""

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
  """Appends one JSON object per logged step to `<workdir>/metrics.jsonl`."""

  def __init__(self, workdir: str, append: bool = False):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a" if append else "w", encoding="utf-8")

  def write(self, record: dict[str, Any]) -> None:
    """Appends `record` as one line and flushes it.

    Args:
      record: the step's metrics; JSON-serializable.
    """
    self._file.write(json.dumps(record, sort_keys=True) + "\n")
    self._file.flush()

  def close(self) -> None:
    """Closes the file."""
    self._file.close()

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


def plot_loss(records: Sequence[dict[str, Any]], out_png: str, title: str = "") -> None:
  """Plots loss against step and saves the figure as a PNG.

  Args:
    records: metric records, each with "step" and "loss".
    out_png: the image file to write.
    title: the plot's title; empty gives "training loss".
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot([r["step"] for r in records], [r["loss"] for r in records])
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.set_title(title or "training loss")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
