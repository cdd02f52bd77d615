"""The disk tier's directories (their checks and locks), its reused buffers, the
time its disk is busy, and the figures a store reports (`host.disk` has the files
themselves)."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import threading
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from absl import logging

from megatrain_jax.engine.host.disk import DiskStateError, UnitFile, aligned_buffer, \
    round_up

LOCK_NAME = "megatrain_state.lock"


class Busy:
  """Wall time during which at least one operation of a kind was under way (the
  time the disk was busy with them, however many ran at once).

  Attributes:
    seconds: the total so far.
  """

  def __init__(self):
    self._lock, self._n, self._since, self.seconds = threading.Lock(), 0, 0.0, 0.0

  @contextlib.contextmanager
  def __call__(self):
    """Counts the block as one operation under way."""
    with self._lock:
      if self._n == 0:
        self._since = time.perf_counter()
      self._n += 1
    try:
      yield
    finally:
      with self._lock:
        self._n -= 1
        if self._n == 0:
          self.seconds += time.perf_counter() - self._since


class Buffers:
  """Page-aligned buffers, reused: a fresh mapping would fault its pages in again at
  every read or write.

  A request takes the smallest free buffer that holds it and is at most twice its
  size (a small request never holds on to a unit-sized one), else a new one is made.
  With `keep`, at most that many free buffers are kept, the smallest dropped first: so
  the reads of units of different sizes (a model's embedding, blocks and head) keep
  one buffer for each read ahead, of the largest of those sizes, not one of each
  size; more may be in use at once (a read outside the read-ahead), but they are not
  held after.
  """

  def __init__(self, keep: int | None = None, any_larger: bool = False):
    """An empty pool.

    Args:
      keep: free buffers kept at most (None: all).
      any_larger: a request may take any larger free buffer, not only one at most
        twice its size (for reads of units of a few sizes, each as likely to come).
    """
    self._lock, self._free, self._keep, self._in_use = threading.Lock(), [], keep, 0
    self._most = float("inf") if any_larger else 2

  @contextlib.contextmanager
  def __call__(self, nbytes: int) -> Iterator[np.ndarray]:
    """A buffer of at least `nbytes` for the block, given back after it.

    Args:
      nbytes: the size needed.

    Yields:
      The buffer (its first `nbytes` bytes are the caller's to use).
    """
    need = round_up(max(nbytes, 1))
    with self._lock:
      fits = [i for i, b in enumerate(self._free) if need <= b.size <= self._most * need]
      buf = self._free.pop(min(fits, key=lambda i: self._free[i].size)) if fits else None
    buf = aligned_buffer(need) if buf is None else buf
    with self._lock:
      self._in_use += buf.size
    try:
      yield buf
    finally:
      with self._lock:
        self._in_use -= buf.size
        self._free.append(buf)
        if self._keep is not None and len(self._free) > self._keep:
          self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].size))

  def held_bytes(self) -> int:
    """Bytes of the buffers in use and of those kept for reuse.

    Returns:
      Their total size.
    """
    with self._lock:
      return self._in_use + sum(b.size for b in self._free)


def state_dirs(state_dir: str | Sequence[str]) -> list[str]:
  """The directories of `EngineConfig.state_dir` ("a" or "a,b" or a list).

  Args:
    state_dir: one directory, several joined by commas, or a sequence.

  Returns:
    The directories, in order.

  Raises:
    ValueError: none given.
  """
  dirs = state_dir.split(",") if isinstance(state_dir, str) else list(state_dir)
  dirs = [os.path.abspath(os.path.expanduser(d.strip())) for d in dirs if d and d.strip()]
  if not dirs:
    raise ValueError("state_tier='disk' needs state_dir: a directory on a fast disk "
                     "(several, comma-separated, to stripe over drives).")
  return dirs


def striped_path(dirs: Sequence[str], u: int, pattern: str) -> str:
  """Unit u's file: the directories take the units in turn (striped).

  Args:
    dirs: the state directories.
    u: the unit.
    pattern: the file name, formatted with the unit.

  Returns:
    The path.
  """
  return os.path.join(dirs[u % len(dirs)], pattern.format(u))


def striped_bytes(dirs: Sequence[str], layouts: Sequence[Any]) -> list[int]:
  """Bytes each directory holds of one file per unit, striped as `striped_path`.

  Args:
    dirs: the state directories.
    layouts: each unit's file layout (`FileLayout`).

  Returns:
    One figure per directory.
  """
  out = [0] * len(dirs)
  for u, lay in enumerate(layouts):
    out[u % len(dirs)] += lay.file_bytes
  return out


def check_space(dirs: Sequence[str], need: Sequence[int]) -> None:
  """Refuses directories that are missing, not writable, or too small for their files.

  Args:
    dirs: the state directories.
    need: bytes each will hold.

  Raises:
    DiskStateError: what is wrong, naming the directory and the bytes.
  """
  for d, n in zip(dirs, need):
    if not os.path.isdir(d):
      raise DiskStateError(2, f"The state directory {d} does not exist: create it, or "
                           "set state_dir to a directory on a fast disk.")
    if not os.access(d, os.W_OK | os.X_OK):
      raise DiskStateError(13, f"The state directory {d} is not writable: set state_dir "
                           "to a directory this process may write.")
    # Files of an earlier run in it are replaced, so their bytes count as free.
    old = sum(os.path.getsize(f) for pattern in ("unit_*.mtstate", "copy_*.mtcopy")
              for f in glob.glob(os.path.join(d, pattern)))
    free = shutil.disk_usage(d).free + old
    if n > free:
      raise DiskStateError(28, f"The state directory {d} needs {n / 2**30:.2f} GiB for "
                           f"the optimizer state (and the copies, with stream_copy='disk') "
                           f"and has {free / 2**30:.2f} GiB free. Free space, or name more "
                           "directories (comma-separated) to stripe over.")


def lock_dir(d: str) -> int:
  """Takes a state directory for this process (an exclusive `flock` on a file in it).

  Args:
    d: the directory.

  Returns:
    The lock's file descriptor (closing it releases the directory).

  Raises:
    DiskStateError: the directory is not writable, or another process holds it.
  """
  try:
    fd = os.open(os.path.join(d, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
  except OSError as e:
    raise DiskStateError(e.errno, f"The state directory {d} is not writable "
                         f"({e.strerror}): set state_dir to a directory this process "
                         "may write.") from e
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    os.close(fd)
    raise DiskStateError(e.errno, f"The state directory {d} is in use by another "
                         "training process: give each run its own state_dir.") from e
  stale = glob.glob(os.path.join(d, "unit_*.mtstate"))
  if stale:
    logging.info("Disk tier: %d state files of an earlier run in %s are replaced.",
                 len(stale), d)
  return fd


def remove_files(files: list[UnitFile], locks: list[int],
                 more: Sequence[UnitFile] = ()) -> None:
  """Removes a closed store's files and releases its directories.

  Args:
    files: the unit files.
    locks: the directories' lock descriptors.
    more: other files of the store (its streaming copies).
  """
  for f in [*files, *more]:
    f.close(remove=True)
  for fd in locks:
    os.close(fd)


class UpdateOrder:
  """The order a step's unit updates come in, learned from the last step's, so the
  disk tier reads each unit's state ahead of its update (the backward's order,
  head first, before the first step)."""

  def __init__(self, units: int, trained: int):
    """Starts from the backward's order.

    Args:
      units: the units.
      trained: how many of them train (a step updates each once).
    """
    self.order, self.seen, self.trained = list(range(units - 1, -1, -1)), [], trained

  def _learn(self) -> None:
    self.order = self.seen + [v for v in self.order if v not in self.seen]
    self.seen = []

  def begin(self, u: int) -> None:
    """Notes that u's update begins.

    Args:
      u: the unit.
    """
    if u in self.seen:  # a step that did not update every unit (one was refused)
      self._learn()
    self.seen.append(u)
    if len(self.seen) == self.trained:  # the step's order: the next one's too
      self._learn()

  def after(self, u: int) -> list[int]:
    """The units whose updates follow u's.

    Args:
      u: the unit.

    Returns:
      Them, in order, cyclically (the next step's after the last).
    """
    if u not in self.order:
      return []
    i = self.order.index(u)
    return [self.order[(i + k) % len(self.order)] for k in range(1, len(self.order))]

  def upcoming(self) -> list[int]:
    """The units whose updates come next.

    Returns:
      Them, in order: after the last update begun, or the step's first ones.
    """
    return self.after(self.seen[-1]) if self.seen else list(self.order)


class DiskFigures:
  """What a `DiskStore` holds in RAM and on disk, and what it read and wrote."""

  def master_bytes(self):
    """Host bytes of the frozen elements (the masters are on disk).

    Returns:
      The bytes.
    """
    return sum(f.nbytes for f in self.frozen if f is not None)

  def state_bytes(self):
    """Host bytes of the states in RAM now (read ahead, or being written), and of a
    whole-tree transform's state.

    Returns:
      The bytes.
    """
    with self._cv:
      ram = list(self._ready.values())
      held = self.piece_held
    return held + sum(x.nbytes for x in jax.tree.leaves([ram, self.shared])
                      if hasattr(x, "nbytes"))

  def disk_bytes(self) -> int:
    """Bytes of the state files.

    Returns:
      Their total.
    """
    return sum(lay.file_bytes for lay in self.layouts)

  def io_stats(self):
    """What the store read and wrote.

    Returns:
      "read_bytes", "write_bytes" (queued), "read_misses" (updates that waited for
      a read started then), "read_busy_s", "write_busy_s" and "busy_s" (wall time
      with at least one read, write, or either under way), "file_bytes", "dirs",
      "read_buffer_bytes" (the read buffers, in use or kept for reuse),
      "piece_peak_bytes" (the most bytes of pieces in RAM at once: `disk_pieces`);
      with the copies on disk, "copy_read_bytes", "copy_write_bytes" and
      "copy_file_bytes" (the busy times count their I/O too; the other bytes not).
    """
    c = self.copies
    with self._cv:
      return {"read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
              **({} if c is None else {"copy_read_bytes": c.read_bytes,
                                       "copy_write_bytes": c.write_bytes,
                                       "copy_file_bytes": c.file_bytes()}),
              "read_misses": self.misses, "read_busy_s": self.busy["read"].seconds,
              "write_busy_s": self.busy["write"].seconds, "busy_s": self.busy["any"].seconds,
              "file_bytes": self.disk_bytes(), "dirs": list(self.dirs),
              "read_buffer_bytes": self._buffers.held_bytes(),
              "piece_peak_bytes": self.piece_peak}
