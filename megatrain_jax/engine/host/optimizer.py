"""The host update path: each unit's next state from its gradient.

`HostOptimizer` joins a `StateStore` (where each unit's master, optimizer state and
accumulated gradient live) and a `UnitUpdater` (how they change). A unit is updated
as soon as its gradient is on the host, while the backward goes on
(`update_unit`), or, when the updater needs every gradient first, all of them after
the sweep (`update_all`). Either way the new compute-dtype copy of the unit is made
in a separate call after the update: on the CPU backend, XLA ran an update with that
extra output about 2x slower than the update and a cast apart (32M parameters:
157 ms against 68 ms + the cast).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine.config import HOST_CHUNK
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.host.probe import resolve_mode
from megatrain_jax.engine.host.store import HostStore, StateStore
from megatrain_jax.engine.host.updaters import UnitUpdater


class HostOptimizer:
  """Updates the units of a `StateStore` with a `UnitUpdater`.

  Attributes:
    store: where each unit's state lives.
    updater: how it changes.
    sumsq: unit -> the sum of squares of the gradient its last update applied
      (before any clip; a host fp32 scalar), written by the updating thread.
  """

  def __init__(self, store: StateStore, updater: UnitUpdater, compute_dtype,
               stream_sharding: jax.sharding.Sharding | None = None):
    """Joins a store and an updater.

    Args:
      store: the state.
      updater: the update (the one the store was built with).
      compute_dtype: the dtype of the streaming copies.
      stream_sharding: where a new compute-dtype copy is written (None: beside the
        master).
    """
    self.store, self.updater = store, updater
    self.compute_dtype, self.stream_sharding = compute_dtype, stream_sharding
    self._casts: dict[Any, Callable] = {}
    self.sumsq: dict[int, jax.Array] = {}

  @classmethod
  def of_buffers(cls, optimizer: optax.GradientTransformation, masters: Sequence[Any],
                 mode: str = "auto", compute_dtype=jnp.float32,
                 host_device: jax.Device | None = None, threads: int | None = None,
                 chunk: int = HOST_CHUNK) -> "HostOptimizer":
    """A host optimizer over plain flat buffers (each unit one leaf, {"w": buffer},
    the whole tree their list): for benchmarks, calibration and tests.

    Args:
      optimizer: the transform.
      masters: flat fp32 buffers (numpy or CPU-backend arrays).
      mode: as `EngineConfig.optimizer_mode`.
      compute_dtype: the streaming copies' dtype.
      host_device: the CPU device (default: the first).
      threads: threads of the fused AdamW.
      chunk: elements per step of its loop.

    Returns:
      The `HostOptimizer`.
    """
    specs = [FlatSpec({"w": jax.ShapeDtypeStruct((int(np.shape(m)[0]),), jnp.float32)})
             for m in masters]
    host_device = host_device or jax.local_devices(backend="cpu")[0]
    updater = resolve_mode(optimizer, [s.abstract() for s in specs], mode,
                           assemble=list).make(host_device, threads, chunk, assemble=list,
                                               split=list)
    return cls(HostStore(updater, specs, masters, host_device), updater, compute_dtype)

  def update_unit(self, u: int, grad: jax.Array, stream: bool = True) -> jax.Array | None:
    """A unit's update from its gradient of the step's last micro-batch, plus its
    accumulated earlier ones.

    The fused AdamW update is done when this returns (its parts run on the update
    threads); other transforms are dispatched, not awaited. The caller has checked
    the gradient is finite (the gradient templates report it from the device): a
    check in here would need a select between the old and the new state, which
    measured 4x slower on the CPU backend than the donated, in-place update.

    Args:
      u: the unit.
      grad: its flat gradient of the trained elements, on the host.
      stream: make its new compute-dtype copy.

    Returns:
      The new compute-dtype flat copy, or None with `stream=False`.

    Raises:
      ValueError: the gradient's shape is not the unit's trained elements'.
    """
    spec = self.store.trained[u]
    if tuple(grad.shape) != (spec.size,):
      raise ValueError(f"The gradient of unit {u} has shape {tuple(grad.shape)}; its "
                       f"trained parameters have ({spec.size},).")
    acc = self.store.take_gradient(u)
    self.sumsq[u] = self.store.update(u, self.updater, grad, acc)
    return self.stream_copy(u) if stream else None

  def update_all(self, stream: bool = True,
                 on_unit: Callable[[int, jax.Array | None], None] | None = None) -> None:
    """After the sweep: every unit's update from its accumulated gradient (the
    updater's `sweep`: each unit, clipped by the global norm, or the whole tree).

    Args:
      stream: make the new compute-dtype copies.
      on_unit: `on_unit(u, copy)`, as each unit's update is done (fused) or
        dispatched (otherwise).

    Raises:
      RuntimeError: a unit that trains has no accumulated gradient.
    """
    store = self.store
    grads = [store.take_gradient(u) for u in range(len(store.specs))]
    missing = [u for u, (g, s) in enumerate(zip(grads, store.trained)) if g is None and s.size]
    if missing:
      raise RuntimeError(f"No gradient accumulated for units {missing}.")
    done = on_unit or (lambda u, new: None)

    def updated(u, sumsq):
      if sumsq is not None:
        self.sumsq[u] = sumsq
      done(u, self.stream_copy(u) if stream else None)
    self.updater.sweep(store, grads, updated)

  def stream_copy(self, u: int) -> jax.Array:
    """The compute-dtype flat copy of a unit (its master cast, its frozen elements).

    Args:
      u: the unit.

    Returns:
      A new array in `stream_sharding` (or beside the master).
    """
    cd, parts = self.compute_dtype, self.store.fetch_parts(u)
    key = tuple((p.shape, p.dtype) for p in parts)
    if key not in self._casts:
      self._casts[key] = jax.jit(lambda ps: jnp.concatenate(ps).astype(cd),
                                 out_shardings=self.stream_sharding)
    return self._casts[key](parts)

  def close(self) -> None:
    """Stops the update threads (a later update starts them again) and lets the store's
    pending writes finish. Idempotent.

    Raises:
      What a pending write of the store met.
    """
    self.updater.close()
    self.store.close()
