"""Buffers a step hands from one layer's backward to the next forward of the same shapes."""

from __future__ import annotations

import jax.numpy as jnp


class BufferPool:
  """A layer's input and residual buffers, from its backward to the next forward.

  On the CPU backend every device buffer is a fresh allocation, and one over
  malloc's mmap threshold (`host.malloc.MMAP_THRESHOLD`) a fresh mapping whose
  pages are faulted in again: with recompute "none" that was every kept residual
  of every layer, every step. So once a layer's backward has used its input and
  residuals, their buffers wait here, and a later `block_fwd_keep` of the same
  shapes gets them donated and writes into them. The device then holds every
  layer's residuals between steps too, which the step's peak holds anyway (its
  backward starts with all of them); the ledger counts them under "pool".
  """

  def __init__(self, ledger):
    """An empty pool.

    Args:
      ledger: the runtime's device-memory ledger.
    """
    self._ledger = ledger
    self._free: dict[tuple, list] = {}
    self._count = 0

  def give(self, arrays: tuple) -> None:
    """Keeps buffers no computation needs any more.

    Args:
      arrays: a layer's input and kept residuals, in `kept_shapes` order.
    """
    self._count += 1
    key = ("pool", self._count)
    self._ledger.add(key, sum(a.nbytes for a in arrays))
    self._free.setdefault(_shapes(arrays), []).append((key, tuple(arrays)))

  def take(self, shapes: tuple) -> tuple | None:
    """Buffers of these shapes, to donate, or None when the pool has none.

    Args:
      shapes: `Templates.kept_shapes` of the forward they are for.

    Returns:
      The arrays (no longer counted here), or None.
    """
    free = self._free.get(tuple((s.shape, jnp.dtype(s.dtype)) for s in shapes), [])
    while free:
      key, arrays = free.pop()
      self._ledger.remove(key)
      if not any(a.is_deleted() for a in arrays):
        return arrays
    return None

  def clear(self) -> None:
    """Drops every buffer (the runtime is shut down, or a step failed)."""
    for entries in self._free.values():
      for key, _ in entries:
        self._ledger.remove(key)
    self._free.clear()


def _shapes(arrays) -> tuple:
  return tuple((a.shape, jnp.dtype(a.dtype)) for a in arrays)
