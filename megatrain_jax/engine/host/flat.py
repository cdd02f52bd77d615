"""One contiguous buffer per unit: the layout a layer moves in, one transfer."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class FlatSpec:
  """Maps a unit's parameter tree to a flat vector and back.

  The leaves that train come first, then the frozen ones (`trainable`), each group
  in `jax.tree` order, each leaf C-contiguous; `train_size` elements train. So a
  gradient, a master and the optimizer's view of a unit are the vector's first
  `train_size` elements (`trained`), and a frozen leaf never needs a gradient.
  `unflatten` is slices and reshapes, so it runs inside a jit at no cost beyond
  XLA's views.
  """

  def __init__(self, tree: Any, trainable: Any = None):
    """The layout of `tree`.

    Args:
      tree: a unit's parameter tree (arrays or ShapeDtypeStructs).
      trainable: a tree of bools of the same structure (None: every leaf trains).
    """
    leaves, self.treedef = jax.tree.flatten(tree)
    flags = [True] * len(leaves) if trainable is None else \
        [bool(f) for f in self.treedef.flatten_up_to(trainable)]
    self.order = [i for i, f in enumerate(flags) if f] + [i for i, f in enumerate(flags) if not f]
    self.trains = tuple(flags)
    self.shapes = [tuple(np.shape(x)) for x in leaves]
    self.sizes = [math.prod(s) for s in self.shapes]
    offsets, at = [0] * len(leaves), 0
    for i in self.order:
      offsets[i], at = at, at + self.sizes[i]
    self.offsets = offsets
    self.size = int(sum(self.sizes))
    self.train_size = int(sum(n for n, f in zip(self.sizes, flags) if f))

  def __eq__(self, other):
    return (isinstance(other, FlatSpec) and self.treedef == other.treedef
            and self.shapes == other.shapes and self.trains == other.trains)

  def __hash__(self):
    return hash((self.treedef, tuple(self.shapes), self.trains))

  @property
  def frozen_size(self) -> int:
    """Elements of the leaves that do not train."""
    return self.size - self.train_size

  def trained(self) -> "FlatSpec":
    """The layout of the leaves that train alone: the unit's tree with a frozen
    leaf's place empty (None), what its optimizer state and its update see.

    Returns:
      The `FlatSpec` of the first `train_size` elements.
    """
    if self.train_size == self.size:
      return self
    leaves = [jax.ShapeDtypeStruct(s, jnp.float32) if f else None
              for s, f in zip(self.shapes, self.trains)]
    return FlatSpec(self.treedef.unflatten(leaves))

  def flatten(self, tree: Any) -> jax.Array:
    """Tree -> flat vector (traceable).

    Args:
      tree: a tree of this layout.

    Returns:
      Its leaves raveled and concatenated, trained ones first.
    """
    leaves = self.treedef.flatten_up_to(tree)
    if not self.order:  # a unit with nothing that trains (`trained()` of a frozen one)
      return jnp.zeros((0,), jnp.float32)
    return jnp.concatenate([jnp.reshape(leaves[i], (-1,)) for i in self.order])

  def split_np(self, tree: Any, frozen_dtype=np.float32) -> tuple[np.ndarray, np.ndarray | None]:
    """Tree -> (the trained leaves' flat fp32 vector, the frozen leaves' flat vector in
    `frozen_dtype`, or None without any), each leaf copied once: a frozen leaf is
    never widened to fp32 beyond what it was given in.

    Args:
      tree: a tree of this layout (numpy or host arrays).
      frozen_dtype: the frozen vector's dtype.

    Returns:
      The two vectors.
    """
    trained = np.empty((self.train_size,), np.float32)
    frozen = np.empty((self.frozen_size,), frozen_dtype) if self.frozen_size else None
    for leaf, off, n, f in zip(self.treedef.flatten_up_to(tree), self.offsets, self.sizes,
                               self.trains):
      if f:
        trained[off:off + n] = np.asarray(leaf, np.float32).reshape(-1)
      else:
        at = off - self.train_size
        frozen[at:at + n] = np.asarray(leaf).reshape(-1).astype(frozen_dtype, copy=False)
    return trained, frozen

  def abstract(self, dtype=jnp.float32) -> Any:
    """The unit's tree of `jax.ShapeDtypeStruct`s (for eval_shape; no memory).

    Args:
      dtype: every leaf's dtype.

    Returns:
      The abstract tree.
    """
    return self.treedef.unflatten([jax.ShapeDtypeStruct(s, dtype) for s in self.shapes])

  def unflatten(self, flat: Any) -> Any:
    """Flat vector -> tree (traceable; numpy in gives numpy views).

    Args:
      flat: a vector of `size` elements.

    Returns:
      The tree, each leaf a reshaped slice of `flat`.
    """
    leaves = [flat[off:off + n].reshape(shape)
              for off, n, shape in zip(self.offsets, self.sizes, self.shapes)]
    return self.treedef.unflatten(leaves)

  def unflatten_split(self, trained: Any, frozen: Any) -> Any:
    """The tree from its trained and frozen parts, each leaf a slice of one of them
    (traceable). Differentiated in `trained`, a frozen leaf then has no gradient at
    all: joining the parts into one vector first would make every leaf depend on
    `trained`, and the backward would compute the frozen weights' gradients too.

    Args:
      trained: the first `train_size` elements.
      frozen: the rest (ignored when nothing is frozen).

    Returns:
      The tree.
    """
    leaves = [(trained[off:off + n] if t else
               frozen[off - self.train_size:off - self.train_size + n]).reshape(shape)
              for off, n, shape, t in zip(self.offsets, self.sizes, self.shapes, self.trains)]
    return self.treedef.unflatten(leaves)


def split_master(master, spec: FlatSpec) -> tuple[Any, Any]:
  """A unit's initial values as (trained fp32 elements, frozen elements or None).

  Args:
    master: its flat vector, or its (trained, frozen) pair (`FlatSpec.split_np`).
    spec: its layout.

  Returns:
    The pair.
  """
  if isinstance(master, tuple):
    return master
  flat = np.asarray(master)
  return flat, (flat[spec.train_size:] if spec.frozen_size else None)
