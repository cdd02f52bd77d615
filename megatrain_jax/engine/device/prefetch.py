"""Host -> device: the prefetch thread and its buffer slots.

The thread follows the slot rules of `plan.slots` (the rules the simulation of a
step replays): it fetches units in each queued job's order, out of order past a
unit whose update is not done yet, into at most the buffers the rules allow, and
reclaims a buffer the compute released only when a fetch needs its slot. It sleeps
on a condition until something it waits for happens: a release, an update done
(`wake`, which the update clock calls), a new job, a cancel. Nothing polls.

Timeouts: only a caller waiting on the engine (`get`, `cancel`, a fetch on the
caller's thread with `depth == 0`) times out. The prefetch thread itself waits for
a free slot or an updated unit as long as it takes: an idle trainer (a notebook
left alone, an evaluation loop, a slow checkpoint) never dies of waiting.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Mapping

import jax

from megatrain_jax.engine.device.ledger import Ledger
from megatrain_jax.engine.plan.slots import RECLAIM, Fetch, Job, Slots
from megatrain_jax.engine.workers import WorkerError


class Prefetcher:
  """Fetches units in a schedule's order, with a bounded number of buffers alive.

  A buffer is freed by `release(key, token)`: once `token` (an array computed from
  the buffer) is ready, its slot can take the next unit. With one slot each
  transfer waits for the previous compute (no overlap); each extra slot lets one
  more transfer run ahead. `depth == 0` fetches on the caller's thread; otherwise
  one background thread fetches. `ready(u, tag)` says whether unit u can be fetched
  for step `tag` now (its update from the step before is done).
  """

  def __init__(self, fetch: Callable[..., jax.Array], depth: int, hold: int,
               ledger: Ledger, timeout_s: float,
               ready: Callable[[int, int], bool] | None = None,
               await_compute: Callable[[jax.Array], None] | None = None):
    """Starts the thread (with `depth` > 0).

    Args:
      fetch: `fetch(unit, tag, deadline)` -> the unit's device copy for step `tag`
        (the caller's deadline, None on the thread, where the unit is ready).
      depth: buffers fetched ahead of the compute.
      hold: the most buffers the compute holds at once.
      ledger: counts the buffers alive.
      timeout_s: the longest a caller waits.
      ready: `ready(unit, tag)`; may raise what stopped the engine.
      await_compute: blocks until a release's token is ready
        (`Transport.await_compute`).
    """
    self._fetch, self.depth = fetch, depth
    self._await = await_compute or (lambda token: token.block_until_ready())
    self._ledger, self._timeout = ledger, timeout_s
    self._ready = ready or (lambda u, tag: True)
    self._cond = threading.Condition()
    self._slots = Slots(hold, depth)
    self._arrived: dict[tuple[int, int], jax.Array] = {}  # (job, position) -> buffer
    self._started: collections.deque[Job] = collections.deque()  # jobs the compute takes
    self._current: Job | None = None
    self._pos = 0
    self._busy = False  # the thread is moving or waiting on a buffer, outside the lock
    self._waiting = False  # the thread sleeps on the condition
    self._woken = False  # something it may wait for happened since it last looked
    self._error: BaseException | None = None
    self._abort = False
    self.busy_s = 0.0
    self.bytes_for: collections.Counter = collections.Counter()  # by tag (step)
    self._thread = None
    if depth > 0:
      self._thread = threading.Thread(target=self._run, name="megatrain-prefetch",
                                      daemon=True)
      self._thread.start()

  @property
  def out_of_order(self) -> int:
    """Fetches made out of order so far."""
    return self._slots.out_of_order

  @property
  def start_buffer_fetches(self) -> int:
    """Fetches into a start buffer so far."""
    return self._slots.start_buffer_fetches

  @property
  def turn_buffer_fetches(self) -> int:
    """Fetches into a turn buffer so far."""
    return self._slots.turn_buffer_fetches

  # -- the thread --------------------------------------------------------------

  def _next(self):
    """Under the lock: the thread's next action, or None to stop."""
    while True:
      if self._abort:
        return None
      self._woken = False
      action = self._slots.next(self._ready)
      if isinstance(action, Fetch):
        self._slots.take(action)
        return action
      if action is RECLAIM:
        return self._slots.reclaim()
      self._waiting = True
      self._cond.wait()  # a release, an update, a job or a cancel wakes it
      self._waiting = False

  def _run(self) -> None:
    try:
      while True:
        with self._cond:
          action = self._next()
          if action is None:
            return
          self._busy = True
        try:
          if isinstance(action, Fetch):
            job, n = action.job, action.position
            arr = self._timed_fetch(job.order[n], ("param", job.id, n), job.tag, None)
            with self._cond:
              self._arrived[(job.id, n)] = arr
          else:
            self._free(*action)
        finally:
          with self._cond:
            self._busy = False
            self._cond.notify_all()
    except BaseException as e:  # pylint: disable=broad-except
      with self._cond:
        self._error = e
        self._cond.notify_all()

  def _timed_fetch(self, u: int, key, tag: int, deadline: float | None) -> jax.Array:
    t0 = time.perf_counter()
    arr = self._fetch(u, tag, deadline)
    self.busy_s += time.perf_counter() - t0
    self.bytes_for[tag] += arr.nbytes
    self._ledger.add(key, arr.nbytes)
    return arr

  def _free(self, key, token) -> None:
    """Frees a reclaimed buffer once the compute that used it is done."""
    if token is not None:
      self._await(token)
    with self._cond:
      self._ledger.remove(key)
      self._slots.reclaimed()

  # -- caller side -------------------------------------------------------------

  def _notify(self) -> None:
    """Under the lock: something the thread may wait for happened."""
    self._woken = True
    self._cond.notify_all()

  def wake(self) -> None:
    """Something the thread may wait for happened (an update is done)."""
    with self._cond:
      self._notify()

  @property
  def idle(self) -> bool:
    """Whether the thread sleeps with nothing to do until a release, an update, a job
    or a cancel (True without a thread, or once it stopped)."""
    with self._cond:
      return (self._thread is None or not self._thread.is_alive()
              or (self._waiting and not self._woken))

  def check(self) -> None:
    """Raises what stopped the prefetch thread, if anything did.

    Raises:
      The thread's exception, as it was raised there.
    """
    if self._error is not None:
      raise self._error

  def take_error(self) -> BaseException | None:
    """Takes what stopped the prefetch thread, forgotten here so that its traceback
    keeps no frame alive.

    Returns:
      The exception, or None if nothing did.
    """
    error, self._error = self._error, None
    return error

  def start(self, order, tag: int = 0, limit: Callable[[int], int] | None = None,
            starts: int = 0, needs: Mapping[int, int] | None = None) -> None:
    """Queues a schedule for step `tag`; `get` takes its units in order, after those
    of the schedules started before it.

    Args:
      order: unit indices, in the order the compute takes them.
      tag: the step the fetches are for (passed to `fetch` and `ready`).
      limit: slots a fetch at each position may fill (default: hold + depth).
      starts: how many first positions' limits include start buffers.
      needs: buffers a fused tail's fetches need, by position.
    """
    self.check()
    with self._cond:
      self._started.append(self._slots.new_job(order, tag, limit, starts, needs))
      self._notify()

  def cancel(self) -> None:
    """Drops every started schedule and frees every buffer fetched for it.

    Raises:
      TimeoutError: the thread did not finish its transfer within `timeout_s`.
    """
    deadline = time.monotonic() + self._timeout
    with self._cond:
      self._slots.clear_jobs()  # the thread fetches nothing more for them
      while self._busy and self._error is None:
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"Prefetch did not stop in {self._timeout:.0f} s.")
        self._cond.wait(left)
      for (j, n) in self._arrived:
        self._ledger.remove(("param", j, n))
        self._slots.reclaimed()
      self._arrived.clear()
      self._started.clear()
      self._current, self._pos = None, 0
    self.drain()

  def get(self, u: int):
    """The next unit of the started schedules, on the device.

    Args:
      u: the unit the caller expects next.

    Returns:
      (device array, key to `release` it with).

    Raises:
      RuntimeError: `u` is not the next unit of the schedule.
      TimeoutError: the unit did not arrive within `timeout_s`.
    """
    if self._current is None or self._pos >= len(self._current.order):
      with self._cond:
        self._current = self._started.popleft() if self._started else None
      self._pos = 0
    job, n = self._current, self._pos
    expected = job.order[n] if job is not None else None
    if expected != u:
      raise RuntimeError(f"Prefetch schedule out of order: wanted unit {u}, "
                         f"schedule has {expected} at position {n}.")
    self._pos += 1
    key = ("param", job.id, n)
    deadline = time.monotonic() + self._timeout
    if self._thread is None:
      self._acquire(job, n, deadline)
      return self._timed_fetch(u, key, job.tag, deadline), key
    with self._cond:
      while (job.id, n) not in self._arrived:
        self.check()
        if not self._thread.is_alive():
          raise WorkerError("The prefetch thread stopped.")
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"Prefetch of unit {u} took over {self._timeout:.0f} s.")
        self._cond.wait(left)
      self._slots.taken(job.id, n)
      self._notify()  # one fewer fetched ahead: the thread may fetch out of order again
      return self._arrived.pop((job.id, n)), key

  def _acquire(self, job: Job, n: int, deadline: float) -> None:
    """A buffer for a fetch on the caller's thread (no prefetch thread)."""
    while True:
      with self._cond:
        action = self._slots.acquire(job, n)
        if action is None:
          return
        if action is not RECLAIM:
          raise TimeoutError("No device buffer is released for the next fetch: "
                             "prefetch_depth=0 with more buffers held than its slots.")
        released = self._slots.reclaim()
      self._free(*released)
      if time.monotonic() > deadline:
        raise TimeoutError(f"No device buffer freed in {self._timeout:.0f} s.")

  def job_done(self) -> None:
    """The compute of the job whose units were taken last is done (its activations
    are gone): later jobs may use their start buffers."""
    with self._cond:
      if self._current is not None:
        self._slots.job_done(self._current.id)
      self._notify()

  def release(self, key, token) -> None:
    """Frees a fetched buffer once the compute that used it is done.

    Args:
      key: the key `get` returned with the buffer.
      token: an array computed from the buffer (None: free it now).
    """
    with self._cond:
      self._slots.release(key, token)
      self._notify()

  def drain(self) -> None:
    """Frees every released buffer (once the compute that used it is done): on the
    thread, which does it before anything else, or here without one.

    Raises:
      TimeoutError: the thread did not free them within `timeout_s`.
    """
    if self._thread is not None and self._thread.is_alive():
      deadline = time.monotonic() + self._timeout
      with self._cond:
        self._slots.draining = True
        self._notify()
        while (self._slots.released or self._busy) and self._error is None:
          left = deadline - time.monotonic()
          if left <= 0:
            raise TimeoutError(f"Freeing the released buffers took over {self._timeout:.0f} s.")
          self._cond.wait(left)
        self.check()
        return
    while True:
      with self._cond:
        if not self._slots.released:
          return
        released = self._slots.reclaim()
      self._free(*released)

  def close(self) -> None:
    """Stops the thread and frees every buffer it fetched (none stays on the device).
    What stopped the thread, if anything did, stays for `take_error`."""
    try:
      if self._thread is not None and self._thread.is_alive():
        self.cancel()
    except BaseException:  # pylint: disable=broad-except
      pass  # the thread's own error is kept; stopping it comes first
    finally:
      with self._cond:
        self._abort = True
        self._notify()
      if self._thread is not None:
        self._thread.join(timeout=self._timeout)
      with self._cond:
        for (j, n) in self._arrived:
          self._ledger.remove(("param", j, n))
        self._arrived.clear()
      self.drain()
