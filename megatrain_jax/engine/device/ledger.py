"""The device-memory ledger: the bytes the engine holds in accelerator memory, by key.

Every buffer the engine keeps on the device is counted under a key while it is
there. The key's first element is what it is, and says the kind it counts under
in the peak (`kind`): a parameter buffer in flight ("param"), a unit kept on the
device ("resident"), an activation checkpoint or a pooled buffer ("ckpt", "pool"),
a running activation ("act"), a gradient waiting for the link ("grad",
"tied_grad"). The step's operations say which keys they add and free
(`plan.program`); the executor applies those with the bytes of its arrays, and
the other threads add and free theirs as their transfers happen. The simulation
of a step (`plan.simulate`) keeps a ledger of the same keys.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Sequence

Key = tuple[Any, ...]

# The kind each key counts under, by its first element.
KINDS = {"param": "params_in_flight", "resident": "resident_units",
         "ckpt": "activation_checkpoints", "pool": "activation_checkpoints",
         "act": "activations", "grad": "gradients_in_flight",
         "tied_grad": "gradients_in_flight"}


def kind(key: Key) -> str:
  """The kind a ledger key counts under.

  Args:
    key: a ledger key.

  Returns:
    "params_in_flight", "resident_units", "activation_checkpoints", "activations"
    or "gradients_in_flight".
  """
  return KINDS[key[0]]


def by_kind(live: dict[Key, int]) -> dict[str, int]:
  """Bytes by kind, and "total".

  Args:
    live: bytes by key.

  Returns:
    {kind: bytes, "total": their sum}.
  """
  out: dict[str, int] = {}
  for k, v in live.items():
    out[kind(k)] = out.get(kind(k), 0) + v
  out["total"] = sum(live.values())
  return out


class Ledger:
  """Bytes the engine holds in accelerator memory, and their peak (thread-safe)."""

  def __init__(self):
    self._cond = threading.Condition()
    self._live: dict[Key, int] = {}
    self.current = 0
    self.peak = 0
    self.peak_kinds: dict[str, int] = {"total": 0}

  def add(self, key: Key, nbytes: int) -> None:
    """Counts bytes under a key (replacing what the key held).

    Args:
      key: what holds them.
      nbytes: their size.
    """
    with self._cond:
      self.current += nbytes - self._live.get(key, 0)
      self._live[key] = nbytes
      if self.current > self.peak:
        self.peak = self.current
        self.peak_kinds = by_kind(self._live)
      self._cond.notify_all()

  def remove(self, key: Key) -> None:
    """Stops counting a key (nothing if it is not counted).

    Args:
      key: what held the bytes.
    """
    with self._cond:
      self.current -= self._live.pop(key, 0)
      self._cond.notify_all()

  def apply(self, effects: Iterable[tuple[Key, int | None]], arrays: Sequence[Any]) -> None:
    """Applies an operation's effects with the sizes of the arrays it made.

    Args:
      effects: (key, bytes) added or (key, None) freed, in order
        (`ops.Op.effects`).
      arrays: one array (or tree of arrays) per added key, in order; its bytes are
        counted, not the effect's.

    Raises:
      ValueError: not one array per added key.
    """
    arrays = list(arrays)
    adds = sum(n is not None for _, n in effects)
    if adds != len(arrays):
      raise ValueError(f"An operation adds {adds} ledger entries but made "
                       f"{len(arrays)} arrays.")
    it = iter(arrays)
    for key, nbytes in effects:
      if nbytes is None:
        self.remove(key)
      else:
        self.add(key, tree_nbytes(next(it)))

  def clear(self) -> None:
    """Counts nothing any more (the runtime is shut down)."""
    with self._cond:
      self._live.clear()
      self.current = 0
      self._cond.notify_all()

  def reset_peak(self) -> None:
    """Starts a new peak from the current bytes."""
    with self._cond:
      self.peak = self.current
      self.peak_kinds = by_kind(self._live)

  def state(self) -> tuple[tuple[str, int], ...]:
    """What is counted now, without the keys.

    Returns:
      Sorted (kind, bytes) of every entry.
    """
    with self._cond:
      return tuple(sorted((kind(k), v) for k, v in self._live.items()))

  def wait_for(self, predicate: Callable[[tuple[tuple[str, int], ...]], bool],
               timeout_s: float) -> bool:
    """Blocks until `predicate(state())` holds (woken by every change).

    Args:
      predicate: over `state()`.
      timeout_s: the longest wait.

    Returns:
      Whether it held before the timeout.
    """
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while not predicate(tuple(sorted((kind(k), v) for k, v in self._live.items()))):
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._cond.wait(left)
      return True


def tree_nbytes(tree) -> int:
  """Bytes of an array, or of every array in a tuple or list of them.

  Args:
    tree: an array, or a (nested) tuple or list of arrays.

  Returns:
    Their total size in bytes.
  """
  if isinstance(tree, (tuple, list)):
    return sum(tree_nbytes(x) for x in tree)
  return tree.nbytes
