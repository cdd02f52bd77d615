"""Packing token streams into fixed-length sequences and batching them."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from megatrain_jax.data.packing import positions_from_segments
from megatrain_jax.data.tokenizer import ByteTokenizer


def pack(docs: Sequence[str], seq_len: int, tokenizer=None, segments: bool = False):
  """Concatenates documents (each ended by EOS) and cuts [N, seq_len + 1] windows.

  Consecutive windows share one token, so every token is a label exactly once.

  Args:
    docs: the documents, in order.
    seq_len: tokens a sequence trains on; each window holds one more.
    tokenizer: encodes the documents; None uses `ByteTokenizer`.
    segments: also return each token's document as a segment id, so that
      attention stays within a document (`data.packing`).

  Returns:
    The [N, seq_len + 1] int32 windows (a trailing partial window is dropped), and
    with `segments` their int32 segment ids as a second entry.

  Raises:
    ValueError: `seq_len` is not positive, or the data is shorter than one window.
  """
  if seq_len <= 0:
    raise ValueError(f"seq_len must be positive, got {seq_len}.")
  tok = tokenizer or ByteTokenizer()
  encoded = [tok.encode(doc, add_eos=True) for doc in docs]
  stream = np.fromiter((i for ids in encoded for i in ids), dtype=np.int32)
  n = (len(stream) - 1) // seq_len
  if n < 1:
    raise ValueError(f"The data holds {len(stream)} tokens, fewer than one sequence "
                     f"of seq_len + 1 = {seq_len + 1}; add data or shorten --seq_len.")
  idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
  if not segments:
    return stream[idx]
  doc = np.repeat(np.arange(1, len(encoded) + 1, dtype=np.int32),
                  [len(ids) for ids in encoded])
  return stream[idx], doc[idx]


@dataclasses.dataclass
class DataPosition:
  """Where a `PackedDataset` iterator stands; saved in checkpoints."""
  epoch: int = 0
  index: int = 0


class PackedDataset:
  """Shuffled batches of packed sequences, deterministic for a seed.

  Each epoch uses the permutation of `np.random.default_rng([seed, epoch])`;
  a partial last batch of an epoch is dropped. With segment ids, a batch also
  carries "segment_ids" and "positions" (restarting in each segment), and a
  label that starts a new segment is not trained (`data.packing`).

  In a run of several processes, each one's dataset is built alike and returns its
  own consecutive rows of every global batch (process 0 the first ones): the
  position, saved in checkpoints, is the same in every process, so a resume
  restores every share, and the global batches do not depend on the process count.
  """

  def __init__(self, windows_NxT1: np.ndarray, batch_size: int, seed: int,
               mask_NxT1: np.ndarray | None = None,
               segments_NxT1: np.ndarray | None = None,
               process_index: int = 0, process_count: int = 1):
    """`mask_NxT1` marks the tokens to train on (as labels); None trains on all.
    `segments_NxT1` numbers the documents packed into each window; None: one.
    `batch_size` is the global batch, of which this process (`process_index` of
    `process_count`) gets batch_size / process_count rows."""
    if batch_size <= 0:
      raise ValueError(f"batch_size must be positive, got {batch_size}.")
    if batch_size % process_count or not 0 <= process_index < process_count:
      raise ValueError(f"A global batch of {batch_size} does not split over "
                       f"{process_count} processes (this is process {process_index}): make "
                       f"--batch_size a multiple of {process_count}.")
    if len(windows_NxT1) < batch_size:
      raise ValueError(f"The data packs into {len(windows_NxT1)} sequences, fewer than "
                       f"one batch of {batch_size}; add data or lower --batch_size.")
    for name, arr in (("mask", mask_NxT1), ("segments", segments_NxT1)):
      if arr is not None and arr.shape != windows_NxT1.shape:
        raise ValueError(f"{name} shape {arr.shape} != windows shape "
                         f"{windows_NxT1.shape}.")
    self.windows = windows_NxT1
    self.mask = mask_NxT1
    self.segments = segments_NxT1
    self.batch_size = batch_size
    self.seed = seed
    self.share = (process_index, process_count)
    self.position = DataPosition()

  @property
  def non_padding(self) -> float | None:
    """The share of tokens that belong to a document (segment id > 0), when the
    windows are packed with segment ids; None otherwise."""
    return None if self.segments is None else float(np.mean(self.segments != 0))

  @property
  def batches_per_epoch(self) -> int:
    return len(self.windows) // self.batch_size

  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))

  def next_batch(self) -> dict[str, np.ndarray]:
    """The batch at `position`, which it then advances (into the next epoch if due).

    Returns:
      "input_ids" and "labels" (int32, [batch_size / process_count, T]: this
      process's rows) and "loss_mask" (float32),
      the labels being the inputs shifted by one; with segments, "segment_ids"
      and "positions" (int32) too.
    """
    pos = self.position
    if pos.index >= self.batches_per_epoch:
      pos.epoch, pos.index = pos.epoch + 1, 0
    rows = self._order(pos.epoch)[pos.index * self.batch_size:
                                  (pos.index + 1) * self.batch_size]
    pos.index += 1
    index, count = self.share
    rows = rows[index * len(rows) // count:(index + 1) * len(rows) // count]
    w = self.windows[rows]
    mask = (self.mask[rows][:, 1:] if self.mask is not None
            else np.ones(w[:, 1:].shape, np.float32))
    batch = {"input_ids": w[:, :-1].astype(np.int32),
             "labels": w[:, 1:].astype(np.int32),
             "loss_mask": mask.astype(np.float32)}
    if self.segments is not None:
      seg = self.segments[rows]
      batch["loss_mask"] *= seg[:, 1:] == seg[:, :-1]  # no label across a boundary
      batch["segment_ids"] = seg[:, :-1].astype(np.int32)
      batch["positions"] = positions_from_segments(seg)[:, :-1]
    return batch

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    while True:
      yield self.next_batch()
