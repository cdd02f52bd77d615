"""The engine's two threads: the prefetcher (host -> device) and the gradient
worker (device -> host, then the host optimizer).

Both record the first exception they meet and stop; the caller's next wait on
them raises that exception (the original object), so a failure on a thread
surfaces in `step()` instead of hanging it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable

import jax

_POLL_S = 0.05
_READY_POLL_S = 0.002  # the prefetcher's wait for an update (or a free slot) to go on
# Jobs a GradWorker holds at once by default (each holds one unit's gradient).
MAX_PENDING = 2


class Ledger:
  """Bytes the engine holds in accelerator memory, and their peak."""

  def __init__(self):
    self._lock = threading.Lock()
    self._live: dict[Any, int] = {}
    self.current = 0
    self.peak = 0

  def add(self, key, nbytes: int) -> None:
    with self._lock:
      self.current += nbytes - self._live.get(key, 0)
      self._live[key] = nbytes
      self.peak = max(self.peak, self.current)

  def remove(self, key) -> None:
    with self._lock:
      self.current -= self._live.pop(key, 0)

  def reset_peak(self) -> None:
    with self._lock:
      self.peak = self.current


class WorkerError(RuntimeError):
  pass


class _Cancelled(Exception):
  """The schedule being fetched was cancelled."""


class Prefetcher:
  """Fetches units in a schedule's order with at most `slots` fetched buffers alive.

  A buffer is freed by `release(key, token)`: once `token` (an array computed
  from the buffer) is ready, the slot can take the next unit. So with slots = 1
  each transfer waits for the previous layer's compute (no overlap), and each
  extra slot lets one more transfer run ahead of the compute. `depth == 0`
  fetches on the caller's thread; otherwise one background thread fetches.

  Each schedule comes with a tag (the step it is for), passed to `fetch(u, tag)`
  and `ready(u, tag)`; `ready` says whether unit u can be fetched for that step
  now (its update from the step before is done; `fetch` waits for that itself).
  When the next unit is not ready, the thread fetches the first ready one further
  on into a spare slot, keeping `hold` slots (the most buffers the compute holds
  at once) for the units in order. So the link keeps working while the last
  updates of the step before finish.
  """

  def __init__(self, fetch: Callable[[int, int], jax.Array], depth: int, slots: int,
               ledger: Ledger, timeout_s: float,
               ready: Callable[[int, int], bool] | None = None, hold: int = 1):
    self._fetch, self.depth, self.slots = fetch, depth, slots
    self._ledger, self._timeout = ledger, timeout_s
    self._ready_unit = ready or (lambda u, tag: True)
    self._hold = hold
    self._cond = threading.Condition()
    self._in_use = 0
    self._released: collections.deque = collections.deque()
    self._arrived: dict[tuple[int, int], jax.Array] = {}  # (job, position) -> buffer
    self._ahead: set[tuple[int, int]] = set()  # of those, fetched out of order
    self._jobs: queue.Queue = queue.Queue()
    self._error: BaseException | None = None
    self._abort = False
    self._cancel = False
    self._open_jobs = 0  # schedules started and not finished by the thread
    # Schedules started and not yet taken whole by `get`, as (job, schedule, tag);
    # the thread fetches the next one as soon as it has fetched the one before.
    self._started: collections.deque = collections.deque()
    self._current: tuple[int, list[int], int] | None = None
    self._job_ids = 0
    self._pos = 0
    self.busy_s = 0.0
    self.bytes_for: collections.Counter = collections.Counter()  # by tag (step)
    self.out_of_order = 0
    self._thread = None
    if depth > 0:
      self._thread = threading.Thread(target=self._run, name="megatrain-prefetch",
                                      daemon=True)
      self._thread.start()

  # -- slots -----------------------------------------------------------------

  def _acquire_slot(self) -> None:
    deadline = time.monotonic() + self._timeout
    while True:
      with self._cond:
        if self._in_use < self.slots:
          self._in_use += 1
          return
        if self._abort:
          raise WorkerError("prefetch aborted")
        if self._cancel:
          raise _Cancelled()
        token = self._released.popleft() if self._released else None
        if token is None:
          if time.monotonic() > deadline:
            raise TimeoutError(f"No device buffer freed in {self._timeout:.0f} s.")
          self._cond.wait(_POLL_S)
          continue
      key, arr = token
      if arr is not None:
        arr.block_until_ready()
      self._ledger.remove(key)
      with self._cond:
        self._in_use -= 1

  def _try_spare_slot(self) -> bool:
    """A free slot for a unit out of order, without waiting (released buffers whose
    compute is done are reclaimed first). Buffers fetched out of order and not yet
    taken stay under slots - hold, so the units in order always have `hold` slots
    (every other buffer is one the compute will take or has released)."""
    with self._cond:
      if len(self._ahead) + self._hold >= self.slots:
        return False
      while self._released and self._in_use >= self.slots:
        key, arr = self._released[0]
        if arr is not None and not arr.is_ready():
          break
        self._released.popleft()
        self._ledger.remove(key)
        self._in_use -= 1
      if self._in_use < self.slots:
        self._in_use += 1
        return True
      return False

  def _fetch_into_slot(self, u: int, key, tag: int):
    t0 = time.perf_counter()
    arr = self._fetch(u, tag)
    self.busy_s += time.perf_counter() - t0
    self.bytes_for[tag] += arr.nbytes
    self._ledger.add(key, arr.nbytes)
    return arr

  def _do_fetch(self, u: int, key, tag: int):
    self._acquire_slot()
    return self._fetch_into_slot(u, key, tag)

  # -- background thread -----------------------------------------------------

  def _run(self):
    while True:
      job = self._jobs.get()
      if job is None:
        return
      try:
        self._run_schedule(*job)
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

  def _run_schedule(self, job: int, order: list[int], tag: int) -> None:
    pending = list(range(len(order)))
    deadline = time.monotonic() + self._timeout
    ready = lambda p: self._ready_unit(order[p], tag)
    while pending and not (self._abort or self._cancel):
      n = pending[0]
      if ready(n):
        self._deliver(job, n, self._do_fetch(order[n], ("param", order[n], job, n), tag))
        pending.pop(0)
        deadline = time.monotonic() + self._timeout
        continue
      ahead = next((p for p in pending[1:] if ready(p)), None)
      if ahead is not None and self._try_spare_slot():
        self.out_of_order += 1
        arr = self._fetch_into_slot(order[ahead], ("param", order[ahead], job, ahead), tag)
        with self._cond:
          self._ahead.add((job, ahead))
        self._deliver(job, ahead, arr)
        pending.remove(ahead)
        continue
      if time.monotonic() > deadline:
        raise TimeoutError(f"Unit {order[n]} was not ready in {self._timeout:.0f} s.")
      time.sleep(_READY_POLL_S)

  def _deliver(self, job: int, n: int, arr) -> None:
    with self._cond:
      self._arrived[(job, n)] = arr
      self._cond.notify_all()

  # -- caller side -----------------------------------------------------------

  def check(self) -> None:
    if self._error is not None:
      raise self._error

  def start(self, schedule: list[int], tag: int = 0) -> None:
    """Queues `schedule` for step `tag`; `get` takes its units in order, after
    those of the schedules started before it."""
    self.check()
    self._job_ids += 1
    job = (self._job_ids, list(schedule), tag)
    self._started.append(job)
    if self._thread is not None:
      with self._cond:
        self._open_jobs += 1
      self._jobs.put(job)

  def cancel(self) -> None:
    """Drops every started schedule and frees every buffer fetched for it."""
    with self._cond:
      self._cancel = True
      self._cond.notify_all()
      deadline = time.monotonic() + self._timeout
      while self._open_jobs and self._error is None:
        if time.monotonic() > deadline:
          raise TimeoutError(f"Prefetch did not stop in {self._timeout:.0f} s.")
        self._cond.wait(_POLL_S)
      jobs = {j: order for j, order, _ in [*self._started, *([self._current] if self._current else [])]}
      for (j, n) in self._arrived:
        self._ledger.remove(("param", jobs[j][n], j, n))
        self._in_use -= 1
      self._arrived.clear()
      self._ahead.clear()
      self._cancel = False
    self._started.clear()
    self._current, self._pos = None, 0
    self.drain()

  def get(self, u: int):
    """The next unit of the started schedules, which must be `u`; returns (array, key)."""
    if self._current is None or self._pos >= len(self._current[1]):
      self._current = self._started.popleft() if self._started else None
      self._pos = 0
    job, order, tag = self._current or (0, [], 0)
    n = self._pos
    expected = order[n] if n < len(order) else None
    if expected != u:
      raise RuntimeError(f"Prefetch schedule out of order: wanted unit {u}, "
                         f"schedule has {expected} at position {n}.")
    self._pos += 1
    key = ("param", u, job, n)
    if self._thread is None:
      return self._do_fetch(u, key, tag), key
    deadline = time.monotonic() + self._timeout
    with self._cond:
      while (job, n) not in self._arrived:
        self.check()
        if not self._thread.is_alive():
          raise WorkerError("The prefetch thread stopped.")
        if time.monotonic() > deadline:
          raise TimeoutError(f"Prefetch of unit {u} took over {self._timeout:.0f} s.")
        self._cond.wait(_POLL_S)
      self._ahead.discard((job, n))
      return self._arrived.pop((job, n)), key

  def release(self, key, token) -> None:
    with self._cond:
      self._released.append((key, token))
      self._cond.notify_all()

  def drain(self) -> None:
    """Waits for every released buffer; called between steps."""
    with self._cond:
      tokens = list(self._released)
      self._released.clear()
    for key, arr in tokens:
      if arr is not None:
        arr.block_until_ready()
      self._ledger.remove(key)
      with self._cond:
        self._in_use -= 1

  def close(self) -> None:
    with self._cond:
      self._abort = True
      self._cond.notify_all()
    if self._thread is not None:
      self._jobs.put(None)
      self._thread.join(timeout=self._timeout)


class GradWorker:
  """Runs `handle(job)` for each submitted job on one background thread, in order.

  The engine runs two: device -> host transfers of gradients, then the host
  optimizer, so a unit's update overlaps the next unit's transfer.

  At most `max_pending` jobs wait at once: `submit` blocks beyond that, which
  bounds the gradients held in device memory whatever the model's depth.
  """

  def __init__(self, handle: Callable[[Any], None], timeout_s: float,
               max_pending: int = MAX_PENDING,
               name: str = "grads"):
    self._handle, self._timeout, self.max_pending = handle, timeout_s, max_pending
    self._jobs: queue.Queue = queue.Queue()
    self._cond = threading.Condition()
    self._pending = 0
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name=f"megatrain-{name}", daemon=True)
    self._thread.start()

  def _run(self):
    while True:
      job = self._jobs.get()
      if job is None:
        return
      try:
        if self._error is None:
          self._handle(job)
      except BaseException as e:  # pylint: disable=broad-except
        self._error = e
      finally:
        with self._cond:
          self._pending -= 1
          self._cond.notify_all()

  def check(self) -> None:
    if self._error is not None:
      raise self._error

  def submit(self, job) -> None:
    self._wait_below(self.max_pending)
    with self._cond:
      self._pending += 1
    self._jobs.put(job)

  def wait(self) -> None:
    """Blocks until every submitted job is done; raises the first error."""
    self._wait_below(1)

  def _wait_below(self, n: int) -> None:
    deadline = time.monotonic() + self._timeout
    with self._cond:
      while self._pending >= n and self._error is None:
        if time.monotonic() > deadline:
          raise TimeoutError(f"Gradient worker busy for over {self._timeout:.0f} s.")
        if not self._thread.is_alive():
          raise WorkerError("The gradient thread stopped.")
        self._cond.wait(_POLL_S)
    self.check()

  def close(self) -> None:
    self._jobs.put(None)
    self._thread.join(timeout=self._timeout)
