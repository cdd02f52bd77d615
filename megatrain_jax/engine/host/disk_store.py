"""The disk tier: each unit's fp32 master and optimizer state in a file (`host.disk`),
read ahead of its update and written back behind it (`EngineConfig(state_tier="disk")`).

RAM keeps the compute-dtype copies, the frozen elements, the gradient accumulators, a
whole-tree transform's state, and a few pieces of units' states, which stream through
the fused AdamW's updates (`host.disk_pieces`); or, with another transform, at most
`depth` units' states read ahead, the one being updated and `depth` being written.
Reads follow the order the last step's updates came in (the backward's before the
first step), wrapping to the next step's first units; a unit not read ahead is read
when its update asks (`misses`). Each unit's file is in the state directories in turn
(striped). docs/engine.md, "The disk tier", says what this costs and guarantees.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine.host.disk import CHUNK, FILE_PATTERN, FileLayout, UnitFile
from megatrain_jax.engine.host.disk_copies import CopyFiles
from megatrain_jax.engine.host.disk_pieces import PieceUpdates
from megatrain_jax.engine.host.disk_support import Buffers, Busy, DiskFigures, UpdateOrder, \
    check_space, lock_dir, remove_files, state_dirs, striped_bytes, striped_path
from megatrain_jax.engine.host.flat import FlatSpec, split_master
from megatrain_jax.engine.host.store import HostStore
from megatrain_jax.engine.host.updaters import UnitState, UnitUpdater

class DiskStore(PieceUpdates, DiskFigures, HostStore):
  """Every unit's master and optimizer state in its own file; pieces or units in RAM."""
  tier = "disk"

  def __init__(self, updater: UnitUpdater, specs: Sequence[FlatSpec], masters: Iterable[Any],
               host_device: jax.Device, frozen_dtype, state_dir: str | Sequence[str],
               depth: int = 2, io_threads: int = 4, piece: int | None = None,
               copy_dtype=jnp.float32, copy_files: bool = False):
    """Writes every unit's initial state to its file, one unit in RAM at a time.

    Args:
      updater: how the units update.
      specs: each unit's full layout.
      masters: each unit's initial values, as `HostStore`'s, taken one at a time (an
        iterator is consumed only after the directories passed their checks).
      host_device: the CPU device.
      frozen_dtype: the dtype frozen elements are kept in (in RAM).
      state_dir: the directories (`state_dirs`).
      depth: units read ahead, and units written behind, at most (pieces, with an
        updater that updates pieces: `disk_pieces`).
      io_threads: threads reading and writing.
      piece: with such an updater, the most elements of a piece (None: its parts).
      copy_dtype: the streaming copies' dtype.
      copy_files: keep the streaming copies in files too (`copies`, `disk_copies`),
        each written here from its unit's initial master.

    Raises:
      DiskStateError: a directory is missing, read-only, too small or in use.
    """
    self._layout(updater, specs, host_device)
    self.bounds = [updater.bounds(s.train_size, piece) for s in self.specs]
    self.depth, self.dirs = depth, state_dirs(state_dir)
    n = len(self.specs)
    self._templates = [self._template(u) for u in range(n)]
    self.layouts = [FileLayout.of((x.shape, x.dtype) for x in self._leaves(t))
                    for t in self._templates]
    self.busy = {"read": Busy(), "write": Busy(), "any": Busy()}
    self.copies = (CopyFiles(self.dirs, [s.size for s in self.specs], copy_dtype, self.busy)
                   if copy_files else None)
    need = striped_bytes(self.dirs, self.layouts)
    if self.copies is not None:
      need = [a + b for a, b in zip(need, striped_bytes(self.dirs, self.copies.layouts))]
    check_space(self.dirs, need)
    self._locks, self._files = [], []  # filled below; released by the finalizer
    self._finalizer = weakref.finalize(self, remove_files, self._files, self._locks,
                                       [] if self.copies is None else self.copies.files)
    try:
      self._locks.extend(lock_dir(d) for d in self.dirs)
      self._files.extend(UnitFile(striped_path(self.dirs, u, FILE_PATTERN), u,
                                  os.urandom(16), self.layouts[u]) for u in range(n))
      if self.copies is not None:
        self.copies.open()
    except BaseException:
      self._finalizer()  # no files or locks left behind
      raise
    self._gen = [0] * n
    self._cv = threading.Condition()
    self._ready: dict[int, UnitState] = {}  # in RAM and current
    self._reads: dict[int, concurrent.futures.Future] = {}
    self._writes: dict[int, concurrent.futures.Future] = {}
    self._taken: set[int] = set()  # in an update: their files are about to be replaced
    self._uncopied: set[int] = set()  # put, their streaming copy not yet cast from RAM
    # Reads keep one buffer per read ahead at once; writes their small bounce buffers.
    ahead = max(depth, updater.threads) if updater.pieces else depth
    self._buffers, self._bounce = Buffers(keep=ahead), Buffers()
    self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, "megatrain-disk")
    self._init_pieces(ahead, copy_dtype)
    self.order = UpdateOrder(n, sum(1 for t in self.trained if t.size))
    self._failed: BaseException | None = None
    self.misses, self.read_bytes, self.write_bytes = 0, 0, 0
    whole = updater.mode == "whole_tree"
    kept = []
    try:
      for u, master in enumerate(masters):  # one unit in RAM at a time
        flat, frozen = split_master(master, self.specs[u])
        del master
        parts = tuple(self._put(flat[lo:hi], np.float32) for lo, hi in self.bounds[u])
        self.frozen.append(None if frozen is None else self._put(frozen, frozen_dtype))
        del flat, frozen
        self._write_now(u, UnitState(parts, updater.init(self.trained[u], parts)))
        if self.copies is not None:
          fz = () if self.frozen[u] is None else (self.frozen[u],)
          self.copies.write(u, jnp.concatenate([*parts, *fz]).astype(copy_dtype))
        kept.append(parts[0] if whole else None)
    except BaseException:
      self._pool.shutdown(wait=True)
      self._finalizer()  # no files or locks left behind
      raise
    # A whole-tree transform's state is the tree's, made from every master at once.
    self.shared = updater.init_shared(self.trained, kept) if whole else None
    del kept

  # -- layout --------------------------------------------------------------------

  def _template(self, u: int) -> UnitState:
    """The shapes and dtypes of a unit's state, without making it."""
    parts = tuple(jax.ShapeDtypeStruct((hi - lo,), np.float32) for lo, hi in self.bounds[u])
    opt = jax.eval_shape(lambda *ps: self.updater.init(self.trained[u], ps), *parts)
    return UnitState(parts, tuple(opt))

  @staticmethod
  def _leaves(st: UnitState) -> list[Any]:
    return [*st.master, *jax.tree.leaves(st.opt)]

  def _abstract(self, u):
    return self._templates[u]

  def _from_leaves(self, u: int, arrays: Sequence[Any]) -> UnitState:
    t = self._templates[u]
    k = len(t.master)
    leaves, treedef = jax.tree.flatten(t.opt)
    # Copies the update owns (and so updates in place, donated), done before the read
    # buffer is reused: on the I/O thread, not the update's.
    put = lambda a: jnp.array(a, copy=True, device=self.sharding)
    st = UnitState(tuple(put(a) for a in arrays[:k]),
                   treedef.unflatten([put(a) for a in arrays[k:k + len(leaves)]]))
    return jax.block_until_ready(st)

  # -- I/O -----------------------------------------------------------------------

  def _write_now(self, u: int, st: UnitState) -> None:
    self._gen[u] += 1
    self.write_bytes += self.layouts[u].file_bytes
    self._write(u, st, self._gen[u])

  def _write(self, u: int, st: UnitState, gen: int) -> None:
    arrays = [np.asarray(x) for x in self._leaves(st)]
    with self._bounce(CHUNK) as bounce, self.busy["write"](), self.busy["any"]():
      self._files[u].write(arrays, gen, bounce)

  def _file(self, u: int) -> UnitFile:
    if not self._finalizer.alive:
      raise RuntimeError("The disk tier's state files are removed when the trainer "
                         "closes: read params() or save a checkpoint before close().")
    return self._files[u]

  def _read(self, u: int, gen: int | None = None) -> UnitState:
    with self._buffers(self.layouts[u].data_bytes) as buf:
      with self.busy["read"](), self.busy["any"]():
        arrays = self._file(u).read(self._gen[u] if gen is None else gen, buffer=buf)
      with self._cv:
        self.read_bytes += self.layouts[u].file_bytes
      return self._from_leaves(u, arrays)  # copies: the buffer is free after

  def _read_ahead(self, units) -> None:
    """Starts reading these units' states, unless in RAM, on their way, or being written
    (which then stay in RAM when written). Called with or without the lock held."""
    with self._cv:
      for u in units:
        if (u not in self._ready and u not in self._reads and u not in self._taken
            and self.trained[u].size):
          self._reads[u] = self._pool.submit(self._read, u, self._gen[u])

  # -- the update path -----------------------------------------------------------

  def take(self, u):
    """A unit's state for its update: read ahead, or read now (a miss).

    Args:
      u: the unit.

    Returns:
      Its `UnitState` (host arrays the update may donate).

    Raises:
      DiskStateError: its file is damaged, or an earlier write failed.
    """
    self._donating([u])
    with self._cv:
      self._check_writes()
      self.order.begin(u)
      self._taken.add(u)
      write, read = self._writes.get(u), self._reads.pop(u, None)
    if write is not None:
      write.result()  # the buffers are donated by the update: the write reads them first
    if read is not None:
      st = read.result()
    else:
      with self._cv:
        st = self._ready.pop(u, None)
      if st is None:
        self.misses += 1
        st = self._read(u)
    with self._cv:
      self._ready.pop(u, None)
    self._read_ahead(self.order.after(u)[:self.depth])
    return st

  def put(self, u, st):
    """Queues a unit's new state for writing (it stays in RAM until written).

    Args:
      u: the unit.
      st: its state.

    Raises:
      DiskStateError: an earlier write failed.
    """
    with self._cv:
      stale = self._reads.pop(u, None)  # of the state `st` replaces
    if stale is not None:
      concurrent.futures.wait([stale])  # never read the file while it is rewritten
    with self._cv:
      while len(self._writes) >= self.depth:  # bounded: wait for the oldest
        self._check_writes()
        self._cv.wait(1.0)
      self._check_writes()
      self._taken.discard(u)
      self._uncopied.add(u)
      self._gen[u] += 1
      self.write_bytes += self.layouts[u].file_bytes  # counted as it is queued
      self._ready[u] = st  # the streaming copy is cast from it next
      fut = self._pool.submit(self._write, u, st, self._gen[u])
      self._writes[u] = fut
    fut.add_done_callback(lambda f, u=u, st=st: self._written(u, st, f))

  def _written(self, u: int, st: UnitState | None, fut) -> None:
    with self._cv:
      if self._writes.get(u) is fut:
        del self._writes[u]
      if fut.exception() is not None:
        self._failed = self._failed or fut.exception()
      elif (st is not None and self._ready.get(u) is st and u not in self._upcoming()
            and u not in self._uncopied):
        del self._ready[u]  # written, copied and not needed soon: out of RAM
      self._cv.notify_all()

  def _upcoming(self) -> set[int]:
    return set(self.order.upcoming()[:self.depth])

  def _check_writes(self) -> None:
    if self._failed is not None:
      raise self._failed

  def flush(self) -> None:
    """Waits for every write; raises what one met.

    Raises:
      DiskStateError: a write failed.
    """
    with self._cv:
      writes = list(self._writes.values())
    for f in writes:
      f.result()
    with self._cv:
      self._check_writes()

  def fetch_parts(self, u):
    """A unit's master parts and frozen elements, from RAM or its file's head.

    Args:
      u: the unit.

    Returns:
      The host arrays.
    """
    with self._cv:
      copies = self.piece_copies.pop(u, None)
      st = self._ready.get(u)
      if copies is not None:  # cast piece by piece as the update went
        return (*copies, *(() if self.frozen[u] is None else (self.frozen[u],)))
      if u in self._uncopied:  # the streaming copy of a put state: its last use in RAM
        self._uncopied.discard(u)
        if u not in self._writes and u not in self._upcoming():
          self._ready.pop(u, None)
    master = st.master if st is not None else self._master(u)
    return master if self.frozen[u] is None else (*master, self.frozen[u])

  def _master(self, u: int) -> tuple[jax.Array, ...]:
    """A unit's master parts alone, read from its file (a third of its state)."""
    with self._cv:
      write, read, st = self._writes.get(u), self._reads.get(u), self._ready.get(u)
    if st is not None or read is not None:
      return self._get(u).master
    if write is not None:
      write.result()
    k = len(self._templates[u].master)
    with self.busy["read"](), self.busy["any"]():
      views = self._file(u).read(self._gen[u], leaves=range(k))
    with self._cv:
      self.read_bytes += sum(v.nbytes for v in views)
    return tuple(jnp.array(v, copy=True, device=self.sharding) for v in views)

  # -- reads and writes outside the update path (checkpoints, params) -------------

  def _get(self, u):
    with self._cv:
      write, read, st = self._writes.get(u), self._reads.get(u), self._ready.get(u)
    if st is not None:
      return st
    if read is not None:  # its update takes it later: read here, never donated
      return read.result()
    if write is not None:
      write.result()
    return self._read(u)

  def _set(self, u, st):
    self.flush()
    self._drop_pieces(u)
    with self._cv:
      self._ready.pop(u, None)
      read = self._reads.pop(u, None)
    if read is not None:
      read.result()
    self._write_now(u, st)

  def close(self) -> None:
    """Lets the pending writes finish, then removes the state files (a run's working
    state, not a checkpoint) and releases the directories. Idempotent.

    Raises:
      DiskStateError: a pending write failed.
    """
    if not self._finalizer.alive:
      return
    try:
      self.flush()
    finally:
      self._pool.shutdown(wait=True)
      with self._cv:
        self._reads.clear()
        self._ready.clear()
        self._piece_reads.clear()
        self.piece_copies.clear()
      self._finalizer()

