"""What a unit's update reads and gives (`UnitState`, `Updated`), and the jitted host
calls the updaters and stores make once and reuse (`Jits`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax


class UnitState(NamedTuple):
  """A unit's trainable state, as an update reads and writes it.

  Attributes:
    master: the fp32 master of its trained elements, as consecutive parts.
    opt: the optimizer state of each part (empty when the state is the whole tree's).
  """
  master: tuple[jax.Array, ...]
  opt: tuple[Any, ...]


class Updated(NamedTuple):
  """What a unit's update gives.

  Attributes:
    state: the unit's new state.
    sumsq: with an accumulated gradient (`acc`), the sum of squares of the summed
      gradient it applied, before any clip (a host fp32 scalar); else None.
  """
  state: UnitState
  sumsq: jax.Array | None


class Jits:
  """Jitted functions by key, each made once."""

  def __init__(self):
    self._fns: dict[Any, Callable] = {}

  def __call__(self, key, fn, **kw) -> Callable:
    if key not in self._fns:
      self._fns[key] = jax.jit(fn, **kw)
    return self._fns[key]
