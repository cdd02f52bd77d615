"""The non-finite policy: what a NaN or infinite loss or gradient does to a step.

Every gradient job carries its step's `StepGuard`. A step returns once its backward
is dispatched and its first per-unit update has decided; the last updates run on
while the next step starts, and a bad gradient they find is reported by the next
call (`step`, `wait`, `params`, `close`). The first update of a step waits for
the step's loss, and reads the verdict of the step before.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable, Sequence

import jax

# ("loss", ()), ("grads", (units...)) or ("previous", ()): what went bad.
Bad = tuple[str, tuple[int, ...]]


@dataclasses.dataclass
class StepGuard:
  """One step's per-unit updates, as the optimizer thread finds them."""
  step: int
  prev: "StepGuard | None" = None  # the step before (read once, then dropped)
  loss_parts: list = dataclasses.field(default_factory=list)
  loss: float = math.nan
  loss_checked: bool = False
  bad: Bad | None = None
  updated: list[int] = dataclasses.field(default_factory=list)
  first_done: threading.Event = dataclasses.field(default_factory=threading.Event)
  reported: bool = False
  norm: Any = None  # the step's `host.norms.StepNorm`, when it updates

  def admit(self, u: int, finite_flags: Sequence[jax.Array]) -> bool:
    """Whether unit u's per-unit update may run (optimizer thread).

    The first call of a step checks the step before (bad after some of its
    updates ran: stop) and this step's loss. Then unit u's gradients must all be
    finite (`finite_flags`, one per micro-batch, from the device: each gradient's
    sum of squares, finite when the gradient is). Once one check fails, no further
    update of the step runs.

    Args:
      u: the unit.
      finite_flags: device fp32 scalars, one per micro-batch gradient of u.

    Returns:
      True when the update may run.
    """
    if self.bad is None and not self.loss_checked:
      self.loss_checked = True
      prev, self.prev = self.prev, None  # final: its jobs ran before this one
      if prev is not None and prev.bad is not None and prev.updated:
        self.bad = ("previous", ())
      elif not math.isfinite(sum(float(x) for x in self.loss_parts)):
        self.bad = ("loss", ())
    if self.bad is None and not all(math.isfinite(float(s)) for s in finite_flags):
      self.bad = ("grads", (u,))
    return self.bad is None

  @property
  def late_error_pending(self) -> bool:
    """A bad gradient found after some units were updated, not reported yet."""
    return self.bad is not None and bool(self.updated) and not self.reported


def find_nonfinite(loss: float, bad_units: Sequence[int], grad_order: Sequence[int]
                   ) -> Bad | None:
  """The verdict of a deferred step, all of whose gradients are on the host.

  Args:
    loss: the step's loss.
    bad_units: units whose accumulated gradient is not finite.
    grad_order: the order gradients leave the device (the first named is reported).

  Returns:
    None when everything is finite, else what went bad.
  """
  if not math.isfinite(loss):
    return ("loss", ())
  if bad_units:
    return ("grads", tuple(sorted(bad_units, key=list(grad_order).index)))
  return None


def describe(guard: StepGuard, unit_name: Callable[[int], str]) -> str:
  """What went bad in a step, in words.

  Args:
    guard: the step's guard, with `bad` set.
    unit_name: a unit's name for messages.

  Returns:
    "Non-finite loss nan at step 3", or "Non-finite gradient at step 3 (loss ...):
    first found in layer 0; also in ...".
  """
  kind, units = guard.bad
  if kind == "loss":
    return f"Non-finite loss {guard.loss} at step {guard.step}"
  if kind == "previous":
    return f"Step {guard.step} follows a step that went bad"
  names = [unit_name(u) for u in units]
  return (f"Non-finite gradient at step {guard.step} (loss {guard.loss:.6g}): first "
          f"found in {names[0]}" + (f"; also in {', '.join(names[1:])}" if names[1:] else ""))


def error(guard: StepGuard, unit_name: Callable[[int], str],
          late: bool = False) -> FloatingPointError:
  """The error a bad step raises.

  Args:
    guard: the step's guard, with `bad` set.
    unit_name: a unit's name for messages.
    late: found after the step returned.

  Returns:
    A FloatingPointError saying whether the state is unchanged (no update ran) or
    half-updated (naming the units updated, and that the trainer is now invalid).
  """
  what = describe(guard, unit_name)
  if not guard.updated:
    return FloatingPointError(
        f"{what}. No parameter or optimizer state was changed: the trainer is as it "
        "was before this step. Lower the learning rate, check the data, or set "
        "EngineConfig(nonfinite='skip') to skip such steps.")
  return FloatingPointError(
      f"{what}{' (found after the step returned)' if late else ''}. The per-unit "
      f"updates of {', '.join(unit_name(u) for u in guard.updated)} had already "
      "run during the backward, so the host state is half-updated and this trainer is "
      "now invalid: restore a checkpoint (`restore` revives it) or build a new one. "
      "(With EngineConfig(nonfinite='skip') every gradient is checked before any "
      "update.)")


def first_verdict(guard: StepGuard, loss: float, pipeline, timeout_s: float) -> Bad | None:
  """What a step's per-unit updates found, once the first one decided (the head's,
  made before most of the backward ran). When the step went bad, every queued job
  is waited for, so the state is final before the step reports.

  Args:
    guard: the step's guard.
    loss: the step's loss.
    pipeline: the `GradientPipeline` (its errors are raised while waiting).
    timeout_s: the caller's longest wait.

  Returns:
    None, or what went bad.

  Raises:
    TimeoutError: the first update took longer than `timeout_s`.
  """
  pipeline.wait_until(guard.first_done.is_set, timeout_s, "The first update")
  pipeline.check()
  if guard.bad is None and math.isfinite(loss):
    return None
  pipeline.wait()
  return guard.bad or ("loss", ())
