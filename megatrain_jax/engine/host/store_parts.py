"""A store's state as a checkpoint sees it: named parts (each unit whole, its pieces
and their optimizer states joined; the whole tree's state), copied, described and
loaded one at a time (`CheckpointParts`, a part of `host.store.HostStore`)."""

from __future__ import annotations

import zlib
from typing import Any, Callable

import jax
import numpy as np

from megatrain_jax.engine.host.updaters import UnitState

SHARED = "optimizer"  # the checkpoint part of a whole-tree transform's state


class CheckpointParts:
  """The checkpoint side of a store (it uses the store's `_get`, `_set`, `_abstract`,
  `_put`, `_donating`, `bounds`, `frozen` and `shared`)."""

  def state_names(self) -> list[Any]:
    """What a checkpoint holds.

    Returns:
      Every unit index, plus `SHARED` when the state is the whole tree's.
    """
    names: list[Any] = list(range(len(self.specs)))
    return names + [SHARED] if self.shared is not None else names

  @staticmethod
  def _joined(opt: tuple[Any, ...], join: Callable) -> list[Any]:
    per_part = [jax.tree.leaves(s) for s in opt]
    return [join(list(xs)) for xs in zip(*per_part)]

  def copy_state(self, name) -> dict[str, np.ndarray]:
    """Host copies of one part of the state.

    Args:
      name: a unit index, or `SHARED`.

    Returns:
      "master" (the unit's trained elements), "state_NNN" arrays, and "frozen"
      (its frozen elements, read-only: they never change) where it has any; or the
      whole tree's state leaves.
    """
    if name == SHARED:
      return {f"state_{i:03d}": np.array(x)
              for i, x in enumerate(jax.tree.leaves(self.shared))}
    st = self._get(name)
    parts = [np.asarray(p) for p in st.master]
    out = {"master": np.concatenate(parts) if parts else np.zeros(0, np.float32)}
    join = lambda xs: (np.concatenate([np.asarray(x) for x in xs])
                       if len(xs) > 1 and np.ndim(xs[0]) else np.array(xs[0]))
    for i, x in enumerate(self._joined(st.opt, join)):
      out[f"state_{i:03d}"] = x
    if self.frozen[name] is not None:  # never donated nor changed: a view, not a copy
      out["frozen"] = np.asarray(self.frozen[name])
    return out

  def state_layout(self, name) -> dict[str, tuple[tuple[int, ...], str]]:
    """What `copy_state(name)` returns, without copying.

    Args:
      name: a unit index, or `SHARED`.

    Returns:
      The (shape, dtype) of each array.
    """
    if name == SHARED:
      return {f"state_{i:03d}": (tuple(x.shape), str(x.dtype))
              for i, x in enumerate(jax.tree.leaves(self.shared))}
    out = {"master": ((self.specs[name].train_size,), "float32")}
    join = lambda xs: ((sum(x.shape[0] for x in xs),) if len(xs) > 1 and xs[0].ndim
                       else tuple(xs[0].shape), str(xs[0].dtype))
    for i, x in enumerate(self._joined(self._abstract(name).opt, join)):
      out[f"state_{i:03d}"] = x
    if self.frozen[name] is not None:
      out["frozen"] = (tuple(self.frozen[name].shape), str(self.frozen[name].dtype))
    return out

  def load_state(self, name, arrays: dict[str, np.ndarray]) -> None:
    """Sets one part of the state from host arrays.

    Args:
      name: a unit index, or `SHARED`.
      arrays: laid out as `state_layout(name)` says (the caller checked that); without
        "frozen", the unit's frozen elements stay as they are (a checkpoint that
        refers to the base instead of holding it).
    """
    self._donating([name])  # a snapshot still being written keeps the old part
    if name == SHARED:
      leaves, treedef = jax.tree.flatten(self.shared)
      self.shared = treedef.unflatten([self._put(arrays[f"state_{i:03d}"], x.dtype)
                                       for i, x in enumerate(leaves)])
      return
    bounds = self.bounds[name]
    # A part's share of a joined array (count scalars are the same in every part).
    share = lambda a, lo, hi: np.asarray(a)[lo:hi] if len(bounds) > 1 and np.ndim(a) else a
    old = self._abstract(name)
    states = []
    for j, (lo, hi) in enumerate(bounds if old.opt else ()):  # () whole-tree
      leaves, treedef = jax.tree.flatten(old.opt[j])
      states.append(treedef.unflatten([self._put(share(arrays[f"state_{i:03d}"], lo, hi),
                                                 x.dtype) for i, x in enumerate(leaves)]))
    self._set(name, UnitState(tuple(self._put(share(arrays["master"], lo, hi), np.float32)
                                    for lo, hi in bounds), tuple(states)))
    if self.frozen[name] is not None and "frozen" in arrays:  # else: the base as loaded
      self.frozen[name] = self._put(arrays["frozen"], self.frozen[name].dtype)
      self._frozen_sums[name] = None

  def frozen_checksum(self, u: int) -> int:
    """A CRC-32 of a unit's frozen values, computed once (they change only by
    `load_state`).

    Args:
      u: a unit with frozen values.

    Returns:
      The CRC-32 of their bytes.
    """
    if self._frozen_sums[u] is None:
      x = np.ascontiguousarray(np.asarray(self.frozen[u])).reshape(-1)
      self._frozen_sums[u] = zlib.crc32(x.view(np.uint8))
    return self._frozen_sums[u]
