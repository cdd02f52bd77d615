"""Optax on the host: per-unit updates as gradients arrive, or one whole-tree update.

State lives on the CPU backend. Every update is one jitted call with the master
buffer and optimizer state donated, so the host never holds two copies of them.

Element-wise transforms (adam, adamw, lion, sgd, their schedules) give the same
result whether applied to the whole tree or unit by unit, so the engine updates a
unit as soon as its gradient is on the host, while the backward goes on. A
transform that needs the whole tree (`clip_by_global_norm`, anything mixing
leaves) must see every gradient first; `engine/host/probe.py` tells the two apart.

`mt.optim.adamw` runs fused, and in parallel over parts (`engine/host/adamw.py`).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine.config import HOST_CHUNK
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.host.adamw import chunked_adamw_update, host_threads, part_bounds
from megatrain_jax.engine.host.probe import Resolution, resolve_mode
from megatrain_jax.models.llama import assemble_units, split_units
from megatrain_jax.optim import clip_with_norm


class HostOptimizer:
  """Masters, optimizer state and gradient accumulators of every unit, on the host.

  `parts[u]` is unit u's fp32 master: a tuple of CPU-backend arrays that are
  consecutive ranges of its flat layout. There is one range unless the update is
  the fused AdamW, which gives each of `threads` threads its own range, a whole
  number of `chunk`s. The `masters` given (flat fp32 numpy or CPU-backend arrays)
  become the parts; a list of them is emptied as it goes, so the host never holds
  two copies. Other transforms see each unit as its parameter tree (flat buffers
  are unflattened inside the jit), so masks and per-leaf transforms behave as they
  would on the model.
  """

  def __init__(self, resolution: Resolution, specs: Sequence[FlatSpec],
               masters: Sequence[jax.Array], compute_dtype, host_device: jax.Device,
               stream_sharding: jax.sharding.Sharding | None = None,
               threads: int | None = None, chunk: int = HOST_CHUNK,
               assemble: Callable = assemble_units, split: Callable = split_units):
    """Takes over the masters and builds the optimizer state beside them.

    Args:
      resolution: how to run the transform (`probe.resolve_mode`).
      specs: each unit's flat layout.
      masters: each unit's flat fp32 master (numpy or CPU-backend arrays); a list
        is emptied as the parts take them over.
      compute_dtype: the dtype of the streaming copies.
      host_device: the CPU device the state lives on.
      stream_sharding: where an update writes the new compute-dtype copy (None:
        beside the master).
      threads: threads of the fused AdamW (None: one per CPU).
      chunk: elements per step of the fused AdamW's loop.
      assemble: unit trees -> the whole tree (whole-tree mode).
      split: the whole tree -> unit trees.

    Raises:
      ValueError: a bad thread count or chunk.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
      raise ValueError(f"threads must be a positive integer or None, got {threads!r}.")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
      raise ValueError(f"chunk must be a positive integer, got {chunk!r}.")
    self.specs = list(specs)
    self.assemble, self.split = assemble, split
    self.compute_dtype = compute_dtype
    self.host_sharding = jax.sharding.SingleDeviceSharding(host_device)
    # Where an update writes the new compute-dtype copy (None: beside the master).
    self.stream_sharding = stream_sharding
    self.mode, self.optimizer, self.max_norm, self.fused = resolution[:4]
    optimizer = self.optimizer
    self.threads, self.chunk = threads or host_threads(), chunk
    self.bounds = [part_bounds(s.size, self.threads if self.fused else 1, chunk)
                   for s in self.specs]
    self._jits: dict[Any, Callable] = {}
    self.parts: list[tuple[jax.Array, ...]] = []
    for u, bounds in enumerate(self.bounds):
      self.parts.append(self._split_master(masters[u], bounds))
      if isinstance(masters, list):
        masters[u] = None  # its parts hold it now: never two copies of the model
    self._pool = None  # the fused update's threads, started at its first use
    # Called with the units (and "optimizer" for the whole-tree state) whose
    # buffers an update is about to donate; a pending checkpoint copies them first.
    self._before_donate: Callable[[Sequence[Any]], None] | None = None
    self.accum: list[jax.Array | None] = [None] * len(self.specs)
    on_host = self.host_sharding
    # Per-unit modes: `states[u][j]` is the state of unit u's part j.
    if self.fused:  # optax.adamw's state of each flat part
      init = self._jit("init_flat", optimizer.init, out_shardings=on_host)
      self.states = [[init(p) for p in parts] for parts in self.parts]
    elif self.mode in ("per_unit", "clipped"):  # one part: the state of the unit's tree
      self.states = [
          [self._jit(("init", s), lambda m, s=s: optimizer.init(s.unflatten(m)),
                     out_shardings=on_host)(parts[0])]
          for s, parts in zip(self.specs, self.parts)]
    else:
      self.state = jax.jit(lambda ms: optimizer.init(self._tree(ms)),
                           out_shardings=on_host)(self._whole_masters())

  @classmethod
  def of_buffers(cls, optimizer: optax.GradientTransformation, masters: Sequence[Any],
                 mode: str = "auto", compute_dtype=jnp.float32,
                 host_device: jax.Device | None = None, threads: int | None = None,
                 chunk: int = HOST_CHUNK) -> "HostOptimizer":
    """A host optimizer over plain flat buffers (each unit one leaf, {"w": buffer}),
    the whole tree their list: for benchmarks, calibration and tests.

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
    resolution = resolve_mode(optimizer, [s.abstract() for s in specs], mode, assemble=list)
    return cls(resolution, specs, masters, compute_dtype,
               host_device or jax.local_devices(backend="cpu")[0], threads=threads, chunk=chunk,
               assemble=list, split=list)

  # -- helpers ---------------------------------------------------------------

  def _jit(self, key, fn, **kw):
    if key not in self._jits:
      self._jits[key] = jax.jit(fn, **kw)
    return self._jits[key]

  def _tree(self, flats):
    return self.assemble([s.unflatten(f) for s, f in zip(self.specs, flats)])

  def _split_master(self, master, bounds) -> tuple[jax.Array, ...]:
    """A flat master (numpy, or a CPU-backend array) as CPU-backend parts."""
    if not isinstance(master, jax.Array):
      master = np.asarray(master, np.float32)
      return tuple(jax.device_put(master[lo:hi], self.host_sharding) for lo, hi in bounds)
    if len(bounds) == 1:
      return (master,)
    return tuple(self._jit(("slice", master.shape, lo, hi), lambda m, lo=lo, hi=hi: m[lo:hi],
                           out_shardings=self.host_sharding)(master)
                 for lo, hi in bounds)

  def _whole_masters(self) -> list[jax.Array]:
    """Every unit's single-part master (the non-fused modes hold one part)."""
    return [parts[0] for parts in self.parts]

  def master(self, u: int) -> np.ndarray:
    """A copy of a unit's flat fp32 master.

    Args:
      u: the unit.

    Returns:
      A numpy vector, its parts joined.
    """
    return np.concatenate([np.asarray(p) for p in self.parts[u]])

  def master_bytes(self) -> int:
    """Host bytes of every fp32 master.

    Returns:
      Their total.
    """
    return sum(p.nbytes for parts in self.parts for p in parts)

  @property
  def updates_after_sweep(self) -> bool:
    """True when the transform needs every gradient before any update."""
    return self.mode in ("whole_tree", "clipped")

  def state_bytes(self) -> int:
    """Host bytes of the optimizer state.

    Returns:
      Their total.
    """
    states = self.states if self.mode != "whole_tree" else [self.state]
    return sum(x.nbytes for x in jax.tree.leaves(states) if hasattr(x, "nbytes"))

  def set_before_donate(self, hook: Callable[[Sequence[Any]], None] | None) -> None:
    """Sets (or clears, with None) what runs before an update donates buffers.

    Args:
      hook: called with the state names (units, and "optimizer" for the whole-tree
        state) an update is about to change, on the thread that runs the update.
    """
    self._before_donate = hook

  def _donating(self, names) -> None:
    hook = self._before_donate
    if hook is not None:
      hook(names)

  def close(self) -> None:
    """Stops the update threads (a later update starts them again). Idempotent."""
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  # -- gradients -------------------------------------------------------------

  def accumulate(self, u: int, grad: jax.Array) -> None:
    """Adds a gradient to a unit's fp32 accumulator on the host (donated).

    Args:
      u: the unit.
      grad: its flat gradient, on the host.
    """
    if self.accum[u] is None:
      self.accum[u] = self._jit("first", lambda g: g.astype(jnp.float32),
                                out_shardings=self.host_sharding)(grad)
    else:
      self.accum[u] = self._jit("add", lambda a, g: a + g.astype(jnp.float32),
                                donate_argnums=(0,))(self.accum[u], grad)

  def drop_gradients(self) -> None:
    """Forgets every accumulated gradient (a skipped or failed step)."""
    self.accum = [None] * len(self.specs)

  def drop_gradient(self, u: int) -> None:
    """Forgets a unit's accumulated gradient (its update was refused).

    Args:
      u: the unit.
    """
    self.accum[u] = None

  def gradient(self, u: int) -> np.ndarray | None:
    """A copy of a unit's accumulated fp32 gradient.

    Args:
      u: the unit.

    Returns:
      A numpy vector, or None when nothing is accumulated.
    """
    return None if self.accum[u] is None else np.array(self.accum[u])

  def nonfinite_units(self) -> list[int]:
    """Units whose accumulated gradient holds a NaN or an infinity.

    Returns:
      Their indices.
    """
    check = self._jit("finite", lambda a: jnp.all(jnp.isfinite(a)))
    flags = [check(a) for a in self.accum]
    return [u for u, ok in enumerate(flags) if not bool(ok)]

  def update_unit(self, u: int, grad: jax.Array, stream: bool = True,
                  clip_norm: jax.Array | None = None) -> jax.Array | None:
    """Per-unit update of a unit from a gradient plus its accumulated micro-batch
    gradients.

    The fused AdamW update is done when this returns (its parts run on the update
    threads); other transforms are dispatched, not awaited.

    The caller has checked the gradient is finite (the engine's gradient templates
    report it from the device): a check in here would need a select between the
    old and the new state, which measured 4x slower on the CPU backend than the
    donated, in-place update.
    
    Args:
      u: the unit.
      grad: its flat gradient of the step's last micro-batch, on the host.
      stream: make its new compute-dtype copy.
      clip_norm: the global gradient norm, in clipped mode.

    Returns:
      The new compute-dtype flat copy, or None with `stream=False`.

    Raises:
      ValueError: the gradient's shape is not the unit's flat shape.
    """
    if tuple(grad.shape) != (self.specs[u].size,):
      raise ValueError(f"The gradient of unit {u} has shape {tuple(grad.shape)}; its "
                       f"flat parameters have ({self.specs[u].size},).")
    acc = self.accum[u]
    self.accum[u] = None
    self._donating([u])
    if self.fused:
      self._update_parts(u, grad, acc, clip_norm)
    else:
      self._update_tree(u, grad, acc, clip_norm)
    return self.stream_copy(u) if stream else None

  def _update_parts(self, u, grad, acc, clip_norm) -> None:
    """The fused AdamW update of unit u, each part on its own thread."""
    size = self.specs[u].size
    fns = [self._jit(("part", size, lo),
                     chunked_adamw_update(self.optimizer.hyper, lo, self.chunk,
                                          max_norm=self.max_norm),
                     donate_argnums=(0, 1))
           for lo, _ in self.bounds[u]]

    def run(j):
      out = fns[j](self.parts[u][j], self.states[u][j], grad, acc, clip_norm)
      return jax.block_until_ready(out)

    if len(fns) == 1:
      results = [run(0)]
    else:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, "megatrain-adamw")
      results = list(self._pool.map(run, range(len(fns))))
    self.parts[u] = tuple(p for p, _ in results)
    self.states[u] = [s for _, s in results]

  def _update_tree(self, u, grad, acc, clip_norm) -> None:
    """Unit u's update through optax, on its parameter tree."""
    spec = self.specs[u]
    opt, max_norm = self.optimizer, self.max_norm

    def update(master, state, grad, acc, norm):
      g = grad.astype(jnp.float32)
      if acc is not None:
        g = acc + g
      if norm is not None:
        g = clip_with_norm(g, norm, max_norm)
      p = spec.unflatten(master)
      upd, new_state = opt.update(spec.unflatten(g), state, p)
      return spec.flatten(optax.apply_updates(p, upd)), new_state

    fn = self._jit(("update", spec, acc is None, clip_norm is None), update,
                   donate_argnums=(0, 1))
    master, state = fn(self.parts[u][0], self.states[u][0], grad, acc, clip_norm)
    self.parts[u], self.states[u] = (master,), [state]

  def stream_copy(self, u: int) -> jax.Array:
    """The compute-dtype flat copy of a unit's master.

    A separate call: on the CPU backend XLA runs a multi-output update about 2x
    slower than the update plus this cast (measured: 157 ms against 68 + ~20 ms for
    32M parameters).

    Args:
      u: the unit.

    Returns:
      A new array in `stream_sharding` (or beside the master).
    """
    cd, parts = self.compute_dtype, self.parts[u]
    return self._jit(("cast", tuple(p.shape for p in parts)),
                     lambda ps: jnp.concatenate(ps).astype(cd),
                     out_shardings=self.stream_sharding)(parts)

  def update_all(self, stream: bool = True,
                 on_unit: Callable[[int, jax.Array | None], None] | None = None
                 ) -> list[jax.Array | None]:
    """After the sweep: updates every unit from its accumulated gradient; returns
    their new compute-dtype copies (Nones with `stream=False`).

    Whole-tree mode runs one update over the whole tree; clipped mode computes the
    global norm, then updates each unit in unit order; per-unit mode (deferred to
    check every gradient first) updates each unit.

    Args:
      stream: make the new compute-dtype copies.
      on_unit: `on_unit(u, copy)`, called as each unit's update is done (fused) or
        dispatched (otherwise).

    Returns:
      The new copies, in unit order (Nones with `stream=False`).

    Raises:
      RuntimeError: some unit has no accumulated gradient.
    """
    if any(a is None for a in self.accum):
      missing = [u for u, a in enumerate(self.accum) if a is None]
      raise RuntimeError(f"No gradient accumulated for units {missing}.")
    on_unit = on_unit or (lambda u, new: None)
    grads, self.accum = self.accum, [None] * len(self.specs)
    if self.mode in ("clipped", "per_unit"):
      norm = None
      if self.mode == "clipped":
        sumsq = [self._jit("sumsq", lambda a: jnp.sum(jnp.square(a)))(a) for a in grads]
        norm = self._jit("norm", lambda s: jnp.sqrt(sum(s)))(sumsq)
      out = []
      for u, g in enumerate(grads):
        out.append(self.update_unit(u, g, stream, clip_norm=norm))
        on_unit(u, out[-1])
      return out
    opt = self.optimizer

    def update(masters, state, grads):
      p = self._tree(masters)
      upd, state = opt.update(self._tree(grads), state, p)
      return [s.flatten(t) for s, t in zip(self.specs, self.split(optax.apply_updates(p, upd)))], state

    fn = self._jit("update_all", update, donate_argnums=(0, 1))
    self._donating([*range(len(self.specs)), "optimizer"])
    masters, self.state = fn(self._whole_masters(), self.state, grads)
    self.parts = [(m,) for m in masters]
    out = [self.stream_copy(u) if stream else None for u in range(len(self.specs))]
    for u, new in enumerate(out):
      on_unit(u, new)
    return out

  # -- state for checkpoints -------------------------------------------------
  # A checkpoint holds each unit whole: its parts and their states joined.

  def state_names(self) -> list[Any]:
    """What a checkpoint holds.

    Returns:
      Every unit index, plus "optimizer" (the whole-tree state) in whole-tree mode.
    """
    names: list[Any] = list(range(len(self.specs)))
    return names + ["optimizer"] if self.mode == "whole_tree" else names

  def _unit_state_leaves(self, u: int, join: Callable) -> list[Any]:
    """The leaves of unit u's optimizer state, its parts' leaves joined by `join`."""
    per_part = [jax.tree.leaves(s) for s in self.states[u]]
    return [join(list(xs)) for xs in zip(*per_part)]

  def copy_state(self, name) -> dict[str, np.ndarray]:
    """Host copies of one part of the state.

    Args:
      name: a unit index, or "optimizer".

    Returns:
      "master" and "state_NNN" arrays (the unit whole, its parts joined), or the
      whole-tree state's leaves.
    """
    if name == "optimizer":
      leaves = jax.tree.leaves(self.state)
      return {f"state_{i:03d}": np.array(x) for i, x in enumerate(leaves)}
    out = {"master": self.master(name)}
    if self.mode != "whole_tree":
      join = lambda xs: (np.concatenate([np.asarray(x) for x in xs])
                         if len(xs) > 1 and np.ndim(xs[0]) else np.array(xs[0]))
      for i, x in enumerate(self._unit_state_leaves(name, join)):
        out[f"state_{i:03d}"] = x
    return out

  def state_layout(self, name) -> dict[str, tuple[tuple[int, ...], str]]:
    """What `copy_state(name)` returns, without copying.

    Args:
      name: a unit index, or "optimizer".

    Returns:
      The (shape, dtype) of each array.
    """
    if name == "optimizer":
      leaves = jax.tree.leaves(self.state)
      return {f"state_{i:03d}": (tuple(x.shape), str(x.dtype)) for i, x in enumerate(leaves)}
    out = {"master": ((self.specs[name].size,), "float32")}
    if self.mode != "whole_tree":
      join = lambda xs: ((sum(x.shape[0] for x in xs),) if len(xs) > 1 and xs[0].ndim
                         else tuple(xs[0].shape), str(xs[0].dtype))
      for i, x in enumerate(self._unit_state_leaves(name, join)):
        out[f"state_{i:03d}"] = x
    return out

  def load_state(self, name, arrays: dict[str, np.ndarray]) -> None:
    """Sets one part of the state from host arrays.

    Args:
      name: a unit index, or "optimizer".
      arrays: laid out as `state_layout(name)` says (the caller checked that).
    """
    self._donating([name])  # a snapshot still being written keeps the old part
    put = lambda x: jax.device_put(np.asarray(x), self.host_sharding)
    if name == "optimizer":
      leaves, treedef = jax.tree.flatten(self.state)
      self.state = treedef.unflatten([put(arrays[f"state_{i:03d}"]) for i in range(len(leaves))])
      return
    bounds = self.bounds[name]
    # A part's share of a joined array (count scalars are the same in every part).
    share = lambda a, lo, hi: np.asarray(a)[lo:hi] if len(bounds) > 1 and np.ndim(a) else a
    self.parts[name] = tuple(put(share(arrays["master"], lo, hi)) for lo, hi in bounds)
    if self.mode == "whole_tree":
      return
    states = []
    for j, (lo, hi) in enumerate(bounds):
      leaves, treedef = jax.tree.flatten(self.states[name][j])
      states.append(treedef.unflatten(
          [put(share(arrays[f"state_{i:03d}"], lo, hi)) for i in range(len(leaves))]))
    self.states[name] = states
