"""Unit state files: each unit's fp32 master and optimizer state in one file on disk.

A file is its header pages, then the unit's arrays, each starting on a page boundary:

  header   magic, format version, the run's token, the unit, the write's generation,
           the data's length, the number of arrays, and the CRC-32 of each array
  data     the master's parts, then each part's optimizer state leaves

An update may rewrite some arrays (a piece of the unit: `write_leaves`) and then the
header that makes them valid (`commit`), or all of them (`write`). The header is
written after the data, so a write that did not finish (the process killed, the disk
full) leaves a header that does not match: a read checks the magic, the token (a
file of another run is never taken for this one's), the unit, the generation (a
lost write is never taken for the current state), the file's size and the CRC of
every array it reads, and names the path when any of them is wrong.

I/O is direct (`O_DIRECT`) where the file system allows it, so the page cache
neither serves a read falsely fast nor hides the RAM a read or write uses; data
passes through page-aligned buffers. Where it does not (tmpfs, some network file
systems), the files are read and written through the cache and each file's pages
are dropped after use (`posix_fadvise`).
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import zlib
from typing import Iterable, NamedTuple, Sequence

import numpy as np

PAGE = 4096
MAGIC = b"MTJXUNIT"
VERSION = 2
# magic, version, token, unit, generation, data bytes, arrays; then a CRC-32 per array
_HEADER = struct.Struct("<8sI16sqqqq")
CHUNK = 8 << 20  # bytes per read or write call
FILE_PATTERN = "unit_{:05d}.mtstate"


class DiskStateError(OSError):
  """A unit's state file could not be written, or what was read is not its state."""


def round_up(n: int, to: int = PAGE) -> int:
  """`n` rounded up to a multiple of `to`.

  Args:
    n: bytes.
    to: the multiple.

  Returns:
    The rounded bytes.
  """
  return -(-n // to) * to


def aligned_buffer(nbytes: int) -> np.ndarray:
  """A page-aligned byte buffer of its own anonymous mapping (freed with it).

  Args:
    nbytes: its size (rounded up to whole pages).

  Returns:
    A writable uint8 array.
  """
  return np.frombuffer(mmap.mmap(-1, max(PAGE, round_up(nbytes))), np.uint8)


class Leaf(NamedTuple):
  """Where one array of a unit's state sits in its file.

  Attributes:
    offset: bytes from the start of the data (a whole number of pages).
    shape: its shape.
    dtype: its dtype's name.
  """
  offset: int
  shape: tuple[int, ...]
  dtype: str

  @property
  def nbytes(self) -> int:
    """The array's bytes."""
    return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class FileLayout(NamedTuple):
  """The arrays of one unit's file, in order, and the data's padded length.

  Attributes:
    leaves: each array's place.
    data_bytes: bytes after the header page (a whole number of pages).
  """
  leaves: tuple[Leaf, ...]
  data_bytes: int

  @classmethod
  def of(cls, arrays: Iterable[tuple[tuple[int, ...], str]]) -> "FileLayout":
    """The layout of arrays of these shapes and dtypes, one after another.

    Args:
      arrays: (shape, dtype name) of each.

    Returns:
      The layout.
    """
    leaves, at = [], 0
    for shape, dtype in arrays:
      leaf = Leaf(at, tuple(int(d) for d in shape), str(np.dtype(dtype)))
      leaves.append(leaf)
      at += round_up(leaf.nbytes)
    return cls(tuple(leaves), at)

  @property
  def header_bytes(self) -> int:
    """The header's size: whole pages, with room for a CRC per array."""
    return round_up(_HEADER.size + 4 * len(self.leaves))

  @property
  def file_bytes(self) -> int:
    """The file's size: the header and the data."""
    return self.header_bytes + self.data_bytes


class UnitFile:
  """One unit's state file: written whole or in pieces, checked on every read."""
  what = "state"  # named in errors

  def __init__(self, path: str, unit: int, token: bytes, layout: FileLayout):
    """Opens (creating or truncating) the file, direct I/O where allowed.

    Args:
      path: the file.
      unit: the unit it holds.
      token: this run's 16 bytes (a file of another run never reads as valid).
      layout: its arrays.

    Raises:
      DiskStateError: the file cannot be opened for writing.
    """
    self.path, self.unit, self.token, self.layout = path, unit, token, layout
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    self.direct = hasattr(os, "O_DIRECT")
    try:
      try:
        self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
      except OSError as e:
        if not self.direct or e.errno != errno.EINVAL:
          raise
        self.direct = False  # the file system refuses direct I/O: through the cache
        self.fd = os.open(path, flags, 0o600)
    except OSError as e:
      raise DiskStateError(e.errno, f"Cannot create the {self.what} file {path}: {e.strerror}. "
                           "state_dir must be a writable directory.") from e

  def write(self, arrays: Sequence[np.ndarray], generation: int,
            bounce: np.ndarray) -> None:
    """Writes all the unit's arrays, then the header that makes them valid.

    Args:
      arrays: one per leaf of the layout (any alignment; C-contiguous).
      generation: this write's number (a read expects it).
      bounce: a page-aligned buffer of whole pages the data passes through.

    Raises:
      DiskStateError: the write failed (the disk is full, or an I/O error).
    """
    crcs = self.write_leaves(dict(enumerate(arrays)), bounce)
    self.commit(generation, [crcs[i] for i in range(len(arrays))])

  def write_leaves(self, arrays: dict[int, np.ndarray], bounce: np.ndarray) -> dict[int, int]:
    """Writes some of the unit's arrays in place; the file is valid again only once
    `commit` has written the header with their CRCs.

    Args:
      arrays: leaf index -> its new array (any alignment; C-contiguous).
      bounce: a page-aligned buffer of whole pages the data passes through.

    Returns:
      leaf index -> the CRC-32 of what was written.

    Raises:
      DiskStateError: the write failed (the disk is full, or an I/O error).
    """
    crcs = {}
    for i, a in arrays.items():
      leaf = self.layout.leaves[i]
      src = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
      crc, pos, end = 0, 0, round_up(leaf.nbytes)
      while pos < end:
        n = min(end - pos, bounce.size)
        real = max(0, min(n, src.size - pos))
        bounce[:real] = src[pos:pos + real]
        bounce[real:n] = 0
        crc = zlib.crc32(bounce[:n], crc)
        self._pwrite(bounce[:n], self.layout.header_bytes + leaf.offset + pos)
        pos += n
      crcs[i] = crc
    return crcs

  def commit(self, generation: int, crcs: Sequence[int]) -> None:
    """Writes the header that makes the arrays now in the file valid.

    Args:
      generation: this write's number (a read expects it).
      crcs: the CRC-32 of every array, in layout order.

    Raises:
      DiskStateError: the write failed.
    """
    page = aligned_buffer(self.layout.header_bytes)
    head = _HEADER.pack(MAGIC, VERSION, self.token, self.unit, generation,
                        self.layout.data_bytes, len(crcs))
    page[:len(head)] = np.frombuffer(head, np.uint8)
    page[len(head):len(head) + 4 * len(crcs)] = np.asarray(crcs, "<u4").view(np.uint8)
    self._pwrite(page[:self.layout.header_bytes], 0)
    if not self.direct:
      os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

  def read(self, generation: int, leaves: Sequence[int] | None = None,
           buffer: np.ndarray | None = None) -> list[np.ndarray]:
    """Reads some or all of the unit's arrays and checks them against the header.

    Args:
      generation: the write the caller expects to find.
      leaves: the indices of the arrays to read (None: all).
      buffer: a page-aligned buffer to read into (None, or too small: a fresh one);
        the arrays are laid out in it one after another, each on a page boundary.

    Returns:
      The arrays, in the order asked, views of that buffer.

    Raises:
      DiskStateError: the file is short, of another run or unit, from another
        write, or an array does not match its CRC.
    """
    lay = self.layout
    size = os.fstat(self.fd).st_size
    if size != lay.file_bytes:
      self._bad(f"it has {size} bytes where the state takes {lay.file_bytes} "
                "(truncated or replaced)")
    page = aligned_buffer(lay.header_bytes)
    self._pread(page, 0)
    magic, version, token, unit, gen, nbytes, count = _HEADER.unpack(
        page[:_HEADER.size].tobytes())
    if magic != MAGIC or version != VERSION:
      self._bad("it does not start with a unit state header")
    if token != self.token:
      self._bad("it was written by another run (stale)")
    if unit != self.unit or nbytes != lay.data_bytes or count != len(lay.leaves):
      self._bad(f"it holds unit {unit} ({nbytes} bytes), not unit {self.unit}")
    if gen != generation:
      self._bad(f"it holds write {gen} of this unit's state, not write {generation} "
                "(a write was lost)")
    crcs = page[_HEADER.size:_HEADER.size + 4 * count].view("<u4")
    which = range(len(lay.leaves)) if leaves is None else leaves
    sizes = [round_up(lay.leaves[i].nbytes) for i in which]
    total = sum(sizes)
    data = buffer if buffer is not None and buffer.size >= total else aligned_buffer(total)
    out, at = [], 0
    for i, n in zip(which, sizes):
      leaf = lay.leaves[i]
      for pos in range(0, n, CHUNK):
        self._pread(data[at + pos:at + min(pos + CHUNK, n)],
                    lay.header_bytes + leaf.offset + pos)
      if zlib.crc32(data[at:at + n]) != crcs[i]:
        self._bad("its data does not match its checksum (modified or corrupted)")
      elements = int(np.prod(leaf.shape, dtype=np.int64))
      out.append(np.frombuffer(data, leaf.dtype, elements, at).reshape(leaf.shape))
      at += n
    if not self.direct:
      os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return out

  def _bad(self, why: str):
    raise DiskStateError(errno.EIO, f"The {self.what} file {self.path} of unit {self.unit} cannot "
                         f"be used: {why}. Nothing was updated from it; resume from the "
                         "last checkpoint.")

  def _pwrite(self, view: np.ndarray, at: int) -> None:
    try:
      done = 0
      while done < view.size:
        done += os.pwritev(self.fd, [view[done:]], at + done)
    except OSError as e:
      hint = (" The disk is full: free space on it or name a larger state_dir."
              if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "")
      raise DiskStateError(e.errno, f"Writing the {self.what} of unit {self.unit} to {self.path} "
                           f"failed: {e.strerror}.{hint} The last checkpoint is intact.") \
          from e

  def _pread(self, view: np.ndarray, at: int) -> None:
    done = 0
    while done < view.size:
      try:
        n = os.preadv(self.fd, [view[done:]], at + done)
      except OSError as e:
        raise DiskStateError(e.errno, f"Reading the {self.what} of unit {self.unit} from "
                             f"{self.path} failed: {e.strerror}.") from e
      if n == 0:
        self._bad("it ended early (truncated)")
      done += n

  def close(self, remove: bool = True) -> None:
    """Closes the file, and removes it (it is a run's working state, not a checkpoint).

    Args:
      remove: delete the file.
    """
    if self.fd is not None:
      os.close(self.fd)
      self.fd = None
      if remove:
        try:
          os.unlink(self.path)
        except FileNotFoundError:
          pass
