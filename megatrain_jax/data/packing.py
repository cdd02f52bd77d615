"""Several documents in one sequence, kept apart by segment ids.

A packed row holds whole documents (conversations, or pieces of a text stream)
one after another; `segment_ids` numbers them from 1 within the row (0 is
padding), attention never crosses from one segment into another, and positions
restart at 0 at the start of each segment (`positions_from_segments`). The label
that would be predicted across a boundary (the next document's first token) is
not trained, so a packed batch trains on exactly the tokens of its documents run
one per row.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np


def pack_rows(examples: Sequence[tuple[Sequence[int], Sequence[float]]], n: int,
              pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Places examples into rows of `n` tokens, longest first, each in the fullest
  row it fits (best-fit decreasing), and pads the rest.

  Args:
    examples: (token ids, loss mask) per example, each at most `n` long.
    n: tokens per row.
    pad_id: the padding token.

  Returns:
    (tokens int32 [R, n], mask float32 [R, n], segment ids int32 [R, n]); the
    examples of a row are segments 1, 2, ... in the order they were placed (ties
    in length keep the given order, so the result is deterministic).

  Raises:
    ValueError: an example longer than a row.
  """
  rows: list[list[int]] = []
  free: list[tuple[int, int]] = []  # (room left, row), sorted
  for k in sorted(range(len(examples)), key=lambda k: -len(examples[k][0])):
    ids = examples[k][0]
    if len(ids) > n:
      raise ValueError(f"Example {k} has {len(ids)} tokens, more than a row's {n}.")
    at = bisect.bisect_left(free, (len(ids), -1))
    if at == len(free):
      rows.append([])
      room, r = n, len(rows) - 1
    else:
      room, r = free.pop(at)
    rows[r].append(k)
    if room - len(ids):
      bisect.insort(free, (room - len(ids), r))
  tokens = np.full((len(rows), n), pad_id, np.int32)
  mask = np.zeros((len(rows), n), np.float32)
  segments = np.zeros((len(rows), n), np.int32)
  for r, members in enumerate(rows):
    at = 0
    for s, k in enumerate(members, 1):
      ids, m = examples[k]
      tokens[r, at:at + len(ids)] = ids
      mask[r, at:at + len(ids)] = m
      segments[r, at:at + len(ids)] = s
      at += len(ids)
  return tokens, mask, segments


def positions_from_segments(segments_NxT: np.ndarray) -> np.ndarray:
  """Each token's position in its segment: 0 at the start of a row and wherever
  the segment id changes.

  Args:
    segments_NxT: the segment ids.

  Returns:
    int32 positions, the shape of `segments_NxT`.
  """
  seg = np.asarray(segments_NxT)
  t = np.arange(seg.shape[-1])
  starts = np.ones(seg.shape, bool)
  starts[..., 1:] = seg[..., 1:] != seg[..., :-1]
  last_start = np.maximum.accumulate(np.where(starts, t, 0), axis=-1)
  return (t - last_start).astype(np.int32)
