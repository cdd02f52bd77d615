"""Device -> host -> optimizer: the gradient pipeline, its two threads and the update clock.

Each unit's gradient goes to the transfer thread as soon as it exists (device ->
host), then to the optimizer thread, which updates the unit (per-unit modes) or
adds it to the unit's accumulator (micro-batches, or updates deferred to the end of
the sweep). Threads exchange typed records (`GradJob`, `UpdateAllJob`). Each queue
holds at most `MAX_PENDING_GRADIENTS` jobs, which bounds the gradients on the
device whatever the depth.

A thread records the first exception it meets and stops handling jobs; the
caller's next wait on it raises that exception. Only callers time out.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, NamedTuple, Sequence

import jax

from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.engine.nonfinite import StepGuard
from megatrain_jax.engine.device.ledger import Ledger
from megatrain_jax.engine.workers import Worker
from megatrain_jax.engine.host.copies import UnitStore
from megatrain_jax.engine.device.transport import Transport


class GradJob(NamedTuple):
  """One unit's gradient of one micro-batch.

  Attributes:
    key: its ledger key, freed once it is on the host.
    unit: the unit index.
    grad: its flat gradient (on the device, then on the host).
    finite: the template's fp32 sum of squares of the gradient (finite when the
      gradient is; the step's norm when there is one micro-batch).
    last: the step's last micro-batch (update now, in per-unit modes).
    guard: the step's `StepGuard`.
  """
  key: tuple
  unit: int
  grad: jax.Array
  finite: jax.Array
  last: bool
  guard: StepGuard


class UpdateAllJob(NamedTuple):
  """After a deferred sweep whose gradients are all finite: update every unit."""
  guard: StepGuard


class UpdateClock:
  """For each unit, the last step whose update of it is done (applied or refused).

  A fetch for step s waits until its unit's entry reaches s - 1. Every change, and
  every failure of the engine's threads (`interrupt`), wakes the waiters and calls
  the listeners (the prefetch thread's `wake`).
  """

  def __init__(self, n_units: int, frozen: Sequence[int] = ()):
    """Every unit as of step 0.

    Args:
      n_units: the units.
      frozen: units with nothing to update, always ready.
    """
    self._done = [0] * n_units
    self._frozen = frozenset(frozen)
    self._cond = threading.Condition()
    self._listeners: list[Callable[[], None]] = []

  def listen(self, fn: Callable[[], None]) -> None:
    """Calls `fn()` after every change from now on.

    Args:
      fn: a callable that must not block.
    """
    self._listeners.append(fn)

  def _changed(self) -> None:
    self._cond.notify_all()
    for fn in self._listeners:
      fn()

  def snapshot(self) -> tuple[int, ...]:
    """Each unit's last step whose update is done.

    Returns:
      One step per unit.
    """
    with self._cond:
      return tuple(self._done)

  def ready(self, u: int, step: int) -> bool:
    """Whether a unit's copy is the one a step computes with.

    Args:
      u: the unit.
      step: the step.

    Returns:
      True once the unit's update of the step before is done (always, for a unit
      that does not train).
    """
    return self._done[u] >= step - 1 or u in self._frozen

  def mark(self, units, step: int) -> None:
    """Records updates as done (applied or refused).

    Args:
      units: unit indices.
      step: the step whose update of them is done.
    """
    with self._cond:
      for u in units:
        self._done[u] = max(self._done[u], step)
      self._changed()

  def reset(self, step: int) -> None:
    """Sets every unit as of a step (after a restore).

    Args:
      step: the step.
    """
    with self._cond:
      self._done = [step] * len(self._done)
      self._changed()

  def interrupt(self) -> None:
    """Wakes every waiter, to see a failure (an engine thread's error)."""
    with self._cond:
      self._changed()

  def wait(self, u: int, step: int, check: Callable[[], None],
           deadline: float | None = None, what: str = "") -> None:
    """Blocks until `ready(u, step)`.

    Args:
      u: the unit.
      step: the step about to use it.
      check: raises when the engine stopped (called whenever woken).
      deadline: `time.monotonic()` past which a caller gives up (None: never).
      what: the unit's name for the message.

    Raises:
      TimeoutError: past `deadline` (a caller's wait; the threads give none).
    """
    with self._cond:
      while not self.ready(u, step):
        check()
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise TimeoutError(f"The update of {what or f'unit {u}'} took too long.")
        self._cond.wait(left)


class GradientPipeline:
  """The gradient and optimizer threads, and what they do with each job."""

  def __init__(self, host_opt: HostOptimizer, store: UnitStore, clock: UpdateClock,
               transport: Transport, ledger: Ledger, defer: bool, timeout_s: float,
               grad_hook: Callable[[int, jax.Array], jax.Array] | None = None,
               on_error: Callable[[], None] | None = None):
    """Starts the two threads.

    Args:
      host_opt: the masters, state and accumulators.
      store: refreshed after each update.
      clock: marked as each unit's update is done.
      transport: brings gradients to the host.
      ledger: a gradient's device bytes are counted until it is on the host.
      defer: every update waits for the sweep (no per-unit update during it).
      timeout_s: a caller's longest wait on these threads.
      grad_hook: `hook(unit, device_gradient) -> gradient`, run on the caller's
        thread before the gradient leaves (its finite flag is then recomputed).
      on_error: called when either thread fails (to wake what waits on the engine).
    """
    self.host_opt, self.store, self.clock = host_opt, store, clock
    self.transport, self.ledger = transport, ledger
    self.defer, self.timeout_s, self.grad_hook = defer, timeout_s, grad_hook
    self._finite_flags: list[list[jax.Array]] = [[] for _ in host_opt.store.specs]
    self.d2h_bytes = 0
    self.d2h_s = 0.0
    self.opt_s = 0.0
    self._changed = threading.Condition()  # an update done, or a thread failed
    self._on_error = on_error
    self._norms: weakref.WeakSet = weakref.WeakSet()  # the norms of steps under way

    def failed():
      with self._changed:
        self._changed.notify_all()
      error = self.to_host.error or self.optimizer.error
      for norm in list(self._norms):  # their updates may never come
        norm.fail(error)
      if on_error is not None:
        on_error()

    self.to_host = Worker(self._to_host, "grads", close_timeout_s=timeout_s,
                          on_error=failed)
    self.optimizer = Worker(self._update, "optimizer", close_timeout_s=timeout_s,
                            on_error=failed)

  # -- caller side -----------------------------------------------------------

  def send(self, key: tuple, u: int, grad: jax.Array, finite: jax.Array, last: bool,
           guard: StepGuard) -> None:
    """Queues a unit's gradient (already in the ledger) for the link and the update.

    Args:
      key: its ledger key.
      u: the unit.
      grad: its flat gradient on the device.
      finite: the template's flag, whether it is all finite.
      last: the step's last micro-batch.
      guard: the step's guard.
    """
    if self.grad_hook is not None:
      grad = self.grad_hook(u, grad)
      finite = jax.numpy.sum(jax.numpy.square(grad.astype(jax.numpy.float32)))
    if guard.norm is not None:
      self._norms.add(guard.norm)
    self.d2h_bytes += grad.nbytes
    self.to_host.submit(GradJob(key, u, grad, finite, last, guard), self.timeout_s)

  def update_all(self, guard: StepGuard) -> None:
    """Queues the update of every unit after a deferred sweep.

    Args:
      guard: the step being updated.
    """
    self.optimizer.submit(UpdateAllJob(guard), self.timeout_s)

  def check(self) -> None:
    """Raises what stopped either thread."""
    self.to_host.check()
    self.optimizer.check()

  def wait_until(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Blocks until `done()`, woken by every update and by a thread's failure.

    Args:
      done: the condition.
      timeout_s: the longest wait.
      what: what is waited for, for the message.

    Raises:
      What stopped either thread; TimeoutError past `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    with self._changed:
      while not done():
        self.check()
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"{what} took over {timeout_s:.0f} s.")
        self._changed.wait(left)
    self.check()

  def wait(self) -> None:
    """Waits for every queued gradient and update; raises what they met."""
    self.to_host.wait(self.timeout_s)
    self.optimizer.wait(self.timeout_s)

  def drop_gradients(self) -> None:
    """Forgets every accumulated gradient and finite flag (a skipped step)."""
    self.host_opt.store.drop_gradients()
    self._finite_flags = [[] for _ in self.host_opt.store.specs]

  def close(self) -> BaseException | None:
    """Lets queued jobs finish and stops both threads.

    Returns:
      The first error either thread met, or None (the threads keep no reference).
    """
    self.to_host.close()
    self.optimizer.close()
    error = self.to_host.error or self.optimizer.error
    self.to_host.forget_error()
    self.optimizer.forget_error()
    return error

  # -- the threads -----------------------------------------------------------

  def _to_host(self, box: list) -> None:
    job: GradJob = box.pop()
    t0 = time.perf_counter()
    on_host = job._replace(grad=self.transport.d2h(job.grad))
    del job  # the device gradient is free once on the host
    self.d2h_s += time.perf_counter() - t0
    self.ledger.remove(on_host.key)
    self.optimizer.submit(on_host, timeout_s=None)

  def _update(self, box: list) -> None:
    job = box.pop()
    t0 = time.perf_counter()
    try:
      if isinstance(job, UpdateAllJob):
        self._update_all(job.guard)
      elif job.last and not self.defer:
        self._update_now(job)
      else:
        self.host_opt.store.accumulate(job.unit, job.grad)
        if not self.defer:  # deferred updates check the accumulated sums instead
          self._finite_flags[job.unit].append(job.finite)
        self.host_opt.store.accum[job.unit].block_until_ready()
    finally:
      self.opt_s += time.perf_counter() - t0
      with self._changed:
        self._changed.notify_all()

  def _update_now(self, job: GradJob) -> None:
    """A per-unit update during the backward (see `StepGuard.admit`)."""
    u, guard = job.unit, job.guard
    flags, self._finite_flags[u] = [*self._finite_flags[u], job.finite], []
    try:
      if not guard.admit(u, flags):
        self.host_opt.store.take_gradient(u)  # refused: forgotten
        if guard.norm is not None:
          guard.norm.refuse()
        return
      new = self.host_opt.update_unit(u, job.grad, stream=self.store.keep_copy)
      guard.updated.append(u)
      # One micro-batch: the device's sum is the unit's; else the update's, of the sum.
      self._record(guard, u, flags[0] if len(flags) == 1 else None)
      # Done before the unit's next fetch is allowed (it reads the result).
      jax.block_until_ready(new if new is not None else self.host_opt.store.fetch_parts(u))
      self.store.updated(u, new)
    except BaseException as e:
      if guard.norm is not None:
        guard.norm.fail(e)
      raise
    finally:
      guard.first_done.set()
      self.clock.mark([u], guard.step)

  def _update_all(self, guard: StepGuard) -> None:
    def done(u, new):
      self._record(guard, u)
      self.store.updated(u, new)
      self.clock.mark([u], guard.step)

    try:
      self.host_opt.update_all(stream=self.store.keep_copy, on_unit=done)
    except BaseException as e:
      if guard.norm is not None:
        guard.norm.fail(e)
      raise
    finally:
      self.clock.mark(range(len(self.host_opt.store.specs)), guard.step)


  def _record(self, guard: StepGuard, u: int, device_sumsq=None) -> None:
    """Adds the sum of squares of the gradient the update of `u` just applied to the
    step's norm: the device's, or the one the host update read."""
    sumsq = self.host_opt.sumsq.pop(u, None)
    sumsq = device_sumsq if sumsq is None else sumsq
    if sumsq is not None and guard.norm is not None:
      guard.norm.add(sumsq)
