"""Whether a streaming trainer may still run: its first failure, closed or not, and what
the last step's updates found after it returned.

A failure on any path (a step, a wait, a late update, a bad restore) marks the
trainer invalid once, here; every later call refuses with the original error named.
"""

from __future__ import annotations

import traceback
from typing import Callable

from absl import logging

from megatrain_jax.engine import nonfinite
from megatrain_jax.engine.runtime import Runtime


class Health:
  """A trainer's validity, shared by its methods."""

  def __init__(self, runtime: Runtime, unit_name: Callable[[int], str]):
    self._rt, self._unit_name = runtime, unit_name
    self.error: BaseException | None = None
    self.closed = False
    self.late = nonfinite.StepGuard(step=0)  # the last step; its updates may run on
    self.skipped = 0

  def check_usable(self) -> None:
    """Refuses an invalid or closed trainer.

    Raises:
      RuntimeError: naming the first failure, or saying the trainer is closed.
    """
    if self.error is not None:
      raise RuntimeError(
          "This StreamingTrainer is invalid after an earlier failure "
          f"({type(self.error).__name__}: {self.error}); its host state may be "
          "half-updated. Restore a checkpoint into it (`restore`), build a new trainer "
          "or resume from the last checkpoint.")
    if self.closed:
      raise RuntimeError("This StreamingTrainer is closed.")

  def fail(self, e: BaseException, during: str = "a step") -> None:
    """Marks the trainer invalid (the first failure is kept) and stops its threads.

    Args:
      e: the failure; a note saying the state may be half-updated is added.
      during: what was running, for the note.
    """
    self.error = self.error or e
    if isinstance(e, Exception) and not isinstance(e, FloatingPointError):
      e.add_note(f"The StreamingTrainer failed during {during}; its host state may be "
                 "half-updated, so it is now invalid: resume from the last checkpoint.")
    cause = self._rt.shutdown()
    if cause is not None and cause is not e and isinstance(e, Exception):
      e.add_note(f"An engine thread had failed first: {type(cause).__name__}: {cause}")

  def late_error(self) -> FloatingPointError | None:
    """The non-finite gradient the last step's updates found after it returned.

    Returns:
      Its error the first time it is asked for, else None.
    """
    if not self.late.late_error_pending:
      return None
    self.late.reported = True
    return nonfinite.error(self.late, self._unit_name, late=True)

  def check_late(self) -> None:
    """Marks the trainer invalid on `late_error()`, and raises it.

    Raises:
      FloatingPointError: the last step went bad after it returned.
    """
    err = self.late_error()
    if err is not None:
      self.fail(err)
      raise err

  def wait(self) -> None:
    """Waits for the queued gradients and updates (a caller's wait).

    Raises:
      What they met (the trainer is then invalid); RuntimeError when it already was,
      or is closed.
    """
    self.check_usable()
    try:
      self._rt.pipeline.wait()
      self._rt.prefetcher.check()
    except BaseException as e:
      self.fail(e)
      raise
    self.check_late()

  def close(self) -> None:
    """Shuts the runtime down (once).

    Raises:
      The failure or FloatingPointError the last updates met after the last step
      returned, if not reported yet; the trainer is then invalid.
    """
    if self.closed:
      return
    self.closed = True
    error = self._rt.shutdown() or self.late_error()
    if self.error is not None:
      # The steps that raised it have returned: their frames (device arrays, the
      # trainer) need not stay alive with the error.
      traceback.clear_frames(self.error.__traceback__)
    if error is not None and self.error is None:
      self.error = error
      raise error

  def restore(self, load: Callable[[], None], step: int, revive: bool) -> None:
    """Loads restored state, and revives an invalid trainer once it is all loaded.

    Args:
      load: loads every part; if it fails partway the trainer is invalid.
      step: the step the state is at.
      revive: the trainer was invalid (its threads were stopped).

    Raises:
      What `load` raised; the trainer is then invalid.
    """
    try:
      load()
    except BaseException as e:
      self.fail(e, during="a restore (some parts were loaded)")
      raise
    if revive:
      self._rt.start()
    self._rt.remake_copies()
    if revive:  # every part and copy is the restored state's
      self.error, self.late = None, nonfinite.StepGuard(step=step)

  def bad_step(self, bad: nonfinite.Bad, guard: nonfinite.StepGuard,
               skip: bool) -> FloatingPointError | None:
    """Applies the non-finite policy to a step that went bad.

    Args:
      bad: what went bad.
      guard: the step's guard.
      skip: `nonfinite="skip"`.

    Returns:
      None for a skipped step (counted and logged), else the FloatingPointError to
      raise; when the step's updates had already changed units, the trainer is
      invalid by then.
    """
    if bad[0] == "previous":
      self.check_late()  # the step before went bad after it returned
    guard.bad, guard.reported = bad, True
    if skip:
      self.skipped += 1
      logging.warning("%s; step skipped (%d skipped so far), no parameter changed.",
                      nonfinite.describe(guard, self._unit_name), self.skipped)
      return None
    err = nonfinite.error(guard, self._unit_name)
    if guard.updated:
      self.fail(err)
    return err
