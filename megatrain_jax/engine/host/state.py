"""The trainer state a checkpoint reads and writes, and the snapshot it reads it through.

Both trainers implement `TrainerState`; `megatrain_jax.checkpoint` uses only that,
so the engine knows no file format.

A `Snapshot` is one step's state, handed to a writer part by part while training
goes on. An update about to change a part the writer has not read yet copies it
first (copy-on-write), or, when `max_copies` copies are already waiting, waits for
the writer to read it. So a save adds at most `max_copies` parts of host memory,
plus the one the writer holds while it writes; when the disk is slower than the
updates, the updates wait for it. The writer reads the parts in the order the
updates change them, and `close()` (the writer is done, or failed) releases every
copy and every waiting update.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

import numpy as np
from absl import logging

Arrays = dict[str, np.ndarray]


class TrainerState(Protocol):
  """What `megatrain_jax.checkpoint` needs of a trainer."""

  @property
  def step_count(self) -> int:
    """Steps taken (restored from a checkpoint)."""

  def state_layout(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """What `snapshot` holds, without copying.

    Returns:
      For each part of the state, the (shape, dtype) of each of its arrays.
    """

  def snapshot(self) -> "Snapshot":
    """The state at this step boundary.

    Returns:
      A `Snapshot`, readable part by part while training goes on.
    """

  def restore(self, read: Callable[[str], Arrays], step_count: int) -> None:
    """Loads every part of `state_layout()`.

    Args:
      read: part name -> its arrays, laid out as `state_layout()` says.
      step_count: the step the state is at.
    """


class CopyCounter:
  """Host bytes held by snapshot copies now, and their peak (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.current = 0
    self.peak = 0

  def add(self, nbytes: int) -> None:
    """Counts more bytes.

    Args:
      nbytes: bytes added (negative: released).
    """
    with self._lock:
      self.current += nbytes
      self.peak = max(self.peak, self.current)


class Snapshot:
  """One step's state, handed out part by part as host numpy arrays.

  Attributes:
    keys: the parts, in the order the writer should `take` them (the order the
      updates change them).
  """

  def __init__(self, keys: list[str], read: Callable[[str], Arrays],
               max_copies: int | None = 1, counter: CopyCounter | None = None,
               stall_s: float = 600.0):
    """A snapshot of the parts `keys`, each read with `read(key)` while it is unchanged.

    Args:
      keys: the parts, in the order the updates change them.
      read: copies one part of the live state to host numpy arrays.
      max_copies: parts an update may copy ahead of the writer (None: no bound;
        for a state that does not change, as `ResidentTrainer`'s copies).
      counter: counts the bytes of the copies waiting for the writer.
      stall_s: an update waits this long for a writer that reads nothing; past it,
        it copies the part anyway (beyond `max_copies`, logged), so that a snapshot
        nobody reads never blocks training.
    """
    self.keys = list(keys)
    self._read, self._max = read, max_copies
    self._counter = counter or CopyCounter()
    self._cond = threading.Condition()
    self._copies: dict[str, Arrays] = {}  # made before a change, not yet taken
    self._busy: set[str] = set()  # being read (by the writer or an update)
    self._taken: set[str] = set()
    self._closed = False
    self._stall_s = stall_s
    self._progress = 0  # parts the writer has taken

  @staticmethod
  def _nbytes(arrays: Arrays) -> int:
    return sum(x.nbytes for x in arrays.values())

  def before_change(self, keys) -> None:
    """Called (on the updating thread) before parts change: copies each one the writer
    has not read, or waits for the writer to read it when `max_copies` copies
    already wait.

    Args:
      keys: the parts about to change.
    """
    for k in keys:
      with self._cond:
        seen, since = self._progress, time.monotonic()
        while True:
          if (self._closed or k in self._taken or k in self._copies
              or k not in self.keys):
            break
          stalled = time.monotonic() - since > self._stall_s
          if k not in self._busy and (self._max is None or len(self._copies) < self._max
                                      or stalled):
            if stalled:
              logging.warning("The checkpoint writer read no part in %.0f s: copying %s "
                              "beyond the snapshot's bound of %s.", self._stall_s, k,
                              self._max)
            self._busy.add(k)
            break
          self._cond.wait(min(self._stall_s, 1.0))
          if self._progress != seen:
            seen, since = self._progress, time.monotonic()
        if k not in self._busy:
          continue
      arrays = self._read(k)
      with self._cond:
        self._busy.discard(k)
        if not self._closed:
          self._copies[k] = arrays
          self._counter.add(self._nbytes(arrays))
        self._cond.notify_all()

  def take(self, key: str) -> Arrays:
    """The writer's read of one part.

    Args:
      key: the part.

    Returns:
      Its copy if an update made one, else a copy of the live part (which no update
      changes until this returns).

    Raises:
      RuntimeError: the snapshot is closed and holds no copy of the part.
    """
    with self._cond:
      while key in self._busy:
        self._cond.wait()
      if key in self._copies:
        arrays = self._copies.pop(key)
        self._counter.add(-self._nbytes(arrays))
        self._taken.add(key)
        self._progress += 1
        self._cond.notify_all()
        return arrays
      if self._closed:
        raise RuntimeError("This snapshot is closed.")
      self._busy.add(key)
    try:
      return self._read(key)
    finally:
      with self._cond:
        self._busy.discard(key)
        self._taken.add(key)
        self._progress += 1
        self._cond.notify_all()

  def close(self) -> None:
    """The writer is done (or failed): drops the copies, releases waiting updates."""
    with self._cond:
      self._closed = True
      for arrays in self._copies.values():
        self._counter.add(-self._nbytes(arrays))
      self._copies.clear()
      self._cond.notify_all()

  @property
  def closed(self) -> bool:
    """Whether `close` was called."""
    return self._closed


def static_snapshot(parts: dict[str, Arrays]) -> Snapshot:
  """A snapshot of arrays already copied (nothing changes under it).

  Args:
    parts: part name -> its arrays.

  Returns:
    The `Snapshot`.
  """
  return Snapshot(list(parts), lambda k: parts[k], max_copies=None)
