"""Streaming copies on disk (`EngineConfig(stream_copy="disk")`): each unit's
compute-dtype copy in a file beside its state, read at each fetch and rewritten
after each update, so RAM holds no copy of the model at all.

With the disk tier alone, RAM keeps a compute-dtype copy of every unit (2 bytes a
parameter in bf16): 246 GB for a 123B model, more than a 256 GB workstation can
spare. With the copies on disk as well, RAM keeps only the few units in flight, and
each step reads every copy once for the forward and once for the backward and
writes it once: 6 bytes a parameter in bf16, against the state's 24.

A copy file is a `UnitFile` of one array, checked as a state file is (its run, its
unit, its write, its CRC) and named in any error. The files are working data, made
from the masters when the trainer is built and after a restore, and removed when
it closes; a checkpoint never holds them.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Sequence

import jax
import numpy as np

from megatrain_jax.engine.host.disk import CHUNK, DiskStateError, FileLayout, UnitFile
from megatrain_jax.engine.host.disk_support import Buffers, Busy, striped_path

COPY_PATTERN = "copy_{:05d}.mtcopy"
READ_BUFFERS = 2  # kept for reuse: a fetch's, and another thread's (a resident unit's)


def _reads_from(x, buffer: np.ndarray) -> bool:
  """Whether `x` (a numpy array or a single-device jax array) may hold `buffer`'s
  memory rather than a copy of it (True where that cannot be told)."""
  if isinstance(x, np.ndarray):
    return np.shares_memory(x, buffer)
  try:
    at = x.unsafe_buffer_pointer()
  except Exception:  # pylint: disable=broad-except  # e.g. several devices' shards
    return True
  start = buffer.__array_interface__["data"][0]
  return start <= at < start + buffer.nbytes


class CopyFile(UnitFile):
  """One unit's streaming copy file (a `UnitFile` whose errors name it as such)."""
  what = "streaming copy"


class CopyFiles:
  """Every unit's compute-dtype streaming copy in its own file, striped as the state.

  Attributes:
    layouts: each unit's file layout (one array).
    read_bytes, write_bytes: bytes read and written so far.
  """

  def __init__(self, dirs: Sequence[str], sizes: Sequence[int], dtype,
               busy: dict[str, Busy]):
    """Lays out the files; nothing is created until `open`.

    Args:
      dirs: the state directories (striped: `striped_path`).
      sizes: each unit's elements (trained and frozen).
      dtype: the compute dtype.
      busy: "read", "write" and "any" counters of the disk's busy time to add to.
    """
    self.dirs, self.dtype = list(dirs), np.dtype(dtype)
    self.layouts = [FileLayout.of([((int(n),), self.dtype.name)]) for n in sizes]
    self.busy = busy
    self.files: list[CopyFile] = []
    self._gen = [0] * len(sizes)
    self._failed: dict[int, BaseException] = {}  # units whose last write failed
    self._lock = threading.Lock()
    self._bounce = Buffers()
    self._buffers = Buffers(keep=READ_BUFFERS, any_larger=True)  # the reads', reused
    self.read_bytes = self.write_bytes = 0

  def open(self) -> None:
    """Creates (or truncates) every file.

    Raises:
      DiskStateError: a file cannot be created.
    """
    for u, lay in enumerate(self.layouts):
      self.files.append(CopyFile(striped_path(self.dirs, u, COPY_PATTERN), u,
                                 os.urandom(16), lay))

  def write(self, u: int, copy) -> None:
    """Replaces a unit's copy (the caller orders it before the copy's next read).

    Args:
      u: the unit.
      copy: its new flat compute-dtype copy (a host array).

    Raises:
      DiskStateError: the write failed.
    """
    arr = np.asarray(copy)
    with self._lock:
      gen = self._gen[u] + 1
    try:
      with self._bounce(CHUNK) as bounce, self.busy["write"](), self.busy["any"]():
        self.files[u].write([arr], gen, bounce)
    except BaseException as e:
      with self._lock:
        self._failed[u] = e  # its next read says why, not that the file is damaged
      raise
    with self._lock:
      self._gen[u] = gen
      self.write_bytes += self.layouts[u].file_bytes

  def read(self, u: int, buffer: np.ndarray) -> np.ndarray:
    """A unit's copy.

    Args:
      u: the unit.
      buffer: a page-aligned buffer to read into, of at least its data's bytes.

    Returns:
      The flat copy (a view of the buffer).

    Raises:
      DiskStateError: the file is damaged, short, or not this run's latest write, or
        its last write failed.
    """
    with self._lock:
      gen, failed = self._gen[u], self._failed.get(u)
    if failed is not None:
      raise DiskStateError(getattr(failed, "errno", None) or errno.EIO,
                           f"The streaming copy of unit {u} in {self.files[u].path} was not "
                           f"written ({failed}); resume from the last checkpoint.") from failed
    lay = self.layouts[u]
    with self.busy["read"](), self.busy["any"]():
      (out,) = self.files[u].read(gen, buffer=buffer)
    with self._lock:
      self.read_bytes += lay.file_bytes
    return out

  def to_device(self, u: int, transport) -> jax.Array:
    """A unit's copy read from its file into a reused buffer, staged and sent.

    A fresh buffer for every read would fault in its pages each time (on this
    machine a fresh 512 MiB buffer filled in 0.35 s, a reused one in 0.04 s), so the
    buffers are kept; one is reused only once nothing reads it: the staged copy is
    ready (a copy of its own), or, where staging took the buffer as it is (the CPU
    backend takes an aligned array without copying it), the transfer's result is.

    Args:
      u: the unit.
      transport: moves it (`stage`, `h2d`).

    Returns:
      The unit's copy in device memory.
    """
    with self._buffers(self.layouts[u].data_bytes) as buf:
      arr = self.read(u, buf)
      staged = transport.stage(arr)
      out = transport.h2d(staged)
      jax.block_until_ready(out if _reads_from(staged, buf) else staged)
      del arr, staged
    return out

  def file_bytes(self) -> int:
    """Bytes of the files.

    Returns:
      Their total.
    """
    return sum(lay.file_bytes for lay in self.layouts)
