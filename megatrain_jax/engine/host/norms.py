"""A step's global gradient norm, summed from its updates as they apply its gradients.

Each update reads its unit's whole gradient anyway; it returns the gradient's sum of
squares (`UnitUpdater.update`), and the optimizer thread adds it to the step's
`StepNorm`, which the step's `StepGuard` carries. The norm is the step's alone
(a retried or restored step number gets a new one); it is complete when every unit
that trains has added its sum, NaN when the step's updates were refused on a bad
value, and an error when an update (or an engine thread) failed.
"""

from __future__ import annotations

import math
import threading
from typing import Any


class StepNorm:
  """The sums of squares of one step's gradients, as its updates apply them."""

  def __init__(self, units: int, timeout_s: float):
    """A norm waiting for `units` sums.

    Args:
      units: the units that train (each adds one sum per step).
      timeout_s: the longest `value()` waits.
    """
    self._left, self._timeout = units, timeout_s
    self._sums: list[Any] = []
    self._refused = False
    self._error: BaseException | None = None
    self._cond = threading.Condition()

  def add(self, sumsq: Any) -> None:
    """One unit's sum (a host scalar), its update applied.

    Args:
      sumsq: the sum of squares of the gradient the update applied.
    """
    with self._cond:
      self._sums.append(sumsq)
      self._left -= 1
      self._cond.notify_all()

  def refuse(self) -> None:
    """The step's updates stopped on a non-finite value: its norm is NaN."""
    with self._cond:
      self._refused = True
      self._cond.notify_all()

  def fail(self, error: BaseException) -> None:
    """An update, or an engine thread, failed: `value()` raises `error`.

    Args:
      error: what failed.
    """
    with self._cond:
      self._error = self._error or error
      self._cond.notify_all()

  def value(self) -> float:
    """The norm, once every unit that trains has added its sum.

    Returns:
      The square root of the sums' total; NaN for a refused step.

    Raises:
      The error an update met; TimeoutError past `timeout_s`.
    """
    with self._cond:
      done = lambda: self._left <= 0 or self._refused or self._error is not None
      if not self._cond.wait_for(done, self._timeout):
        raise TimeoutError(f"The step's updates took over {self._timeout:.0f} s; "
                           "its gradient norm is not known.")
      if self._error is not None:
        raise self._error
      if self._refused:
        return math.nan
      sums = list(self._sums)
    return math.sqrt(sum(float(x) for x in sums))


class LateNorm:
  """A step's global gradient norm, known once the step's last update is done.

  `float(x)` (or formatting it) waits for those updates (`StepNorm.value`); the
  value is then kept. `repr` does not wait.
  """

  def __init__(self, norm: StepNorm):
    """The norm of one step.

    Args:
      norm: the step's sums.
    """
    self._norm, self._value = norm, None
    self._lock = threading.Lock()

  def __float__(self) -> float:
    with self._lock:
      if self._value is None:
        self._value = self._norm.value()
        self._norm = None
      return self._value

  def __format__(self, spec: str) -> str:
    return format(float(self), spec)

  def __repr__(self) -> str:
    return "LateNorm(pending)" if self._value is None else repr(self._value)
