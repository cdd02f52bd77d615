"""Host -> device: the prefetch thread and its buffer slots.

Timeouts: only a caller waiting on the engine (`get`, `cancel`, a fetch on the
caller's thread with `depth == 0`) times out. The prefetch thread itself waits for
a free slot or an updated unit as long as it takes: an idle trainer (a notebook
left alone, an evaluation loop, a slow checkpoint) never dies of waiting.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Callable, Mapping, NamedTuple

import jax

from megatrain_jax.engine.device.ledger import Ledger
from megatrain_jax.engine.workers import WorkerError

POLL_S = 0.05
READY_POLL_S = 0.002  # the thread's wait for an update (or a free slot) to go on


class _Cancelled(Exception):
  """The schedule being fetched was cancelled."""


class Job(NamedTuple):
  """One schedule to fetch: its id, unit order, tag (the step), slot limits, how
  many first positions may fill start buffers, and the buffers a fused tail's
  fetches need by position (`Schedule.tail_needs`)."""
  id: int
  order: tuple[int, ...]
  tag: int
  limit: Callable[[int], int]
  starts: int = 0
  needs: Mapping[int, int] = {}


class Prefetcher:
  """Fetches units in a schedule's order, with a bounded number of buffers alive.

  A buffer is freed by `release(key, token)`: once `token` (an array computed from
  the buffer) is ready, its slot can take the next unit. With one slot each
  transfer waits for the previous compute (no overlap); each extra slot lets one
  more transfer run ahead. A job's `limit(position)` is the slots a fetch at that
  position may fill: a step's first fetches may get extra buffers (see
  `memory.step_plan`), but only once the compute of every earlier job is done
  (`job_done`), when its activations are gone. `depth == 0` fetches on the
  caller's thread; otherwise one background thread fetches.

  `ready(u, tag)` says whether unit u can be fetched for step `tag` now (its
  update from the step before is done). When the next unit is not ready, the
  thread fetches the first ready one further on into a spare slot, keeping `hold`
  slots (the most buffers the compute holds at once; a fused tail's fetches, in
  `needs`, one more) for the units in order, so the link keeps working while the
  last updates of the step before finish.
  """

  def __init__(self, fetch: Callable[..., jax.Array], depth: int,
               hold: int,
               ledger: Ledger, timeout_s: float,
               ready: Callable[[int, int], bool] | None = None):
    self._fetch, self.depth, self._hold = fetch, depth, hold
    self._ledger, self._timeout = ledger, timeout_s
    self._ready_unit = ready or (lambda u, tag: True)
    self._cond = threading.Condition()
    self._in_use = 0
    self._released: collections.deque = collections.deque()
    self._arrived: dict[tuple[int, int], jax.Array] = {}  # (job, position) -> buffer
    self._ahead: set[tuple[int, int]] = set()  # of those, fetched out of order
    self._jobs: queue.Queue = queue.Queue()
    self._error: BaseException | None = None
    self._abort = False
    self._cancel = False
    self._open_jobs = 0  # jobs started and not finished by the thread
    self._started: collections.deque = collections.deque()  # jobs not yet taken whole
    self._current: Job | None = None
    self._job_ids = 0
    self._done_through = 0  # the compute of jobs up to this id is done
    self._pos = 0
    self.busy_s = 0.0
    self.bytes_for: collections.Counter = collections.Counter()  # by tag (step)
    self.out_of_order = 0
    self.start_buffer_fetches = 0  # fetches into a start buffer (see `_count_start`)
    self._thread = None
    if depth > 0:
      self._thread = threading.Thread(target=self._run, name="megatrain-prefetch",
                                      daemon=True)
      self._thread.start()

  # -- slots -----------------------------------------------------------------

  def _reclaim_one(self) -> bool:
    """Frees the oldest released buffer once its compute is done (waits for it)."""
    with self._cond:
      token = self._released.popleft() if self._released else None
    if token is None:
      return False
    key, arr = token
    if arr is not None:
      arr.block_until_ready()
    self._ledger.remove(key)
    with self._cond:
      self._in_use -= 1
    return True

  def _limit(self, job: Job, position: int) -> int:
    """The slots a fetch at `position` of `job` may fill now."""
    if position < job.starts and self._done_through < job.id - 1:
      # No start buffer before the job before is done; a fused tail's need stays.
      return max(self._hold + self.depth, job.needs.get(position, 0))
    return job.limit(position)

  def _acquire_slot(self, job: Job, position: int, deadline: float | None) -> None:
    """Takes a slot under the position's limit; a caller gives a deadline, the thread
    none."""
    while True:
      with self._cond:
        if self._in_use < self._limit(job, position):
          self._in_use += 1
          self._count_start(job, position)
          return
        if self._abort:
          raise WorkerError("prefetch aborted")
        if self._cancel:
          raise _Cancelled()
        has_released = bool(self._released)
        if not has_released:
          if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"No device buffer freed in {self._timeout:.0f} s.")
          self._cond.wait(POLL_S)
          continue
      self._reclaim_one()

  def _count_start(self, job: Job, position: int) -> None:
    """Counts a fetch into a start buffer: beyond hold + depth at one of the job's
    first positions (elsewhere a limit above that is a fused tail's own need)."""
    self.start_buffer_fetches += (position < job.starts
                                  and self._in_use > self._hold + self.depth)

  def _try_spare_slot(self, job: Job, position: int, first: int) -> bool:
    """A free slot for a unit out of order, without waiting (released buffers whose
    compute is done are reclaimed first). Buffers fetched out of order and not yet
    taken stay under limit - hold, so the units in order always have `hold` slots:
    more where a fused tail's fetch lies between the first unit pending (`first`)
    and this one, which the compute makes while holding the last layer."""
    limit = self._limit(job, position)
    reserve = max([self._hold, *(n for q, n in job.needs.items() if first <= q < position)])
    with self._cond:
      if len(self._ahead) + reserve >= limit:
        return False
      while self._released and self._in_use >= limit:
        key, arr = self._released[0]
        if arr is not None and not arr.is_ready():
          break
        self._released.popleft()
        self._ledger.remove(key)
        self._in_use -= 1
      if self._in_use < limit:
        self._in_use += 1
        self._count_start(job, position)
        return True
      return False

  def _stop_waiting(self) -> None:
    """Raised into a fetch waiting for an update: a cancel or an abort ends the wait
    (the update it waits for may never come, e.g. after a refused step)."""
    with self._cond:
      if self._abort:
        raise WorkerError("prefetch aborted")
      if self._cancel:
        raise _Cancelled()

  def _fetch_into_slot(self, u: int, key, tag: int, deadline: float | None = None):
    t0 = time.perf_counter()
    arr = self._fetch(u, tag, deadline, self._stop_waiting if deadline is None else None)
    self.busy_s += time.perf_counter() - t0
    self.bytes_for[tag] += arr.nbytes
    self._ledger.add(key, arr.nbytes)
    return arr

  def _fetch_held(self, u: int, key, tag: int):
    """The thread's fetch into a slot it holds; the slot is given back if the fetch
    ends without a buffer (cancelled, aborted or failed)."""
    try:
      return self._fetch_into_slot(u, key, tag)
    except BaseException:
      with self._cond:
        self._in_use -= 1
        self._cond.notify_all()
      raise

  # -- background thread -----------------------------------------------------

  def _run(self):
    while True:
      job = self._jobs.get()
      if job is None:
        return
      try:
        self._run_job(job)
      except _Cancelled:
        pass
      except BaseException as e:  # pylint: disable=broad-except
        with self._cond:
          self._error = e
          self._open_jobs -= 1
          self._cond.notify_all()
        return
      with self._cond:
        self._open_jobs -= 1
        self._cond.notify_all()

  def _run_job(self, job: Job) -> None:
    pending = list(range(len(job.order)))
    ready = lambda p: self._ready_unit(job.order[p], job.tag)
    while pending:
      with self._cond:
        if self._abort:
          return
        if self._cancel:
          raise _Cancelled()
      n = pending[0]
      if ready(n):
        self._acquire_slot(job, n, deadline=None)
        arr = self._fetch_held(job.order[n], ("param", job.id, n), job.tag)
        self._deliver(job.id, n, arr)
        pending.pop(0)
        continue
      # Out of order only within the in-order fetch's reach (what it would fetch
      # next anyway): the memory model counts buffers around the compute's position.
      reach = n + job.limit(n)
      ahead = next((p for p in pending[1:] if p < reach and ready(p)), None)
      if ahead is not None and self._try_spare_slot(job, ahead, n):
        self.out_of_order += 1
        arr = self._fetch_held(job.order[ahead], ("param", job.id, ahead), job.tag)
        with self._cond:
          self._ahead.add((job.id, ahead))
        self._deliver(job.id, ahead, arr)
        pending.remove(ahead)
        continue
      time.sleep(READY_POLL_S)

  def _deliver(self, job: int, n: int, arr) -> None:
    with self._cond:
      self._arrived[(job, n)] = arr
      self._cond.notify_all()

  # -- caller side -----------------------------------------------------------

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
      needs: buffers a fused tail's fetches need, by position (kept free of
        out-of-order fetches).
    """
    self.check()
    self._job_ids += 1
    job = Job(self._job_ids, tuple(order), tag,
              limit or (lambda p: self._hold + self.depth), starts, needs or {})
    self._started.append(job)
    if self._thread is not None:
      with self._cond:
        self._open_jobs += 1
      self._jobs.put(job)

  def cancel(self) -> None:
    """Drops every started schedule and frees every buffer fetched for it.

    Raises:
      TimeoutError: the thread did not stop within `timeout_s`.
    """
    with self._cond:
      self._cancel = True
      self._cond.notify_all()
      deadline = time.monotonic() + self._timeout
      while self._open_jobs and self._error is None and self._thread is not None \
          and self._thread.is_alive():
        if time.monotonic() > deadline:
          raise TimeoutError(f"Prefetch did not stop in {self._timeout:.0f} s.")
        self._cond.wait(POLL_S)
      for (j, n) in self._arrived:
        self._ledger.remove(("param", j, n))
        self._in_use -= 1
      self._arrived.clear()
      self._ahead.clear()
      self._cancel = False
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
      self._current = self._started.popleft() if self._started else None
      self._pos = 0
    job = self._current or Job(0, (), 0, lambda p: 0)
    n = self._pos
    expected = job.order[n] if n < len(job.order) else None
    if expected != u:
      raise RuntimeError(f"Prefetch schedule out of order: wanted unit {u}, "
                         f"schedule has {expected} at position {n}.")
    self._pos += 1
    key = ("param", job.id, n)
    deadline = time.monotonic() + self._timeout
    if self._thread is None:
      self._acquire_slot(job, n, deadline)
      return self._fetch_into_slot(u, key, job.tag, deadline), key
    with self._cond:
      while (job.id, n) not in self._arrived:
        self.check()
        if not self._thread.is_alive():
          raise WorkerError("The prefetch thread stopped.")
        if time.monotonic() > deadline:
          raise TimeoutError(f"Prefetch of unit {u} took over {self._timeout:.0f} s.")
        self._cond.wait(POLL_S)
      self._ahead.discard((job.id, n))
      return self._arrived.pop((job.id, n)), key

  def job_done(self) -> None:
    """The compute of the job whose units were taken last is done (its activations
    are gone): later jobs may use their start buffers."""
    with self._cond:
      if self._current is not None:
        self._done_through = max(self._done_through, self._current.id)
      self._cond.notify_all()

  def release(self, key, token) -> None:
    """Frees a fetched buffer once the compute that used it is done.

    Args:
      key: the key `get` returned with the buffer.
      token: an array computed from the buffer (None: free it now).
    """
    with self._cond:
      self._released.append((key, token))
      self._cond.notify_all()

  def drain(self) -> None:
    """Waits for every released buffer and frees it; called between steps."""
    while self._reclaim_one():
      pass

  def close(self) -> None:
    """Stops the thread and frees every buffer it fetched (none stays on the device)."""
    if self._thread is not None and self._thread.is_alive():
      try:
        self.cancel()
      except (TimeoutError, WorkerError):
        pass
    with self._cond:
      self._abort = True
      self._cond.notify_all()
    if self._thread is not None:
      self._jobs.put(None)
      self._thread.join(timeout=self._timeout)
    with self._cond:
      for (j, n) in self._arrived:
        self._ledger.remove(("param", j, n))
      self._arrived.clear()
    self.drain()
