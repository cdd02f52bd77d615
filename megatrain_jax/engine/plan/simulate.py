"""A step's program replayed under the timing the memory model assumes: the device peak.

`trace(programs, ...)` runs the operations of `plan.program` in order, with the
other threads' work done where the *modelled timing* puts it: the worst case for
device memory that a real run can reach. The device computes as late as it can,
everything else moves as the engine lets it.

- The device computes lazily: a call dispatched by the step's thread is done only
  when something waits for it (a gradient's or a checkpoint's copy to the host, or
  the prefetcher freeing a buffer when the step's thread waits on that, or the
  step's end); a released buffer stays on the device until then.
- Transfers toward the device are instant: between two operations the prefetcher
  fetches everything the slot rules allow (`plan.slots`, the rules the prefetch
  thread runs), and reclaims a released buffer only when a fetch needs its slot
  (and its compute is done) or at the step's end.
- Gradients leave as late as possible: when a new one finds the queue full
  (`MAX_PENDING_GRADIENTS`), or the step's thread waits for an update that waits for
  it (a fetch of the next step, a resident unit, the verdict); the update is then done.
- A checkpoint sent to host memory leaves as late as possible (when the next one is
  sent, or at the flush before the head); one brought back arrives at once.

Where the device computes faster than that, the prefetcher frees released buffers
sooner and fetches the next units into their slots, which may hold more bytes (a
layer's slot taking the head, say). So the simulation also weighs, at each point,
every dispatched call done at once there; where that goes higher, the worst case is
the lazy timing with that one burst of compute.

The order of events does not depend on the sizes: `trace` replays the operations
once and returns a `plan.trace.Trace`, which a batch shape's bytes weigh. The ledger
has the same keys as the engine's; the peak is its largest total, by kind. A real
run's ledger never holds more. `timeline` gives each operation's start and each
event a real run must be held back for to follow this timing, with the ledger and
the update clock before it; tests/pacing.py forces a real run through it, and its
ledger then peaks at exactly this figure.
"""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np

from megatrain_jax.engine.config import MAX_PENDING_GRADIENTS
from megatrain_jax.engine.device.ledger import Key, kind
from megatrain_jax.engine.plan import ops
from megatrain_jax.engine.plan import program as P
from megatrain_jax.engine.plan.sizes import StepBytes
from megatrain_jax.engine.plan.slots import RECLAIM, Fetch, Slots
from megatrain_jax.engine.plan.trace import KIND_INDEX, Entry, Trace, symbols, values


class _Run:
  """The engine's parts, replayed: the ledger, the device's compute, the prefetcher's
  slots, the gradient queue and the update clock, the checkpoints leaving, the pool.

  Ledger entries hold byte rules (`symbols`); `values` weighs them for a timeline.
  """

  def __init__(self, n_layers: int, n_units: int, hold: int, depth: int,
               structures: Sequence[int], resident: Sequence[int],
               values: np.ndarray | None = None, burst_at: int | None = None):
    self.b = symbols(n_units, n_layers)
    self.depth, self.structures, self.values = depth, structures, values
    self.points = 0  # operations started so far
    self.burst_at = burst_at  # the operation before which every call is done at once
    self.live: dict[Key, int] = {}  # key -> its byte rule
    self.changes: list[tuple[int, int, int]] = []  # (sign, rule, kind)
    self.bursts: list = []  # ([(operation, changes before it)...], the burst's changes)
    self._last_sig, self._last_burst = None, None
    self._waits_at = None  # what the prefetcher's rules read when they last said wait
    self.timeline: list[Entry] = []
    self.slots = Slots(hold, depth)
    self.started: collections.deque = collections.deque()  # jobs the step will take
    self.current, self.position = None, 0
    self.arrived: set[tuple[int, int]] = set()
    self.waiting: tuple[Key, int] | None = None  # a reclaim waiting for its compute
    self.dispatched = self.done = 0  # calls dispatched, and done, in order
    self.queue: collections.deque = collections.deque()  # gradients not left yet
    self.updated = [0] * n_units  # per unit, the last step whose update is done
    self.updates = 0  # changes of `updated`
    self.frozen: frozenset[int] = frozenset()  # units with no update: always ready
    self.first_update: dict[int, int] = {}  # step -> the unit of its first update
    self.outs: collections.deque = collections.deque()  # checkpoints still leaving
    self.pool: dict[int, list[Key]] = {}
    self.pooled = 0
    self.step = 0
    self.producer: dict[int, int] = {}  # unit -> the call that made its last gradient
    for u in resident:
      self.add(("resident", u), self.b.unit[u])

  # -- the ledger and the timeline ---------------------------------------------

  def add(self, key: Key, rule: int) -> None:
    if key in self.live:
      self.remove(key)
    self.live[key] = rule
    self.changes.append((1, rule, KIND_INDEX[kind(key)]))

  def remove(self, key: Key) -> None:
    rule = self.live.pop(key, None)
    if rule is not None:
      self.changes.append((-1, rule, KIND_INDEX[kind(key)]))

  def mark(self, what: str, op: ops.Op | None = None) -> None:
    """A point of the timeline. Before an operation: the burst of compute the worst
    case puts there (`burst_at`), or, while tracing, the burst weighed there."""
    if what == "op":  # bursts at the start of an operation, where nothing is mid-way
      self.points += 1
      if self.points == self.burst_at:
        self.compute_until(self.dispatched)
        self.settle()
      elif self.burst_at is None and self.values is None:
        self.weigh_burst()
    if self.values is not None:
      state = tuple(sorted((kind(k), int(self.values[r])) for k, r in self.live.items()))
      self.timeline.append(Entry(what, state, tuple(self.updated), op))

  def weigh_burst(self) -> None:
    """What the ledger goes through if every call dispatched so far were done here:
    the prefetcher then reclaims the buffers they released and fetches into their
    slots, which may hold more than the buffers they replace. Points where the
    prefetcher is as it was at the last one share that one's burst."""
    if self.waiting is None or self.waiting[1] > self.dispatched or (
        self.waiting[1] <= self.done):
      return  # the prefetcher waits for no compute that a burst would finish
    # Every release's compute is done by the burst: what it does depends on the
    # slots, the reclaim waited for, the updates done and the fetches not taken.
    sl = self.slots
    sig = (sl.version, sl.draining, self.waiting, self.updates, len(self.arrived))
    if sig == self._last_sig:
      if self._last_burst is not None:
        self._last_burst[0].append((self.points, len(self.changes)))
      return
    self._last_sig, self._last_burst = sig, None
    params = {k: v for k, v in self.live.items() if k[0] == "param"}
    saved = (sl.copy(), set(self.arrived), self.waiting, self.done, self.changes,
             self._waits_at)
    self.changes = []
    self.compute_until(self.dispatched)
    self.settle()
    if any(sign > 0 for sign, _, _ in self.changes):  # only a fetch can go higher
      self._last_burst = ([(self.points, len(saved[4]))], self.changes)
      self.bursts.append(self._last_burst)
    (self.slots, self.arrived, self.waiting, self.done, self.changes,
     self._waits_at) = saved
    for k in [k for k in self.live if k[0] == "param"]:
      del self.live[k]
    self.live.update(params)

  # -- the other threads -------------------------------------------------------

  def ready(self, u: int, tag: int) -> bool:
    return self.updated[u] >= tag - 1 or u in self.frozen

  def settle(self) -> None:
    """The prefetch thread fetches and reclaims until its rules, or a compute not
    done yet, make it wait."""
    if not self.depth:
      return
    while True:
      if self.waiting is not None:
        if self.waiting[1] > self.done:
          return
        self._reclaimed()
        continue
      at = (self.slots.version, self.slots.draining, self.updates)
      if at == self._waits_at:
        return  # nothing it reads changed since its rules said wait
      action = self.slots.next(self.ready)
      if isinstance(action, Fetch):
        self.slots.take(action)
        self._arrive(action.job, action.position)
      elif action is RECLAIM:
        self.waiting = self.slots.reclaim()
      else:
        self._waits_at = at
        return

  def _arrive(self, job, n: int) -> None:
    self.arrived.add((job.id, n))
    self.add(("param", job.id, n), self.b.unit[job.order[n]])

  def _reclaimed(self) -> None:
    """The buffer waited for is free: its compute is done."""
    self.mark("compute")
    self.remove(self.waiting[0])
    self.slots.reclaimed()
    self.waiting = None

  def compute_until(self, seq: int) -> None:
    """The device's calls up to `seq` are done (something waits for their result)."""
    self.done = max(self.done, seq)

  def depart(self) -> None:
    """The oldest gradient leaves the device (once computed); its update is then done."""
    key, u, step, updates, producer = self.queue[0]
    self.compute_until(producer)
    self.mark("d2h")
    self.queue.popleft()
    self.remove(key)
    if updates:
      self.updated[u] = max(self.updated[u], step)
      self.updates += 1
    self.settle()

  def depart_until(self, done) -> None:
    while not done():
      if not self.queue:
        raise RuntimeError("The simulated step waits for an update no gradient leads to.")
      self.depart()

  def send_out(self) -> None:
    """Every checkpoint still leaving arrives in host memory (once computed). What the
    prefetcher may do once that compute is done waits for the end of the operation,
    which goes on without waiting for it."""
    while self.outs:
      key, producer = self.outs[0]
      self.compute_until(producer)
      self.mark("offload")
      self.outs.popleft()
      self.remove(key)

  def await_fetch(self, job, n: int) -> None:
    """The step's thread waits for a fetch: the compute the prefetcher waits on is
    done first, then gradients leave until the unit's update lets it come."""
    while (job.id, n) not in self.arrived:
      if self.waiting is not None:
        self.compute_until(self.waiting[1])
        self.settle()
      elif self.queue:
        self.depart()
      else:
        raise RuntimeError("The simulated step waits for a fetch that cannot come.")

  def drain(self) -> None:
    """The step's end: every released buffer is freed (its compute waited for), by
    the prefetch thread before anything else, or by the step's thread without one."""
    if self.depth:
      self.slots.draining = True
    while self.slots.released or self.waiting is not None:
      if self.waiting is None:
        if self.depth:
          self.settle()  # takes the oldest (`Slots.draining`)
          continue
        self.waiting = self.slots.reclaim()
      self.compute_until(self.waiting[1])
      if self.depth:
        self.settle()
      else:
        self._reclaimed()

  # -- operations --------------------------------------------------------------

  def _job(self):
    if self.current is None or self.position >= len(self.current.order):
      self.current, self.position = self.started.popleft(), 0
    return self.current

  def run(self, op: ops.Op, schedule, deferred: bool, last_m: int) -> None:
    self.mark("op", op)
    if isinstance(op, ops.StartFetches):
      self.started.append(self.slots.new_job(
          schedule.fetch_order, self.step + op.ahead, schedule.limit,
          schedule.start_positions, schedule.tail_needs))
    elif isinstance(op, ops.Take):
      job = self._job()
      self.position += 1
      if self.depth:
        self.await_fetch(job, op.position)
      else:
        while (action := self.slots.acquire(job, op.position)) is not None:
          if action is not RECLAIM:
            raise RuntimeError("A fetch without prefetch has no buffer to reclaim.")
          self.waiting = self.slots.reclaim()
          self.compute_until(self.waiting[1])
          self._reclaimed()
        self.depart_until(lambda: self.ready(op.unit, job.tag))
        self._arrive(job, op.position)
      self.slots.taken(job.id, op.position)
      self.arrived.discard((job.id, op.position))
    elif isinstance(op, ops.UseResident):
      self.depart_until(lambda: self.ready(op.unit, self.step))
    elif isinstance(op, ops.Release):
      self.slots.release(("param", self.current.id, op.position), self.dispatched)
    elif isinstance(op, ops.JobDone):
      self.slots.job_done(self.current.id)
    elif isinstance(op, ops.Flush) or (isinstance(op, ops.Checkpoint) and op.host):
      self.send_out()
    elif isinstance(op, ops.SendGradient):
      while len(self.queue) >= MAX_PENDING_GRADIENTS:
        self.depart()
    elif isinstance(op, ops.Settle):
      if not op.update or op.deferred:
        self.depart_until(lambda: not self.queue)
        if op.update:
          self.updated = [max(d, self.step) for d in self.updated]
          self.updates += 1
      elif self.step in self.first_update:
        first = self.first_update[self.step]
        self.depart_until(lambda: self.updated[first] >= self.step)
    elif isinstance(op, ops.Drain):
      self.drain()
    if isinstance(op, ops.TEMPLATE_CALLS):
      self.dispatched += 1
    for key, nbytes in op.effects(self.b):
      if nbytes is None:
        self.remove(key)
      else:
        self.add(key, nbytes)
    self._after(op, deferred, last_m)
    self.settle()

  def _after(self, op: ops.Op, deferred: bool, last_m: int) -> None:
    """What an operation leaves to the other threads."""
    if isinstance(op, ops.Checkpoint) and op.host:
      self.outs.append((("ckpt", op.m, op.group), self.dispatched))
    elif isinstance(op, ops.BlockForward) and op.pooled:
      free = self.pool.get(self.structures[op.layer])
      if free:
        self.remove(free.pop())
    elif isinstance(op, ops.BlockBackward) and op.pooled:
      self.pooled += 1
      key = ("pool", self.pooled)
      self.pool.setdefault(self.structures[op.layer], []).append(key)
      self.add(key, self.b.ckpt[op.layer])
    elif isinstance(op, ops.Reload):
      self.add(("ckpt", op.m, op.group), self.b.ckpt[op.group])
    elif isinstance(op, ops.SendGradient):
      updates = op.m == last_m and not deferred
      if updates and self.step not in self.first_update:
        self.first_update[self.step] = op.unit
      self.queue.append((("grad", op.m, op.unit), op.unit, self.step, updates,
                         self.producer[op.unit]))
    if isinstance(op, (ops.Head, ops.BlockBackward, ops.EmbedBackward)):
      for key, nbytes in op.effects(self.b):
        if nbytes is not None and key[0] == "grad":
          self.producer[key[2]] = self.dispatched


def trace(programs: Sequence[P.StepProgram], depth: int, structures: Sequence[int]
          ) -> Trace:
  """The ledger's changes over steps from a trainer just built, under the modelled
  timing, with every burst of compute that could make it go higher.

  Args:
    programs: one per step (the first with `started=False`).
    depth: `EngineConfig.prefetch_depth` (0: fetches on the step's thread).
    structures: each layer's structure (layers of one structure share pooled
      buffers), e.g. the index of the first layer like it.

  Returns:
    The `Trace`.
  """
  run = _replay(programs, depth, structures)
  sign, rule, kinds = (np.array(x, np.int64) for x in zip(*run.changes))
  flat = [c for _, changes in run.bursts for c in changes]
  bursts = [np.array(x, np.int64) for x in zip(*flat)] if flat else [np.zeros(0, np.int64)] * 3
  sizes = lambda xs: np.cumsum([0] + [len(x) for x in xs])[:-1].astype(np.int64)
  return Trace(sign, rule, kinds, tuple(bursts), sizes([c for _, c in run.bursts]),
               sizes([p for p, _ in run.bursts]),
               np.array([n for p, _ in run.bursts for _, n in p], np.int64))


def timeline(programs: Sequence[P.StepProgram], b: StepBytes, depth: int,
             structures: Sequence[int]) -> list[Entry]:
  """The points a real run forced into the worst case goes through: the lazy timing,
  with the burst of compute that reaches the peak (`Trace.peak`).

  Args:
    programs: as `trace`.
    b: the byte rules.
    depth: as `trace`.
    structures: as `trace`.

  Returns:
    The `Entry`s, in order.
  """
  _, burst = trace(programs, depth, structures).peak(b)
  at = None
  if burst is not None:
    at = _replay(programs, depth, structures).bursts[burst[0]][0][burst[1]][0]
  return _replay(programs, depth, structures, values(b), at).timeline


def _replay(programs, depth, structures, vals=None, burst_at=None) -> _Run:
  s = programs[0].schedule
  run = _Run(s.n_layers, s.n_units, s.held, depth, structures, s.resident_units(), vals,
             burst_at)
  # A unit that sends no gradient has no update to wait for.
  sent = {op.unit for prog in programs for op in prog.ops if isinstance(op, ops.SendGradient)}
  run.frozen = frozenset(range(s.n_units)) - sent
  for step, prog in enumerate(programs, 1):
    run.step = step
    settle = next(op for op in prog.ops if isinstance(op, ops.Settle))
    last_m = prog.grad_accum - 1 if settle.update else -1
    for op in prog.ops:
      run.run(op, prog.schedule, settle.deferred, last_m)
  return run

