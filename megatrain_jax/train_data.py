"""A run's data: its training batches and the held-out batches it evaluates on."""

from __future__ import annotations

import numpy as np

from megatrain_jax import data as data_lib
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.train_config import TrainConfig


def make_datasets(tc: TrainConfig, cfg: LlamaConfig, share: tuple[int, int] = (0, 1)
                  ) -> tuple[data_lib.PackedDataset, data_lib.PackedDataset | None]:
  """Batches of `tc.data` in `tc.data_format`, tokenized for the model, and the
  held-out batches an evaluation reads.

  Args:
    tc: the run.
    cfg: its model.
    share: (this process's index, the number of processes): its rows of each batch.

  Returns:
    (training data, held-out data or None without eval_every). The held-out data is
    eval_data, or eval_fraction of the documents (conversations), drawn with the
    seed and left out of training.

  Raises:
    ValueError: a tokenizer with more ids than the model's vocabulary, or bad data.
  """
  tok = tc.tokenizer()
  if tok.vocab_size > cfg.vocab_size:
    raise ValueError(f"The tokenizer has {tok.vocab_size} ids but the model's vocab_size "
                     f"is {cfg.vocab_size}; use a larger model or the model's own tokenizer.")
  items, held = _read(tc, tc.data), None
  if tc.eval_every:
    if tc.eval_data:
      held = _read(tc, tc.eval_data)
    else:
      items, held = split_held_out(items, tc.eval_fraction, tc.seed)
  train = _dataset(tc, items, tok, share)
  if held is None:
    return train, None
  try:
    return train, _dataset(tc, held, tok, share)
  except ValueError as e:
    raise ValueError(f"The held-out data: {e} Raise --config.eval_fraction, or give "
                     "--config.eval_data.") from None


def split_held_out(items: list, fraction: float, seed: int) -> tuple[list, list]:
  """Splits documents (or conversations) into training and held-out ones.

  Args:
    items: the documents, in order.
    fraction: the share held out (at least one document).
    seed: which ones.

  Returns:
    (training, held out), each in the original order.

  Raises:
    ValueError: too few documents to hold any out and train on the rest.
  """
  n_held = max(1, round(fraction * len(items)))
  if n_held >= len(items):
    raise ValueError(f"--config.eval_fraction={fraction} of {len(items)} documents leaves "
                     "none to train on; give --config.eval_data or more data.")
  held = np.zeros(len(items), bool)
  held[np.random.default_rng([seed, 0xE7A1]).permutation(len(items))[:n_held]] = True
  return ([x for x, h in zip(items, held) if not h], [x for x, h in zip(items, held) if h])


def _read(tc: TrainConfig, data: str) -> list:
  if tc.data_format in data_lib.INSTRUCT_FORMATS:
    return data_lib.read_conversations(data, tc.data_format)
  return data_lib.read_documents(data, max_bytes=tc.max_data_bytes,
                                 jsonl=True if tc.data_format == "jsonl" else None)


def _dataset(tc: TrainConfig, items: list, tok, share: tuple[int, int]
             ) -> data_lib.PackedDataset:
  kw = dict(process_index=share[0], process_count=share[1])
  if tc.data_format in data_lib.INSTRUCT_FORMATS:
    rows = data_lib.build_sequences(items, tok, tc.seq_len, tc.overlong, pack=tc.packs())
    return data_lib.PackedDataset(rows[0], tc.batch_size, tc.seed, *rows[1:], **kw)
  if tc.packs():
    windows, segments = data_lib.pack(items, tc.seq_len, tok, segments=True)
    return data_lib.PackedDataset(windows, tc.batch_size, tc.seed, segments_NxT1=segments,
                                  **kw)
  return data_lib.PackedDataset(data_lib.pack(items, tc.seq_len, tok), tc.batch_size,
                                tc.seed, **kw)
