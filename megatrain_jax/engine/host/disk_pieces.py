"""The disk tier's update a piece at a time: a unit's state streams from its file
through the update and back, so RAM holds a few pieces, never whole units.

With an updater that updates each part of a unit on its own (`UnitUpdater.pieces`,
the fused AdamW), a unit's master is cut into pieces of about
`EngineConfig.state_piece_mb` MiB, whole chunks (`adamw.part_bounds`), each a part
with its own optimizer state and its own arrays in the unit's file. A unit's update
then reads its pieces, `ahead` at a time ahead of the ones being updated; updates
them `ahead` at a time, on the updater's threads; casts each new master piece to the
compute dtype (the unit's streaming copy is joined from them); and writes each back
in place, at most `ahead` behind. When every piece is written, the file's header
takes their checksums and the new generation (`UnitFile.commit`). Once a unit is
done, the first pieces of the next units in the order the updates come in are read
ahead, while the backward goes on.
docs/engine.md, "The disk tier", says what this holds in RAM and what it costs.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine.host.disk import CHUNK, round_up


class PieceUpdates:
  """The piece-by-piece updates of `DiskStore` (a part of it: its lock, pool, files
  and read buffers are theirs too)."""

  def _init_pieces(self, ahead: int, copy_dtype) -> None:
    """Sets up the piece state.

    Args:
      ahead: pieces read ahead, updated at once, and written behind, at most each
        (`state_in_flight`, and at least one per update thread).
      copy_dtype: the streaming copies' dtype (each new piece is cast to it).
    """
    self._piece_ahead = ahead
    self._piece_reads: dict[tuple[int, int], concurrent.futures.Future] = {}
    self._piece_writes: collections.deque = collections.deque()  # of every unit, in order
    self.piece_copies: dict[int, list[jax.Array]] = {}  # unit -> its new copy, in pieces
    self.piece_held = self.piece_peak = 0  # bytes of pieces in RAM (read, not yet written)
    cd = jnp.dtype(copy_dtype)
    cast = jax.jit(lambda x: x.astype(cd))
    self._piece_cast = lambda x: x if x.dtype == cd else cast(x)  # a new piece: no copy

  def update(self, u, updater, grad, acc, norm=None):
    """A unit's update (as `StateStore.update`): a piece at a time when `updater`
    updates pieces, else the whole unit taken and put back.

    Args:
      u: the unit.
      updater: the update.
      grad: its gradient of the last micro-batch.
      acc: its accumulated gradient, or None.
      norm: the global norm to clip by, or None.

    Returns:
      With `acc`, the summed gradient's sum of squares; else None.

    Raises:
      DiskStateError: a read or write failed, or a file is damaged.
    """
    if not updater.pieces:
      return super().update(u, updater, grad, acc, norm)
    return self._update_pieces(u, updater, grad, acc, norm)

  def _piece_leaves(self, u: int, j: int) -> list[int]:
    """The file's leaves of piece j of unit u: its master part, then its state."""
    t = self._templates[u]
    n = len(jax.tree.leaves(t.opt[0])) if t.opt else 0
    return [j] + [len(t.master) + j * n + i for i in range(n)]

  def _piece_hold(self, nbytes: int) -> None:
    with self._cv:
      self.piece_held += nbytes
      self.piece_peak = max(self.piece_peak, self.piece_held)

  def _read_piece(self, u: int, j: int, gen: int) -> tuple[Any, Any]:
    """Piece j of unit u as of write `gen`: its master part and state, as arrays the
    update owns (copied out of the read buffer)."""
    leaves = self._piece_leaves(u, j)
    lay = [self.layouts[u].leaves[i] for i in leaves]
    nbytes, padded = sum(leaf.nbytes for leaf in lay), sum(round_up(x.nbytes) for x in lay)
    with self._buffers(padded) as buf:
      with self.busy["read"](), self.busy["any"]():
        arrays = self._file(u).read(gen, leaves=leaves, buffer=buf)
      put = lambda a: jnp.array(a, copy=True, device=self.sharding)
      treedef = jax.tree.structure(self._templates[u].opt[j])
      piece = jax.block_until_ready((put(arrays[0]), treedef.unflatten(
          [put(a) for a in arrays[1:]])))
    with self._cv:
      self.read_bytes += padded + self.layouts[u].header_bytes  # as read: header each time
    self._piece_hold(nbytes)
    return piece

  def _write_piece(self, u: int, j: int, master, opt) -> dict[int, int]:
    arrays = [master, *jax.tree.leaves(opt)]
    with self._bounce(CHUNK) as bounce, self.busy["write"](), self.busy["any"]():
      crcs = self._file(u).write_leaves(
          {i: np.asarray(a) for i, a in zip(self._piece_leaves(u, j), arrays)}, bounce)
    self._piece_hold(-sum(x.nbytes for x in arrays))
    return crcs

  def _read_pieces_ahead(self, units) -> None:
    """Starts reading the first pieces of these units, `ahead` pieces in all (with
    those already on their way). Called with the store's lock held.

    Args:
      units: the units, in the order their updates come.
    """
    budget = self._piece_ahead - len(self._piece_reads)
    for u in units:
      if budget <= 0 or u in self._taken or u in self._writes or not self.trained[u].size:
        continue
      for j in range(min(budget, len(self.bounds[u]))):
        if (u, j) not in self._piece_reads:
          self._piece_reads[(u, j)] = self._pool.submit(self._read_piece, u, j, self._gen[u])
          budget -= 1

  def _drop_pieces(self, u: int) -> None:
    """Forgets the pieces of a unit read ahead (its file is about to change).

    Args:
      u: the unit.
    """
    with self._cv:
      futs = [self._piece_reads.pop(k) for k in [k for k in self._piece_reads if k[0] == u]]
    for f in futs:
      if f.exception() is None:
        self._piece_hold(-sum(x.nbytes for x in jax.tree.leaves(f.result())))

  def _update_pieces(self, u: int, updater, grad, acc, norm):
    spec, bounds, ahead = self.trained[u], self.bounds[u], self._piece_ahead
    self._donating([u])
    with self._cv:
      self._check_writes()
      self.order.begin(u)
      self._taken.add(u)
      write = self._writes.get(u)  # its last update's header, maybe not yet written
      reads = {j: self._piece_reads.pop((u, j)) for j in range(len(bounds))
               if (u, j) in self._piece_reads}
      gen = self._gen[u]
      if 0 not in reads:
        self.misses += 1  # not read ahead: the update waits for its first read
    if write is not None:
      write.result()

    def read(j):
      if j < len(bounds) and j not in reads:
        reads[j] = self._pool.submit(self._read_piece, u, j, gen)

    def get(j):
      read(j)
      return reads.pop(j).result()

    writes, copies, sums = [], [], []
    try:
      for w0 in range(0, len(bounds), ahead):
        wave = range(w0, min(len(bounds), w0 + ahead))
        for j in range(wave.stop, wave.stop + ahead):  # the next wave, read meanwhile
          read(j)
        out = updater.update_pieces(spec, [(bounds[j][0], *get(j)) for j in wave],
                                    grad, acc, norm)
        for j, (master, opt, ss) in zip(wave, out):
          copies.append(self._piece_cast(master))
          sums.append(ss)
          writes.append(self._pool.submit(self._write_piece, u, j, master, opt))
          self._piece_writes.append(writes[-1])
        del out
        self._bound_piece_writes(ahead)
    except BaseException:
      concurrent.futures.wait(writes)
      with self._cv:
        self._taken.discard(u)
      raise
    finally:
      concurrent.futures.wait(list(reads.values()))
      for f in reads.values():  # read for a wave that never ran
        if f.exception() is None:
          self._piece_hold(-sum(x.nbytes for x in jax.tree.leaves(f.result())))
    # The header once every piece is written, by the thread that writes the last one;
    # until then the unit's write is pending (`_writes`), as a whole unit's would be.
    done = concurrent.futures.Future()
    with self._cv:
      self._gen[u] = gen + 1
      self.write_bytes += self.layouts[u].file_bytes
      self._writes[u] = done
      self._taken.discard(u)
      self.piece_copies[u] = copies
    done.add_done_callback(lambda f: self._written(u, None, f))
    left = [len(writes)]

    def written(_):
      with self._cv:
        left[0] -= 1
        if left[0]:
          return
      try:
        crcs = {}
        for f in writes:
          crcs.update(f.result())
        with self.busy["write"](), self.busy["any"]():
          self._file(u).commit(gen + 1, [crcs[i] for i in range(len(crcs))])
        done.set_result(None)
      except BaseException as e:  # kept for the caller (`_check_writes`)
        done.set_exception(e)

    for f in writes:
      f.add_done_callback(written)
    with self._cv:
      self._read_pieces_ahead(self.order.after(u))
    return None if acc is None else sum(sums)

  def _bound_piece_writes(self, most: int) -> None:
    """Waits, oldest first, until at most `most` piece writes are under way."""
    q = self._piece_writes
    while q and q[0].done():
      q.popleft()
    while sum(not f.done() for f in q) > most:
      q[0].result()
      q.popleft()
