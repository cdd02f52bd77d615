"""Where each unit's fp32 master, optimizer state and gradient accumulator live.

`StateStore` is what the update path and a checkpoint read and write, unit by unit;
`HostStore` keeps it all in host RAM as CPU-backend arrays (the store behind every
trainer today). A unit's state is its `UnitState`: the fp32 master of the elements
that train, in the parts its updater splits it into, and each part's optimizer
state. Beside it: the unit's frozen elements (in the frozen dtype; no master, no
state, no gradient), its gradient accumulator (fp32, while micro-batches or a
deferred update need one), and, for a transform over the whole tree, that tree's
state (`shared`). An update takes a unit (`take`, which first lets a snapshot being
written copy what is about to be donated) and puts its next state back (`put`).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine.host.flat import FlatSpec, split_master
from megatrain_jax.engine.host.store_parts import SHARED, CheckpointParts
from megatrain_jax.engine.host.updaters import UnitState, UnitUpdater



class StateStore(abc.ABC):
  """Each unit's state, read and written by the update path and by checkpoints.

  Attributes:
    specs: each unit's full layout (trained elements first).
    trained: each unit's layout of its trained elements (what updates see).
  """
  specs: list[FlatSpec]
  trained: list[FlatSpec]
  tier = "host"

  @abc.abstractmethod
  def take(self, u: int) -> UnitState:
    """A unit's state for an update that donates it.

    Args:
      u: the unit.

    Returns:
      Its `UnitState`.
    """

  @abc.abstractmethod
  def put(self, u: int, st: UnitState) -> None:
    """A unit's next state, after an update.

    Args:
      u: the unit.
      st: the state.
    """

  def update(self, u: int, updater: UnitUpdater, grad: jax.Array, acc: jax.Array | None,
             norm: jax.Array | None = None) -> jax.Array | None:
    """A unit's update: its state taken, changed by `updater`, and put back.

    Args:
      u: the unit.
      updater: the update (the one the store was built with).
      grad: its gradient of the last micro-batch (flat, on the host).
      acc: the sum of its earlier micro-batches' gradients (fp32), or None.
      norm: the global gradient norm to clip by, or None.

    Returns:
      With `acc`, the summed gradient's sum of squares (`Updated.sumsq`); else None.
    """
    new = updater.update(self.trained[u], self.take(u), grad, acc, norm)
    self.put(u, new.state)
    return new.sumsq

  @abc.abstractmethod
  def take_shared(self) -> Any:
    """The whole tree's optimizer state, for an update that donates it.

    Returns:
      The state (the store's copy is then the update's to donate).
    """

  @abc.abstractmethod
  def put_shared(self, state: Any) -> None:
    """The whole tree's next optimizer state.

    Args:
      state: the state.
    """

  @abc.abstractmethod
  def accumulate(self, u: int, grad: jax.Array) -> None:
    """Adds a micro-batch's gradient to a unit's fp32 accumulator.

    Args:
      u: the unit.
      grad: its flat gradient of the trained elements, on the host.
    """

  @abc.abstractmethod
  def take_gradient(self, u: int) -> jax.Array | None:
    """A unit's accumulated gradient, forgotten here.

    Args:
      u: the unit.

    Returns:
      The fp32 sum, or None.
    """

  def close(self) -> None:
    """Lets pending writes finish and frees what the store holds outside RAM."""

  def io_stats(self) -> dict[str, Any] | None:
    """What the store read and wrote outside RAM.

    Returns:
      Counters by name, or None for a store in RAM.
    """
    return None

  @abc.abstractmethod
  def fetch_parts(self, u: int) -> tuple[jax.Array, ...]:
    """What a fetch casts into a unit's compute-dtype copy: its master's parts, then
    its frozen elements.

    Args:
      u: the unit.

    Returns:
      The host arrays, in the order of the unit's flat layout.
    """


class HostStore(CheckpointParts, StateStore):
  """Every unit's state in host RAM (CPU-backend arrays), made and updated in place."""
  copies = None  # the streaming copies' files, where a store keeps them (`DiskStore`)

  def __init__(self, updater: UnitUpdater, specs: Sequence[FlatSpec],
               masters: Sequence[Any], host_device: jax.Device, frozen_dtype=jnp.float32):
    """Takes over the unit's flat masters and builds the optimizer state beside them.

    Args:
      updater: how the units update (it says how a master splits into parts).
      specs: each unit's full layout.
      masters: each unit's flat fp32 vector (numpy or a CPU-backend array), or its
        (trained fp32, frozen) pair (`FlatSpec.split_np`); a list is emptied as the
        store takes them over, so the host never holds two copies.
      host_device: the CPU device the state lives on.
      frozen_dtype: the dtype frozen elements are kept in.
    """
    self._layout(updater, specs, host_device)
    self.parts: list[tuple[jax.Array, ...]] = []
    for u, (spec, bounds) in enumerate(zip(self.specs, self.bounds)):
      flat, frozen = split_master(masters[u], spec)
      self.parts.append(tuple(self._put(flat[lo:hi], np.float32) for lo, hi in bounds))
      self.frozen.append(None if frozen is None else self._put(frozen, frozen_dtype))
      if isinstance(masters, list):
        masters[u] = None  # its parts hold it now: never two copies of the model
    self.states = [updater.init(t, p) for t, p in zip(self.trained, self.parts)]
    self.shared = updater.init_shared(self.trained, [p[0] for p in self.parts])

  def _layout(self, updater: UnitUpdater, specs: Sequence[FlatSpec],
              host_device: jax.Device) -> None:
    """What every store holds whatever its tier: the layouts, the parts each master
    splits into, and empty lists of frozen elements, their checksums and the
    gradient accumulators."""
    self.updater, self.specs = updater, list(specs)
    self.trained = [s.trained() for s in self.specs]
    self.sharding = jax.sharding.SingleDeviceSharding(host_device)
    self.bounds = [updater.bounds(s.train_size) for s in self.specs]
    self._before_donate: Callable[[Sequence[Any]], None] | None = None
    self._jits: dict[Any, Callable] = {}
    self.frozen: list[jax.Array | None] = []
    self._frozen_sums: list[int | None] = [None] * len(self.specs)
    self.accum: list[jax.Array | None] = [None] * len(self.specs)

  def _put(self, x, dtype) -> jax.Array:
    return jax.device_put(np.asarray(x, dtype), self.sharding)

  def _jit(self, key, fn, **kw):
    if key not in self._jits:
      self._jits[key] = jax.jit(fn, **kw)
    return self._jits[key]

  # -- the update path -----------------------------------------------------------

  def set_before_donate(self, hook: Callable[[Sequence[Any]], None] | None) -> None:
    """Sets (or clears, with None) what runs before an update donates buffers.

    Args:
      hook: called with the part names (units, and `SHARED`) about to change, on
        the thread that runs the update.
    """
    self._before_donate = hook

  def _donating(self, names) -> None:
    hook = self._before_donate
    if hook is not None:
      hook(names)

  def take(self, u):
    self._donating([u])
    return self._get(u)

  def put(self, u, st):
    self._set(u, st)

  def _get(self, u: int) -> UnitState:
    """A unit's current state (its buffers, not copies)."""
    return UnitState(self.parts[u], self.states[u])

  def _set(self, u: int, st: UnitState) -> None:
    """Makes `st` a unit's current state."""
    self.parts[u], self.states[u] = st.master, st.opt

  def _abstract(self, u: int) -> UnitState:
    """A unit's state's shapes and dtypes (its arrays, or stand-ins with them)."""
    return self._get(u)

  def take_shared(self):
    self._donating([SHARED])
    return self.shared

  def put_shared(self, state):
    self.shared = state

  def accumulate(self, u, grad):
    if self.accum[u] is None:
      self.accum[u] = self._jit("first", lambda g: g.astype(jnp.float32),
                                out_shardings=self.sharding)(grad)
    else:
      self.accum[u] = self._jit("add", lambda a, g: a + g.astype(jnp.float32),
                                donate_argnums=(0,))(self.accum[u], grad)

  def take_gradient(self, u):
    acc, self.accum[u] = self.accum[u], None
    return acc

  def drop_gradients(self) -> None:
    """Forgets every accumulated gradient (a skipped or failed step)."""
    self.accum = [None] * len(self.specs)

  def fetch_parts(self, u):
    return self.parts[u] if self.frozen[u] is None else (*self.parts[u], self.frozen[u])

  def nonfinite_units(self) -> list[int]:
    """Units whose accumulated gradient holds a NaN or an infinity.

    Returns:
      Their indices.
    """
    check = self._jit("finite", lambda a: jnp.all(jnp.isfinite(a)))
    flags = [None if a is None else check(a) for a in self.accum]
    return [u for u, ok in enumerate(flags) if ok is not None and not bool(ok)]

  # -- reading -------------------------------------------------------------------

  def master(self, u: int) -> np.ndarray:
    """A copy of a unit's whole flat vector: its fp32 master, then its frozen
    elements (as fp32).

    Args:
      u: the unit.

    Returns:
      A numpy vector in the unit's flat layout.
    """
    parts = [np.asarray(p) for p in self._get(u).master]
    if self.frozen[u] is not None:
      parts.append(np.asarray(self.frozen[u], np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)

  def gradient(self, u: int) -> np.ndarray | None:
    """A copy of a unit's accumulated fp32 gradient.

    Args:
      u: the unit.

    Returns:
      A numpy vector of its trained elements, or None.
    """
    return None if self.accum[u] is None else np.array(self.accum[u])

  def master_bytes(self) -> int:
    """Host bytes of every fp32 master and frozen element.

    Returns:
      The bytes.
    """
    return (sum(p.nbytes for parts in self.parts for p in parts)
            + sum(f.nbytes for f in self.frozen if f is not None))

  def state_bytes(self) -> int:
    """Host bytes of the optimizer state.

    Returns:
      The bytes.
    """
    return sum(x.nbytes for x in jax.tree.leaves([self.states, self.shared])
               if hasattr(x, "nbytes"))
