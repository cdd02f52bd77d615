"""Can a transform run unit by unit? The probe that decides the host optimizer's mode.

An element-wise transform (adam, adamw, lion, sgd, their schedules) gives the same
update whether applied to the whole tree or to each unit alone, so the engine may
update a unit as soon as its gradient is on the host. Anything that mixes leaves
(`clip_by_global_norm`, labels that depend on the layer index) must see the whole
tree. `probe` tells them apart by running the transform both ways on a miniature
copy of the model's units and comparing the *updates* (not the parameters) leaf by
leaf, relative to their own size: a learning rate near zero makes every transform
look element-wise on the parameters, not on the updates. A step whose updates are
all zero (a schedule at zero, MultiSteps between applications) proves nothing; the
probe runs on until two steps had something to compare, and without them the
transform is taken to need the whole tree.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine.config import HOST_CHUNK, OPTIMIZER_MODES
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.host.updaters import (FusedAdamW, GlobalNormClip, OptaxUnits,
                                                UnitUpdater, WholeTree)
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig

# Below this an update is taken as zero (fp32 loses relative precision near 1e-38).
TINY = 1e-30
# Updates compared leaf by leaf within this fraction of the larger one's size.
RTOL = 1e-5
MAX_STEPS = 16
NEEDED_STEPS = 2
FAST_PATH = ("For global-norm clipping use mt.optim.clip_by_global_norm(max_norm, inner), "
             "which the engine splits per unit, and for AdamW mt.optim.adamw.")


class Verdict(NamedTuple):
  """The probe's answer: `separable`, and why (or why not)."""
  separable: bool
  reason: str


class Resolution(NamedTuple):
  """How the host runs a transform: which `UnitUpdater`, on what.

  Attributes:
    kind: the updater class (`FusedAdamW`, `OptaxUnits` or `WholeTree`).
    optimizer: the transform it runs (the inner one under a global-norm clip).
    max_norm: the clip, run as `GlobalNormClip` around `kind`; else None.
    reason: why.
  """
  kind: type
  optimizer: Any
  max_norm: float | None = None
  reason: str = ""

  @property
  def mode(self) -> str:
    """"per_unit", "clipped" or "whole_tree"."""
    return GlobalNormClip.mode if self.max_norm is not None else self.kind.mode

  @property
  def deferred(self) -> bool:
    """Whether the updates wait for every gradient of the step."""
    return self.max_norm is not None or self.kind.deferred

  @property
  def fused(self) -> bool:
    """Whether the update is the fused AdamW."""
    return self.kind.fused

  def make(self, host_device: jax.Device, threads: int | None = None,
           chunk: int = HOST_CHUNK, assemble: Callable = llama.assemble_units,
           split: Callable = llama.split_units) -> UnitUpdater:
    """The updater.

    Args:
      host_device: the CPU device the state lives on.
      threads: threads of the fused AdamW (None: one per CPU).
      chunk: elements per step of its loop.
      assemble: unit trees -> the whole tree (a whole-tree update).
      split: the whole tree -> unit trees.

    Returns:
      A `UnitUpdater`.
    """
    host = jax.sharding.SingleDeviceSharding(host_device)
    if self.kind is WholeTree:
      return WholeTree(host, self.optimizer, assemble, split)
    if self.kind is FusedAdamW:
      updater = FusedAdamW(host, self.optimizer.hyper, threads, chunk, self.max_norm)
    else:
      updater = OptaxUnits(host, self.optimizer, self.max_norm)
    return updater if self.max_norm is None else GlobalNormClip(updater)


def whole_model_units(cfg: LlamaConfig) -> tuple[Any, ...]:
  """Every unit's abstract parameter tree, without allocating.

  Args:
    cfg: the model.

  Returns:
    ShapeDtypeStruct trees of the embedding, each block and the head.
  """
  return llama.abstract_units(cfg)


def miniature_units(cfg: LlamaConfig) -> tuple[Any, ...]:
  """Every unit's tree with each dimension capped at 3, for `probe`.

  Args:
    cfg: the model.

  Returns:
    Abstract fp32 trees, in unit order.
  """
  return tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      tuple(min(d, 3) for d in x.shape), jnp.float32), t) for t in llama.abstract_units(cfg))


def _fill(tree, rng: np.random.Generator, scale: float):
  return jax.tree.map(lambda x: jnp.asarray(
      scale * rng.standard_normal(tuple(min(d, 3) for d in x.shape)), jnp.float32), tree)


def _compare(whole, units: list, step: int, assemble: Callable) -> tuple[bool, str | None]:
  """(any update above TINY, a difference found) between the two ways, leaf by leaf."""
  seen = False
  a_leaves = jax.tree_util.tree_leaves_with_path(whole)
  b_leaves = jax.tree.leaves(assemble(units))
  for (path, a), b in zip(a_leaves, b_leaves, strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    size = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
    if size <= TINY:
      continue
    seen = True
    if np.abs(a - b).max() > RTOL * size:
      return seen, (f"its updates differ at step {step} in "
                    f"{jax.tree_util.keystr(path)} (largest difference "
                    f"{np.abs(a - b).max():.3g} against updates of size {size:.3g}): it "
                    "mixes leaves, e.g. a global norm or labels that depend on the layer")
  return seen, None


def probe(optimizer: optax.GradientTransformation, unit_trees: Sequence[Any],
          max_steps: int = MAX_STEPS, needed: int = NEEDED_STEPS,
          assemble: Callable = llama.assemble_units) -> Verdict:
  """Whether `optimizer` applied unit by unit equals it applied to the whole tree.

  Runs both ways on miniature trees with random gradients whose scale differs
  from unit to unit and from step to step, from 1e-1 to 1e8 (so that any norm-based
  clipping engages, by different factors per unit than over the whole tree).

  Args:
    optimizer: the transform.
    unit_trees: every unit's parameter tree (or abstract tree), in unit order.
    max_steps: steps to run at most.
    needed: steps with a non-zero update that must agree.
    assemble: unit trees -> the whole tree (the model's layout by default).

  Returns:
    The `Verdict`: separable only when `needed` steps had updates to compare and
    all agreed; otherwise the reason (a difference, an error unit by unit, or no
    update to compare).
  """
  rng = np.random.default_rng(0)
  params = [_fill(t, rng, 1.0) for t in unit_trees]
  # Jitted (as the engine runs it): one compilation per distinct tree structure.
  init, update = jax.jit(optimizer.init), jax.jit(optimizer.update)
  apply = jax.jit(optax.apply_updates)
  try:
    whole = assemble(params)
    state = init(whole)
  except Exception as e:  # pylint: disable=broad-except
    return Verdict(False, f"its init fails on the model's tree ({type(e).__name__}: {e})")
  parts, conclusive = list(params), 0
  try:
    states = [init(p) for p in parts]
  except Exception as e:  # pylint: disable=broad-except
    return Verdict(False, f"it fails on a single unit's tree ({type(e).__name__}: {e})")
  for step in range(1, max_steps + 1):
    # Scales up to 1e8: a global-norm clip engages whatever its threshold.
    grads = [_fill(t, rng, float(10 ** rng.uniform(-1, 8))) for t in unit_trees]
    try:
      upd_whole, state = update(assemble(grads), state, whole)
    except Exception as e:  # pylint: disable=broad-except
      return Verdict(False, f"its update fails on the model's tree ({type(e).__name__}: {e})")
    try:
      upd_units = []
      for i, (p, s) in enumerate(zip(parts, states)):
        u, states[i] = update(grads[i], s, p)
        upd_units.append(u)
    except Exception as e:  # pylint: disable=broad-except
      return Verdict(False, f"it fails on a single unit's tree ({type(e).__name__}: {e})")
    seen, difference = _compare(upd_whole, upd_units, step, assemble)
    if difference:
      return Verdict(False, difference)
    conclusive += seen
    if conclusive >= needed:
      return Verdict(True, f"unit-by-unit updates equal whole-tree ones over {step} "
                           "probe steps")
    whole = apply(whole, upd_whole)
    parts = [apply(p, u) for p, u in zip(parts, upd_units)]
  return Verdict(False, f"it made no update to compare in {max_steps} probe steps "
                        f"({conclusive} with one), e.g. a schedule at zero or "
                        "MultiSteps between applications")


def resolve_mode(optimizer: optax.GradientTransformation, unit_trees: Sequence[Any],
                 mode: str, assemble: Callable = llama.assemble_units) -> Resolution:
  """How the host runs `optimizer` under `EngineConfig.optimizer_mode=mode`.

  An updater that names the transform runs it (`FusedAdamW` for `mt.optim.adamw`,
  `GlobalNormClip` for `mt.optim.clip_by_global_norm` over an element-wise
  transform); any other transform is probed: element-wise ones run per unit
  (`OptaxUnits`), the rest on the whole tree (`WholeTree`).

  Args:
    optimizer: the transform.
    unit_trees: every unit's (abstract) parameter tree, in unit order.
    mode: "auto", "per_unit" or "whole_tree".
    assemble: unit trees -> the whole tree (the model's layout by default).

  Returns:
    The `Resolution`.

  Raises:
    ValueError: an unknown mode, or "per_unit" for a transform the probe does not
      prove element-wise.
  """
  if mode not in OPTIMIZER_MODES:
    raise ValueError(f"optimizer_mode={mode!r} is not one of {OPTIMIZER_MODES}.")
  if mode == "whole_tree":
    return Resolution(WholeTree, optimizer, None, "set by hand")
  minis = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      tuple(min(d, 3) for d in x.shape), jnp.float32), t) for t in unit_trees]
  if FusedAdamW.accepts(optimizer):
    return Resolution(FusedAdamW, optimizer, None, "mt.optim.adamw is element-wise")
  if GlobalNormClip.accepts(optimizer):
    inner = optimizer.inner
    fused = FusedAdamW.accepts(inner)
    verdict = (Verdict(True, "mt.optim.adamw") if fused
               else probe(inner, minis, assemble=assemble))
    if verdict.separable:
      return Resolution(FusedAdamW if fused else OptaxUnits, inner, optimizer.max_norm,
                        "global-norm clip split per unit over an element-wise transform")
  else:
    verdict = probe(optimizer, minis, assemble=assemble)
    if verdict.separable:
      return Resolution(OptaxUnits, optimizer, None, verdict.reason)
  if mode == "per_unit":
    raise ValueError(
        f"optimizer_mode='per_unit' was set, but this transform cannot run unit by unit: "
        f"{verdict.reason}. Use optimizer_mode='auto' or 'whole_tree' (one update over "
        f"the whole tree after the backward). {FAST_PATH}")
  return Resolution(WholeTree, optimizer, None, verdict.reason)


def resolve_for_config(optimizer: optax.GradientTransformation, cfg: LlamaConfig,
                       mode: str, trains: tuple[tuple[bool, ...], ...] | None = None
                       ) -> Resolution:
  """`resolve_mode` over every unit of `cfg` (the parameters that train),
  remembered per (transform, model, mode, mask) so that a preflight and the trainer
  probe a transform once.

  Args:
    optimizer: the transform.
    cfg: the model.
    mode: "auto", "per_unit" or "whole_tree".
    trains: per unit, whether each leaf (in `jax.tree` order) trains (None: all).

  Returns:
    The `Resolution`.

  Raises:
    ValueError: as `resolve_mode`.
  """
  try:
    return _resolve_cached(optimizer, cfg, mode, trains)
  except TypeError:  # a transform that cannot be a cache key
    return resolve_mode(optimizer, trained_units(cfg, trains), mode)


def trained_units(cfg: LlamaConfig, trains: tuple[tuple[bool, ...], ...] | None
                  ) -> tuple[Any, ...]:
  """Every unit's abstract tree of the parameters that train (a frozen leaf's place
  None), what the host update sees.

  Args:
    cfg: the model.
    trains: per unit, whether each leaf trains (None: all).

  Returns:
    ShapeDtypeStruct trees, in unit order.
  """
  units = whole_model_units(cfg)
  if trains is None:
    return units
  return tuple(FlatSpec(t, jax.tree.structure(t).unflatten(f)).trained().abstract()
               for t, f in zip(units, trains))


@functools.lru_cache(maxsize=32)
def _resolve_cached(optimizer, cfg, mode, trains) -> Resolution:
  return resolve_mode(optimizer, trained_units(cfg, trains), mode)
