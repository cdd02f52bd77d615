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


class Prefetcher:
  """Fetches units in a schedule's order with at most `slots` fetched buffers alive.

  A buffer is freed by `release(key, token)`: once `token` (an array computed
  from the buffer) is ready, the slot can take the next unit. So with slots = 1
  each transfer waits for the previous layer's compute (no overlap), and each
  extra slot lets one more transfer run ahead of the compute. `depth == 0`
  fetches on the caller's thread; otherwise one background thread fetches.
  """

  def __init__(self, fetch: Callable[[int], jax.Array], depth: int, slots: int,
               ledger: Ledger, timeout_s: float):
    self._fetch, self.depth, self.slots = fetch, depth, slots
    self._ledger, self._timeout = ledger, timeout_s
    self._cond = threading.Condition()
    self._in_use = 0
    self._released: collections.deque = collections.deque()
    self._ready: queue.Queue = queue.Queue()
    self._jobs: queue.Queue = queue.Queue()
    self._error: BaseException | None = None
    self._abort = False
    self._schedule: list[int] = []
    self._pos = 0
    self.busy_s = 0.0
    self.bytes = 0
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

  def _do_fetch(self, u: int, n: int):
    self._acquire_slot()
    t0 = time.perf_counter()
    arr = self._fetch(u)
    self.busy_s += time.perf_counter() - t0
    self.bytes += arr.nbytes
    self._ledger.add(("param", u, n), arr.nbytes)
    return arr

  # -- background thread -----------------------------------------------------

  def _run(self):
    while True:
      job = self._jobs.get()
      if job is None:
        return
      try:
        for n, u in enumerate(job):
          if self._abort:
            break
          self._ready.put((u, n, self._do_fetch(u, n)))
      except BaseException as e:  # pylint: disable=broad-except
        self._error = e
        self._ready.put(None)
        return

  # -- caller side -----------------------------------------------------------

  def check(self) -> None:
    if self._error is not None:
      raise self._error

  def start(self, schedule: list[int]) -> None:
    self.check()
    self._schedule, self._pos = list(schedule), 0
    if self._thread is not None:
      self._jobs.put(self._schedule)

  def get(self, u: int):
    """The next unit of the schedule, which must be `u`; returns (array, key)."""
    n = self._pos
    expected = self._schedule[n] if n < len(self._schedule) else None
    if expected != u:
      raise RuntimeError(f"Prefetch schedule out of order: wanted unit {u}, "
                         f"schedule has {expected} at position {n}.")
    self._pos += 1
    if self._thread is None:
      return self._do_fetch(u, n), ("param", u, n)
    deadline = time.monotonic() + self._timeout
    while True:
      self.check()
      try:
        item = self._ready.get(timeout=_POLL_S)
      except queue.Empty:
        if not self._thread.is_alive():
          self.check()
          raise WorkerError("The prefetch thread stopped.")
        if time.monotonic() > deadline:
          raise TimeoutError(f"Prefetch of unit {u} took over {self._timeout:.0f} s.")
        continue
      if item is None:
        self.check()
        raise WorkerError("The prefetch thread stopped.")
      got, pos, arr = item
      return arr, ("param", got, pos)

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
