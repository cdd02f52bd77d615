"""One contiguous buffer per unit: the layout a layer moves in, one transfer."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class FlatSpec:
  """Maps a unit's parameter tree to a flat vector and back.

  Leaves are laid out in `jax.tree` order, each C-contiguous. `unflatten` is
  slices and reshapes, so it runs inside a jit at no cost beyond XLA's views.
  """

  def __init__(self, tree: Any):
    leaves, self.treedef = jax.tree.flatten(tree)
    self.shapes = [tuple(np.shape(x)) for x in leaves]
    self.sizes = [math.prod(s) for s in self.shapes]
    self.offsets = list(np.cumsum([0] + self.sizes[:-1]).astype(int))
    self.size = int(sum(self.sizes))

  def __eq__(self, other):
    return (isinstance(other, FlatSpec) and self.treedef == other.treedef
            and self.shapes == other.shapes)

  def __hash__(self):
    return hash((self.treedef, tuple(self.shapes)))

  def flatten(self, tree: Any) -> jax.Array:
    """Tree -> flat vector (traceable).

    Args:
      tree: a tree of this layout.

    Returns:
      Its leaves raveled and concatenated in `jax.tree` order.
    """
    leaves = self.treedef.flatten_up_to(tree)
    return jnp.concatenate([jnp.reshape(x, (-1,)) for x in leaves])

  def flatten_np(self, tree: Any, dtype=np.float32) -> np.ndarray:
    """Tree -> flat host vector, copying each leaf once into a fresh buffer.

    Args:
      tree: a tree of this layout (numpy or host arrays).
      dtype: the vector's dtype.

    Returns:
      A new numpy vector of `size` elements.
    """
    out = np.empty((self.size,), dtype)
    for leaf, off, n in zip(self.treedef.flatten_up_to(tree), self.offsets, self.sizes):
      out[off:off + n] = np.asarray(leaf, dtype).reshape(-1)
    return out

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
