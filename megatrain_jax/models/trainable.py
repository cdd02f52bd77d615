"""Which parameters train: a `trainable=` argument resolved to a mask of the model's tree.

Both trainers take `trainable=`: an NNX filter (`nnx.Param`, the default: every
parameter; `nnx.LoRAParam`; `nnx.PathContains("embed")`; `nnx.All(...)`, ...) or a
predicate over parameter paths, `fn(path) -> bool`, where a path is a tuple like
("blocks", 0, "attn", "q", "kernel") in the layout of `Llama.param_tree()`. NNX
filters see each parameter's variable (its type) with the same path. The mask is a
tree of bools of that layout; a frozen leaf gets no gradient, no optimizer state and
no fp32 master.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
from flax import nnx

from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig

Filter = Any  # an NNX filter, or Callable[[tuple], bool] over parameter paths


def _predicate(trainable: Filter) -> Callable[[tuple, Any], bool]:
  """An NNX-style predicate `(path, variable) -> bool` for `trainable`."""
  if callable(trainable) and not isinstance(trainable, type):
    try:
      positional = [p for p in inspect.signature(trainable).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # a builtin: NNX's own filters are classes
      positional = []
    if len(positional) == 1:
      return lambda path, variable: bool(trainable(path))
  return nnx.filterlib.to_predicate(trainable)


def mask(model_or_cfg: llama.Llama | LlamaConfig, trainable: Filter = None) -> Any:
  """Which of the model's parameters train.

  Args:
    model_or_cfg: the NNX model, or its config (an abstract model is built to
      read each parameter's variable type; nothing is allocated).
    trainable: an NNX filter or a predicate over parameter paths (None: every
      `nnx.Param`).

  Returns:
    A tree of bools in the layout of `Llama.param_tree()`.

  Raises:
    ValueError: nothing trains.
  """
  model = model_or_cfg
  if isinstance(model_or_cfg, LlamaConfig):
    cfg = model_or_cfg
    model = nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0)))
    tree = llama.assemble_units(llama.abstract_units(cfg))
  else:
    tree = model.param_tree()
  keep = _predicate(nnx.Param if trainable is None else trainable)
  flags = {}
  for path, variable in nnx.state(model, nnx.Param).flat_state():
    path = tuple(k for k in path if k != "p")  # `Unit.p` holds each unit's tree
    flags[path] = bool(keep(path, variable))
  if not any(flags.values()):
    raise ValueError(f"trainable={trainable!r} selects no parameter: nothing would train. "
                     "Pass an NNX filter (e.g. nnx.Param, nnx.LoRAParam) or a "
                     "predicate over paths such as ('blocks', 0, 'attn', 'q', 'kernel').")
  return jax.tree_util.tree_map_with_path(
      lambda path, _: flags[tuple(_key(k) for k in path)], tree)


def _key(k) -> Any:
  """A tree path entry as it appears in an NNX path (a dict key or a list index)."""
  return getattr(k, "key", getattr(k, "idx", k))


def unit_masks(model_or_cfg: llama.Llama | LlamaConfig, trainable: Filter = None
               ) -> list[Any] | None:
  """`mask` split into the model's units (embed, each block, head).

  Args:
    model_or_cfg: as `mask`.
    trainable: as `mask`.

  Returns:
    One tree of bools per unit, or None when every parameter trains.
  """
  if trainable is None:
    return None
  m = mask(model_or_cfg, trainable)
  return None if all(jax.tree.leaves(m)) else llama.split_units(m)


def split(params: Any, m: Any) -> tuple[Any, Any]:
  """A parameter tree as (the leaves that train, the frozen ones), each the same
  tree with the other's leaves None.

  Args:
    params: the model's parameter tree.
    m: its mask.

  Returns:
    (trained, frozen).
  """
  pick = lambda keep: jax.tree.map(lambda p, t: p if t == keep else None, params, m)
  return pick(True), pick(False)


def merge(trained: Any, frozen: Any, m: Any) -> Any:
  """`split` undone.

  Args:
    trained: the leaves that train (frozen ones None).
    frozen: the frozen leaves (trained ones None).
    m: the mask.

  Returns:
    The whole parameter tree.
  """
  return jax.tree.map(lambda t, a, b: a if t else b, m, trained, frozen,
                      is_leaf=lambda x: x is None)
