"""Where a fetch's compute-dtype copy of a unit comes from, and the device-resident units.

The fp32 masters and optimizer state live in the `HostOptimizer`. Beside them this
store keeps, per `EngineConfig.stream_copy`, either a compute-dtype streaming copy
of every unit in pinned host memory (one DMA per fetch), or nothing (each fetch
casts the master), or, with the disk tier's store holding them in files
(`host.disk_copies`), nothing in RAM (each fetch reads the unit's file, and each
update rewrites it). Units kept on the device (`stream_embed_head=False`) are
refreshed here after each update.
"""

from __future__ import annotations

import threading

import jax

from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.engine.device.ledger import Ledger
from megatrain_jax.engine.device.transport import Transport


class UnitStore:
  """Each unit's streaming copy (if kept) and device-resident copy (if resident)."""

  def __init__(self, host_opt: HostOptimizer, transport: Transport, compute_dtype,
               keep_copy: bool, ledger: Ledger):
    """Makes the kept copies.

    Args:
      host_opt: the masters.
      transport: moves bytes to the device.
      compute_dtype: the copies' dtype.
      keep_copy: keep a streaming copy of every unit: in pinned host memory, or in
        the files of the store's `copies` where it has them (written already).
      ledger: counts the resident units' device bytes.
    """
    self.host_opt, self.transport, self.cd = host_opt, transport, compute_dtype
    self.keep_copy, self.ledger = keep_copy, ledger
    self._lock = threading.Lock()
    self.files = host_opt.store.copies if keep_copy else None
    self._stream = ([transport.stage(host_opt.stream_copy(u))
                     for u in range(len(host_opt.store.specs))]
                    if keep_copy and self.files is None else None)
    self._resident: dict[int, jax.Array] = {}
    self.resident_h2d_bytes = 0  # fetches of resident units, taken by each step

  def place_resident(self, units) -> None:
    """Puts these units' copies on the device, to stay there between steps.

    Args:
      units: unit indices.
    """
    for u in units:
      self._refresh_resident(u)

  def to_device(self, u: int) -> jax.Array:
    """A unit's compute-dtype copy in device memory.

    Args:
      u: the unit.

    Returns:
      A new device array: from its kept streaming copy (in RAM or read from its
      file), or cast from its master.
    """
    if self.files is not None:
      return self.files.to_device(u, self.transport)
    if self._stream is not None:
      return self.transport.h2d(self._stream[u])
    return self.transport.h2d_cast(self.host_opt.store.fetch_parts(u), self.cd)

  def resident(self, u: int) -> jax.Array | None:
    """A unit's device-resident copy.

    Args:
      u: the unit.

    Returns:
      The copy, or None when the unit is streamed.
    """
    return self._resident.get(u)

  def _refresh_resident(self, u: int) -> None:
    arr = self.to_device(u)
    with self._lock:
      self._resident[u] = arr
      self.resident_h2d_bytes += arr.nbytes
    self.ledger.add(("resident", u), arr.nbytes)

  def updated(self, u: int, new_copy: jax.Array | None) -> None:
    """After a unit's master changed: keeps its new streaming copy and refreshes its
    resident device copy, if any.

    Args:
      u: the unit.
      new_copy: its new compute-dtype copy (None when no copy is kept).
    """
    if new_copy is not None and self.files is not None:
      self.files.write(u, new_copy)
    elif new_copy is not None:
      self._stream[u] = self.transport.stage(new_copy)
    if u in self._resident:
      self._refresh_resident(u)

  def master_changed(self, u: int) -> None:
    """Remakes a unit's copies after its master was set outside an update (a restore).

    Args:
      u: the unit.
    """
    self.updated(u, self.host_opt.stream_copy(u) if self.keep_copy else None)

  def take_resident_h2d_bytes(self) -> int:
    """Bytes moved to refresh resident units since the last call.

    Returns:
      The bytes (the counter restarts at 0).
    """
    with self._lock:
      out, self.resident_h2d_bytes = self.resident_h2d_bytes, 0
    return out

  def stream_bytes(self) -> int:
    """Host bytes of the kept streaming copies.

    Returns:
      Their total, from the arrays themselves (0 when none are kept).
    """
    return 0 if self._stream is None else sum(x.nbytes for x in self._stream)

  def free_device(self) -> None:
    """Drops the resident device copies (the trainer is closing)."""
    for u in list(self._resident):
      self.ledger.remove(("resident", u))
    self._resident.clear()
