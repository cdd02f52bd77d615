"""The batch format every trainer takes, and its validation."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.policy import POLICY_KEYS

BATCH_KEYS = ("input_ids", "labels", "loss_mask")
OPTIONAL_KEYS = ("positions", "segment_ids", *POLICY_KEYS)


def check_batch(cfg: LlamaConfig, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Validates a batch and returns it as host numpy arrays of the right dtypes.

  A batch is {"input_ids": int32[B, T], "labels": int32[B, T],
  "loss_mask": float32[B, T]}; `labels[b, t]` is the token that follows
  `input_ids[b, t]`. Packed documents add "segment_ids": int32[B, T] (a token
  attends only within its segment) and "positions": int32[B, T] (each document's
  positions, from 0). A policy-gradient loss (`models.policy`) reads "advantages",
  "old_logprobs" and "ref_logprobs": float32 [B, T], finite.

  Args:
    cfg: the model, which bounds the sequence length and token ids.
    batch: the batch.

  Returns:
    The batch, token ids as int32 and the mask as float32.

  Raises:
    TypeError: the batch is not a mapping.
    ValueError: a missing or unknown key, mismatched or empty shapes, a sequence
      longer than `cfg.max_seq_len`, a non-finite mask, token ids that are not
      integers or lie outside the vocabulary, or positions outside [0, max_seq_len).
  """
  if not isinstance(batch, Mapping):
    raise TypeError(f"A batch is a dict with keys {BATCH_KEYS}, got "
                    f"{type(batch).__name__}.")
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise ValueError(f"Batch is missing {missing}; a batch needs {BATCH_KEYS}.")
  unknown = sorted(set(batch) - set(BATCH_KEYS) - set(OPTIONAL_KEYS))
  if unknown:
    raise ValueError(f"Batch has unknown keys {unknown}; a batch holds {BATCH_KEYS} and "
                     f"optionally {OPTIONAL_KEYS}.")
  out = {
      "input_ids": np.asarray(batch["input_ids"]),
      "labels": np.asarray(batch["labels"]),
      "loss_mask": np.asarray(batch["loss_mask"], np.float32),
      **{k: np.asarray(batch[k]) for k in OPTIONAL_KEYS if k in batch},
      **{k: np.asarray(batch[k], np.float32) for k in POLICY_KEYS if k in batch},
  }
  shape = out["input_ids"].shape
  for key, arr in out.items():
    if arr.ndim != 2 or arr.shape != shape:
      raise ValueError(f"batch[{key!r}] has shape {arr.shape}; every batch entry "
                       f"must be [batch, seq] like input_ids {shape}.")
  b, t = shape
  if b == 0 or t == 0:
    raise ValueError(f"Empty batch of shape {shape}.")
  if t > cfg.max_seq_len:
    raise ValueError(f"Batch sequence length {t} exceeds the model's max_seq_len="
                     f"{cfg.max_seq_len}; shorten --seq_len or raise max_seq_len.")
  if not np.all(np.isfinite(out["loss_mask"])):
    raise ValueError("batch['loss_mask'] holds NaN or infinite values; it must be finite "
                     "weights (1 to train on a token, 0 to skip it).")
  for key in [k for k in POLICY_KEYS if k in out]:
    if not np.all(np.isfinite(out[key])):
      raise ValueError(f"batch[{key!r}] holds NaN or infinite values.")
  for key in [k for k in OPTIONAL_KEYS if k in out and k not in POLICY_KEYS]:
    arr = out[key]
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"batch[{key!r}] must hold integers, got {arr.dtype}.")
    if key == "positions" and (arr.min() < 0 or arr.max() >= cfg.max_seq_len):
      raise ValueError(f"batch['positions'] holds [{arr.min()}, {arr.max()}], outside "
                       f"[0, max_seq_len={cfg.max_seq_len}).")
    out[key] = arr.astype(np.int32)
  for key in ("input_ids", "labels"):
    arr = out[key]
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"batch[{key!r}] must hold integer token ids, got {arr.dtype}.")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= cfg.vocab_size:
      raise ValueError(f"batch[{key!r}] holds token ids in [{lo}, {hi}], outside the "
                       f"model's vocabulary [0, {cfg.vocab_size}).")
    out[key] = arr.astype(np.int32)
  return out
