"""How a unit's master and optimizer state change: one class per way of updating.

Each `UnitUpdater` reads a unit's `UnitState` (its fp32 master, in parts, and the
state of each part) and returns the next one. What the store holds, where, and who
waits for whom is elsewhere (`host.store`, `host.optimizer`); an updater only does
the arithmetic, as jitted host calls with the old buffers donated.

  FusedAdamW     `mt.optim.adamw`: optax's AdamW operations on each part of the
                 unit's flat master, in place, a cache-sized chunk at a time, one
                 host thread per part (`host.adamw`); or piece by piece (disk tier).
  OptaxUnits     any transform that is element-wise (the probe proved it): optax on
                 each unit's parameter tree, one jitted call per unit.
  GlobalNormClip `mt.optim.clip_by_global_norm(max_norm, inner)`: the norm from every
                 unit's accumulated gradient after the sweep, then `inner` (one of
                 the two above) on each unit, clipped by it.
  WholeTree      anything else: one update over the whole tree after the sweep.

Which one a transform gets is `probe.resolve_mode`'s answer; `deferred` says whether
its updates wait for the whole sweep. The step's global gradient norm is summed from
each unit's gradient's sum of squares, before any clip (`host.norms`): the device's
(the gradient templates make it) when a step has one micro-batch, else the update's
(`Updated.sumsq`, read in the fused AdamW's own pass over the summed gradient, or in
Optax's per-unit call); a sweep after the whole step gives each unit's sum to
`on_unit`.
"""

from __future__ import annotations

import abc
import concurrent.futures
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine.config import HOST_CHUNK
from megatrain_jax.engine.host.adamw import chunked_adamw_update, host_threads, part_bounds, \
    piece_adamw_update
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.host.unit_state import Jits, UnitState, Updated
from megatrain_jax.optim import AdamW, ClipThen, clip_with_norm


class UnitUpdater(abc.ABC):
  """How a unit's master and optimizer state change from its gradient.

  Attributes:
    mode: "per_unit", "clipped" or "whole_tree" (`stats()["optimizer_mode"]`).
    fused: whether it is the fused AdamW (`stats()["fused_optimizer"]`).
    deferred: its updates wait for every gradient of the step.
    pieces: it updates each piece of a unit on its own (`update_pieces`).
    threads: the host threads its updates run on.
  """
  mode = "per_unit"
  fused = False
  deferred = False
  pieces = False
  threads = 1

  def __init__(self, host: jax.sharding.Sharding):
    self.host = host
    self.jit = Jits()

  def describe(self) -> str:
    """What the log says of it beyond its mode.

    Returns:
      "" unless overridden.
    """
    return ""

  def bounds(self, size: int, piece: int | None = None) -> list[tuple[int, int]]:
    """How a master of `size` elements splits into parts.

    Args:
      size: its trained elements.
      piece: with `pieces`, the most elements a part may have (None: no limit).

    Returns:
      [lo, hi) of each part (one part unless overridden).
    """
    return [(0, size)]

  def update_pieces(self, spec: FlatSpec, pieces: Sequence[tuple[int, Any, Any]],
                    grad: jax.Array, acc: jax.Array | None,
                    norm: jax.Array | None = None) -> list[tuple[Any, Any, jax.Array]]:
    """Some parts of a unit's next state, each on its own (with `pieces`).

    Args:
      spec: the layout of its trained elements.
      pieces: (first element, master part, its optimizer state) of each, donated.
      grad: the unit's whole gradient, as `update`'s.
      acc: its accumulated gradient, or None.
      norm: the global gradient norm to clip by, or None.

    Returns:
      (new master part, new state, its gradient's sum of squares) of each.

    Raises:
      TypeError: an updater of whole units (`pieces` false).
    """
    raise TypeError(f"{type(self).__name__} updates whole units, not pieces.")

  @abc.abstractmethod
  def init(self, spec: FlatSpec, master: tuple[jax.Array, ...]) -> tuple[Any, ...]:
    """The optimizer state of a unit's parts.

    Args:
      spec: the layout of its trained elements.
      master: its parts.

    Returns:
      One state per part.
    """

  @abc.abstractmethod
  def update(self, spec: FlatSpec, st: UnitState, grad: jax.Array, acc: jax.Array | None,
             norm: jax.Array | None = None) -> Updated:
    """A unit's next state (the buffers of `st` are donated).

    Args:
      spec: the layout of its trained elements.
      st: its state.
      grad: its gradient of the last micro-batch (flat, on the host).
      acc: the sum of its earlier micro-batches' gradients (fp32), or None.
      norm: the global gradient norm to clip by, or None.

    Returns:
      The new state and the gradient's sum of squares.
    """

  def init_shared(self, specs: Sequence[FlatSpec], masters: Sequence[jax.Array]) -> Any:
    """The optimizer state of the whole tree, when it is not each unit's.

    Args:
      specs: each unit's layout of its trained elements.
      masters: each unit's first part.

    Returns:
      None (each unit has its own state).
    """
    del specs, masters
    return None

  def sweep(self, store, grads: list[jax.Array | None],
            on_unit: Callable[[int, jax.Array | None], None]) -> None:
    """Every unit's update after the sweep, from its accumulated gradient.

    Args:
      store: the `StateStore` (each unit taken and put back).
      grads: each unit's accumulated fp32 gradient (None: it does not train).
      on_unit: `on_unit(u, sumsq)` as each unit is done (sumsq: its gradient's sum
        of squares, None when it does not train).
    """
    self._each(store, grads, on_unit, None)

  def _each(self, store, grads, on_unit, norm, sums=None) -> None:
    for u, g in enumerate(grads):
      sumsq = None
      if g is not None:  # the accumulated gradient, passed whole: its sum apart
        sumsq = sums[u] if sums is not None else _sumsq(self.jit, g)
        store.update(u, self, g, None, norm)
      on_unit(u, sumsq)

  def close(self) -> None:
    """Stops any thread of its own (a later update starts it again)."""


class FusedAdamW(UnitUpdater):
  """`mt.optim.adamw` on flat parts, in place, one host thread per part."""
  fused = True
  pieces = True

  def __init__(self, host, hyper, threads: int | None = None, chunk: int = HOST_CHUNK,
               max_norm: float | None = None):
    """An updater for AdamW's hyperparameters.

    Args:
      host: the CPU device's sharding.
      hyper: `mt.optim.AdamWHyper`.
      threads: parts (and threads) per unit (None: one per CPU).
      chunk: elements per step of each part's loop.
      max_norm: the clip, when it runs under `GlobalNormClip`.

    Raises:
      ValueError: a bad thread count or chunk.
    """
    super().__init__(host)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
      raise ValueError(f"threads must be a positive integer or None, got {threads!r}.")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
      raise ValueError(f"chunk must be a positive integer, got {chunk!r}.")
    self.hyper, self.max_norm = hyper, max_norm
    self.threads, self.chunk = threads or host_threads(), chunk
    self._tx = optax.adamw(hyper.learning_rate, b1=hyper.b1, b2=hyper.b2, eps=hyper.eps,
                           eps_root=hyper.eps_root, weight_decay=hyper.weight_decay)
    self._pool = None  # the part threads, started at the first update

  @classmethod
  def accepts(cls, optimizer) -> bool:
    """Whether this updater runs `optimizer` (`mt.optim.adamw` or `adam`).

    Args:
      optimizer: a transform.

    Returns:
      The answer.
    """
    return isinstance(optimizer, AdamW)

  def describe(self):
    return f" (fused AdamW on {self.threads} threads)"

  def bounds(self, size, piece=None):
    parts = self.threads if piece is None else max(self.threads, -(-size // piece))
    return part_bounds(size, parts, self.chunk)

  def init(self, spec, master):
    init = self.jit("init", self._tx.init, out_shardings=self.host)
    return tuple(init(p) for p in master)

  def update(self, spec, st, grad, acc, norm=None):
    los = np.cumsum([0] + [p.shape[0] for p in st.master[:-1]])  # the parts' offsets
    fns = [self.jit(("part", spec.train_size, p.shape[0], int(lo)),
                    chunked_adamw_update(self.hyper, int(lo), self.chunk, self.max_norm),
                    donate_argnums=(0, 1)) for p, lo in zip(st.master, los)]
    results = self._map(lambda j: fns[j](st.master[j], st.opt[j], grad, acc, norm), range(len(fns)))
    return Updated(UnitState(tuple(r[0] for r in results), tuple(r[1] for r in results)),
                   None if acc is None else sum(r[2] for r in results))

  def update_pieces(self, spec, pieces, grad, acc, norm=None):
    def run(piece):
      lo, master, opt = piece
      fn = self.jit(("piece", spec.train_size, master.shape[0]),
                    piece_adamw_update(self.hyper, master.shape[0], self.chunk, self.max_norm),
                    donate_argnums=(0, 1))
      return fn(master, opt, grad, acc, norm, np.int32(lo))
    return self._map(run, pieces)

  def _map(self, fn, items) -> list:  # fn of each item, on the part threads, awaited
    run, items = lambda x: jax.block_until_ready(fn(x)), list(items)
    if len(items) > 1 and self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, "megatrain-adamw")
    return [run(items[0])] if len(items) == 1 else list(self._pool.map(run, items))

  def close(self):
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None


class OptaxUnits(UnitUpdater):
  """An element-wise Optax transform, on each unit's parameter tree."""

  def __init__(self, host, optimizer, max_norm: float | None = None):
    """An updater for `optimizer`.

    Args:
      host: the CPU device's sharding.
      optimizer: an element-wise `optax.GradientTransformation`.
      max_norm: the clip, when it runs under `GlobalNormClip`.
    """
    super().__init__(host)
    self.optimizer, self.max_norm = optimizer, max_norm

  def init(self, spec, master):
    opt = self.optimizer
    fn = self.jit(("init", spec), lambda m: opt.init(spec.unflatten(m)),
                  out_shardings=self.host)
    return (fn(master[0]),)

  def update(self, spec, st, grad, acc, norm=None):
    opt, max_norm = self.optimizer, self.max_norm

    def step(master, state, grad, acc, norm):
      g = grad.astype(jnp.float32)
      sumsq = None
      if acc is not None:
        g = acc + g
        sumsq = jnp.sum(jnp.square(g))
      if norm is not None:
        g = clip_with_norm(g, norm, max_norm)
      p = spec.unflatten(master)
      upd, state = opt.update(spec.unflatten(g), state, p)
      return spec.flatten(optax.apply_updates(p, upd)), state, sumsq

    fn = self.jit(("update", spec, acc is None, norm is None), step, donate_argnums=(0, 1))
    master, state, sumsq = fn(st.master[0], st.opt[0], grad, acc, norm)
    return Updated(UnitState((master,), (state,)), sumsq)


class GlobalNormClip(UnitUpdater):
  """Global-norm clipping split per unit: after the sweep, the norm from every
  unit's accumulated gradient, then the inner updater on each unit, clipped by it."""
  mode = "clipped"
  deferred = True

  def __init__(self, inner: UnitUpdater):
    """Clips before `inner` (made with the clip's `max_norm`).

    Args:
      inner: a `FusedAdamW` or `OptaxUnits`.
    """
    super().__init__(inner.host)
    self.inner = inner
    self.fused, self.pieces, self.threads = inner.fused, inner.pieces, inner.threads

  @classmethod
  def accepts(cls, optimizer) -> bool:
    """Whether `optimizer` is `mt.optim.clip_by_global_norm(max_norm, inner)`.

    Args:
      optimizer: a transform.

    Returns:
      The answer (the inner transform still has to be element-wise).
    """
    return isinstance(optimizer, ClipThen)

  def describe(self):
    return self.inner.describe()

  def bounds(self, size, piece=None):
    return self.inner.bounds(size, piece)

  def init(self, spec, master):
    return self.inner.init(spec, master)

  def update(self, spec, st, grad, acc, norm=None):
    return self.inner.update(spec, st, grad, acc, norm)

  def update_pieces(self, spec, pieces, grad, acc, norm=None):
    return self.inner.update_pieces(spec, pieces, grad, acc, norm)

  def sweep(self, store, grads, on_unit):
    sums = [None if g is None else _sumsq(self.jit, g) for g in grads]
    norm = self.jit("norm", lambda s: jnp.sqrt(sum(s)))([x for x in sums if x is not None])
    self._each(store, grads, on_unit, norm, sums)

  def close(self):
    self.inner.close()


class WholeTree(UnitUpdater):
  """Any transform, on the whole tree at once, after the sweep. Its state is the
  whole tree's (`init_shared`), not each unit's."""
  mode = "whole_tree"
  deferred = True

  def __init__(self, host, optimizer, assemble: Callable, split: Callable):
    """An updater for `optimizer` over the model's tree.

    Args:
      host: the CPU device's sharding.
      optimizer: any `optax.GradientTransformation`.
      assemble: unit trees -> the whole tree.
      split: the whole tree -> unit trees.
    """
    super().__init__(host)
    self.optimizer, self.assemble, self.split = optimizer, assemble, split

  def init(self, spec, master):
    return ()

  def init_shared(self, specs, masters):
    tree = lambda ms: self.assemble([s.unflatten(m) for s, m in zip(specs, ms)])
    return jax.jit(lambda ms: self.optimizer.init(tree(ms)), out_shardings=self.host)(
        list(masters))

  def update(self, spec, st, grad, acc, norm=None):
    raise RuntimeError("A whole-tree transform updates every unit at once (`sweep`).")

  def sweep(self, store, grads, on_unit):
    specs = store.trained
    opt, tree = self.optimizer, lambda xs: self.assemble(
        [s.unflatten(x) for s, x in zip(specs, xs)])

    def step(masters, state, grads):
      p = tree(masters)
      upd, state = opt.update(tree(grads), state, p)
      new = self.split(optax.apply_updates(p, upd))
      return [s.flatten(t) for s, t in zip(specs, new)], state

    fn = self.jit("update_all", step, donate_argnums=(0, 1))
    states = [store.take(u) for u in range(len(specs))]
    zeros = lambda s: jnp.zeros((s.train_size,), jnp.float32)
    masters, shared = fn([st.master[0] for st in states], store.take_shared(),
                         [zeros(s) if g is None else g for s, g in zip(specs, grads)])
    store.put_shared(shared)
    for u, (m, g) in enumerate(zip(masters, grads)):
      store.put(u, UnitState((m,), ()))
      on_unit(u, None if g is None else _sumsq(self.jit, g))


def _sumsq(jit: Jits, g: jax.Array) -> jax.Array:
  """A gradient's sum of squares, as one jitted host call."""
  return jit("sumsq", lambda a: jnp.sum(jnp.square(a)))(g)
