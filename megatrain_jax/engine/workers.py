"""The engine's worker threads: one job queue each, errors kept for the caller.

A thread records the first exception it meets and stops handling jobs; the caller's
next wait on it raises that exception, and `on_error` tells whoever else may be
waiting for its work. Waits are woken by the thread when a job is done; only
callers time out.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from absl import logging

from megatrain_jax.engine.config import MAX_PENDING_GRADIENTS


class WorkerError(RuntimeError):
  """An engine thread stopped or was stopped while a caller waited on it."""


class Worker:
  """Runs `handle(box)` for each submitted job on one thread, in order; `box` is a
  one-element list the handler pops the job from, so that the job (a device
  gradient) lives no longer than the handler needs it.

  At most `max_pending` jobs wait at once: `submit` blocks beyond that.
  """

  def __init__(self, handle: Callable[[list], None], name: str,
               max_pending: int = MAX_PENDING_GRADIENTS, close_timeout_s: float = 600.0,
               on_error: Callable[[], None] | None = None):
    """Starts the thread.

    Args:
      handle: runs one job (see the class docstring).
      name: the thread's name, after "megatrain-".
      max_pending: the most jobs queued or running at once.
      close_timeout_s: how long `close` waits for the queued jobs.
      on_error: called (on this thread) after the first error it records.
    """
    self._handle, self.max_pending, self._on_error = handle, max_pending, on_error
    self._close_timeout = close_timeout_s
    self._jobs: queue.Queue = queue.Queue()
    self._cond = threading.Condition()
    self._pending = 0
    self.error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name=f"megatrain-{name}", daemon=True)
    self._thread.start()

  def _run(self):
    while True:
      box = [self._jobs.get()]  # the handler pops it: no frame here keeps it alive
      if box[0] is None:
        return
      try:
        if self.error is None:
          self._handle(box)
      except BaseException as e:  # pylint: disable=broad-except
        self.error = e
        if self._on_error is not None:
          self._on_error()
      finally:
        box.clear()
        with self._cond:
          self._pending -= 1
          self._cond.notify_all()

  def check(self) -> None:
    """Raises the first error the thread met, if any.

    Raises:
      The thread's exception, as it was raised there.
    """
    if self.error is not None:
      raise self.error

  def submit(self, job, timeout_s: float | None) -> None:
    """Queues a job, waiting while `max_pending` are queued.

    Args:
      job: passed to the handler.
      timeout_s: a caller's longest wait; None for a thread handing work to the next.
    """
    self._wait_below(self.max_pending, timeout_s)
    with self._cond:
      self._pending += 1
    self._jobs.put(job)

  def wait(self, timeout_s: float | None) -> None:
    """Blocks until every submitted job is done; raises the first error.

    Args:
      timeout_s: the longest wait (None: no limit).
    """
    self._wait_below(1, timeout_s)

  def _wait_below(self, n: int, timeout_s: float | None) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with self._cond:
      while self._pending >= n and self.error is None:
        if not self._thread.is_alive():
          raise WorkerError(f"The {self._thread.name} thread stopped.")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise TimeoutError(f"{self._thread.name} busy for over {timeout_s:.0f} s.")
        self._cond.wait(left)  # the thread wakes it after every job
    self.check()

  def close(self) -> None:
    """Lets the queued jobs finish, then stops the thread (a thread stuck past the
    timeout is left behind, as a daemon, and logged)."""
    self._jobs.put(None)
    self._thread.join(self._close_timeout)
    if self._thread.is_alive():
      logging.error("%s did not stop in %.0f s; left behind.", self._thread.name,
                    self._close_timeout)

  def forget_error(self) -> None:
    """Drops the stored error (it has been reported), so its traceback keeps no
    frame alive."""
    self.error = None
