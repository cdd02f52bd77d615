"""The prefetcher's rules: which unit it may fetch next, into which buffer.

One source for the slot rules, run two ways: by the prefetch thread
(`device.prefetch.Prefetcher`), which waits on the link and on the compute, and by
the simulation of a step (`plan.simulate`), which replays them with instant
transfers. A `Slots` holds the state the rules read: the jobs queued (one per
micro-batch), the positions not yet fetched, the buffers alive (`in_use`), those
the compute has released but the fetcher has not reclaimed yet (oldest first), and
those fetched out of order and not taken yet.

The rules, for the first position `n` of the job being fetched:

- `n`'s unit is ready (its update of the step before is done): fetch it when fewer
  buffers than `limit(job, n)` are alive; else reclaim the oldest released buffer
  (once the compute that used it is done); else wait for the compute to release one.
- `n`'s unit is not ready: fetch the first ready unit further on, out of order, within
  the positions the in-order fetch could reach with its slots, keeping `hold` buffers
  (more where a fused tail's fetch lies in between) for the units in order, under the
  lowest limit of the positions from `n` to it; reclaim first if that needs a buffer;
  else wait.
- At the end of a step (`draining`), every released buffer is reclaimed first.

`limit(job, n)` is the job's own slot limit (`Schedule.limit`: slots, start buffers
for a micro-batch's first fetches, turn buffers for its backward's first, a fused
tail's needs), but a start buffer is
withheld until the compute of the job before is done (`job_done`).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, NamedTuple


class Job(NamedTuple):
  """One micro-batch's fetches.

  Attributes:
    id: increasing from 1 over the prefetcher's life.
    order: the units, in the order the compute takes them.
    tag: the step they are for (passed to `ready`).
    limit: the buffers a fetch at each position may fill (`Schedule.limit`).
    starts: how many first positions' limits include start buffers.
    needs: the buffers a fused tail's fetches need, by position.
  """
  id: int
  order: tuple[int, ...]
  tag: int
  limit: Callable[[int], int]
  starts: int = 0
  needs: Mapping[int, int] = {}


class Fetch(NamedTuple):
  """Fetch `job`'s position `position` into a new buffer (`ahead`: out of order)."""
  job: Job
  position: int
  ahead: bool


class Reclaim(NamedTuple):
  """Free the oldest released buffer, once the compute that used it is done."""


class Wait(NamedTuple):
  """Nothing may be fetched now: wait for a release, an update or a new job."""


RECLAIM, WAIT = Reclaim(), Wait()


class Slots:
  """The prefetcher's buffers and queued jobs, and the rules over them.

  Not thread-safe: the prefetcher calls it under its own lock.
  """

  def __init__(self, hold: int, depth: int):
    """No job, no buffer.

    Args:
      hold: the most buffers the compute holds at once (`Schedule.held`).
      depth: buffers fetched ahead of the compute (`EngineConfig.prefetch_depth`).
    """
    self.hold, self.depth = hold, depth
    self.in_use = 0
    self.released: collections.deque = collections.deque()  # (key, token), oldest first
    self.ahead: set[tuple[int, int]] = set()  # (job id, position) out of order, not taken
    self.jobs: collections.deque[Job] = collections.deque()  # not fully fetched yet
    self.pending: list[int] = []  # positions of jobs[0] not fetched yet
    self.done_through = 0  # the compute of every job up to this id is done
    self.draining = False  # reclaim every released buffer before anything else
    self.version = 0  # changes with every change of the state the rules read
    self.job_ids = 0
    self.out_of_order = 0
    self.start_buffer_fetches = 0
    self.turn_buffer_fetches = 0  # beyond the slots later in a job (no tail's need)

  def copy(self) -> "Slots":
    """An independent copy (the simulation weighs what-ifs on it).

    Returns:
      The copy.
    """
    other = Slots.__new__(Slots)
    other.__dict__.update(self.__dict__)
    other.released = collections.deque(self.released)
    other.ahead = set(self.ahead)
    other.jobs = collections.deque(self.jobs)
    other.pending = list(self.pending)
    return other

  # -- jobs --------------------------------------------------------------------

  def new_job(self, order, tag: int, limit: Callable[[int], int] | None = None,
              starts: int = 0, needs: Mapping[int, int] | None = None) -> Job:
    """Queues a micro-batch's fetches.

    Args:
      order: unit indices, in the order the compute takes them.
      tag: the step they are for.
      limit: buffers a fetch at each position may fill (default: hold + depth).
      starts: how many first positions' limits include start buffers.
      needs: buffers a fused tail's fetches need, by position.

    Returns:
      The job.
    """
    self.version += 1
    self.job_ids += 1
    job = Job(self.job_ids, tuple(order), tag,
              limit or (lambda p: self.hold + self.depth), starts, needs or {})
    if not self.jobs:
      self.pending = list(range(len(job.order)))
    self.jobs.append(job)
    return job

  def clear_jobs(self) -> None:
    """Forgets every queued job (a cancel)."""
    self.version += 1
    self.jobs.clear()
    self.pending = []
    self.ahead.clear()

  def _fetched(self, job: Job, position: int, ahead: bool) -> None:
    self.version += 1
    self.in_use += 1
    beyond = self.in_use > self.hold + self.depth
    self.start_buffer_fetches += position < job.starts and beyond
    self.turn_buffer_fetches += (position >= job.starts and position not in job.needs
                                 and beyond)
    self.pending.remove(position)
    if ahead:
      self.out_of_order += 1
      self.ahead.add((job.id, position))
    if not self.pending:
      self.jobs.popleft()
      if self.jobs:
        self.pending = list(range(len(self.jobs[0].order)))

  # -- the rules ---------------------------------------------------------------

  def limit(self, job: Job, position: int) -> int:
    """The buffers a fetch at `position` of `job` may fill now.

    Args:
      job: the job.
      position: the position in its order.

    Returns:
      The job's limit, less its start buffers while the job before is computing (a
      fused tail's need stays).
    """
    if position < job.starts and self.done_through < job.id - 1:
      return max(self.hold + self.depth, job.needs.get(position, 0))
    return job.limit(position)

  def next(self, ready: Callable[[int, int], bool]) -> Fetch | Reclaim | Wait:
    """What the fetcher does next (`take` it to commit a fetch).

    Args:
      ready: `ready(unit, tag)`, whether a unit may be fetched for a step now.

    Returns:
      `Fetch`, `RECLAIM` (the oldest released buffer, which the caller frees with
      `reclaimed`) or `WAIT`.
    """
    if self.draining:
      if self.released:
        return RECLAIM
      self.draining = False
    if not self.jobs:
      return WAIT
    job, n = self.jobs[0], self.pending[0]
    if ready(job.order[n], job.tag):
      if self.in_use < self.limit(job, n):
        return Fetch(job, n, False)
      return RECLAIM if self.released else WAIT
    # Out of order only within the in-order fetch's reach (what it would fetch next
    # anyway): the memory model counts buffers around the compute's position.
    reach = n + job.limit(n)
    ahead = next((p for p in self.pending[1:] if p < reach and ready(job.order[p], job.tag)),
                 None)
    if ahead is None:
      return WAIT
    # The lowest limit from the unit in order to the one ahead: the units in between
    # take their buffers under their own limits (the turn's may exceed the head's).
    limit = min(self.limit(job, q) for q in range(n, ahead + 1))
    reserve = max([self.hold, *(k for q, k in job.needs.items() if n <= q < ahead)])
    if len(self.ahead) + reserve >= limit:
      return WAIT
    if self.in_use >= limit:
      return RECLAIM if self.released else WAIT
    return Fetch(job, ahead, True)

  def take(self, action: Fetch) -> None:
    """Commits a fetch `next` chose: its buffer is alive from now on.

    Args:
      action: the `Fetch`.
    """
    self._fetched(action.job, action.position, action.ahead)

  def acquire(self, job: Job, position: int) -> Reclaim | Wait | None:
    """A fetch on the compute's own thread (no prefetch thread): the buffer for
    `position` of `job`, the next one in order.

    Args:
      job: the job.
      position: the position.

    Returns:
      None when the buffer is taken (alive from now on), else what must happen
      first: `RECLAIM` or `WAIT`.
    """
    if self.in_use < self.limit(job, position):
      self._fetched(job, position, False)
      return None
    return RECLAIM if self.released else WAIT

  def release(self, key: Any, token: Any = None) -> None:
    """The compute is done with a buffer once `token` is ready.

    Args:
      key: the buffer's ledger key.
      token: an array computed from it (None: done now).
    """
    self.version += 1
    self.released.append((key, token))

  def reclaim(self) -> tuple[Any, Any]:
    """Takes the oldest released buffer; the caller frees it once its token is ready
    and then calls `reclaimed`.

    Returns:
      (its key, its token).
    """
    self.version += 1
    return self.released.popleft()

  def reclaimed(self) -> None:
    """A reclaimed buffer is free."""
    self.version += 1
    self.in_use -= 1

  def taken(self, job_id: int, position: int) -> None:
    """The compute took a buffer.

    Args:
      job_id: its job.
      position: its position.
    """
    self.version += 1
    self.ahead.discard((job_id, position))

  def job_done(self, job_id: int) -> None:
    """The compute of a job (and of every one before it) is done.

    Args:
      job_id: the job.
    """
    self.version += 1
    self.done_through = max(self.done_through, job_id)
