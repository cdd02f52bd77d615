"""The parts of a streaming trainer that its threads use, and their one shutdown.

The threads reference a `Runtime`, never the `StreamingTrainer` that wraps it, so a
trainer dropped without `close()` is collected: its finalizer shuts the runtime
down (threads stopped, device buffers freed) and the host state goes with it.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
from absl import logging

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.gradients import GradientPipeline, UpdateClock
from megatrain_jax.engine.host_optimizer import HostOptimizer
from megatrain_jax.engine.prefetch import Ledger, Prefetcher
from megatrain_jax.engine.schedule import Schedule
from megatrain_jax.engine.state import CopyCounter, Snapshot
from megatrain_jax.engine.store import UnitStore
from megatrain_jax.engine.transport import Transport


class Runtime:
  """Host state, copies, clock, prefetcher and gradient pipeline of one trainer."""

  def __init__(self, ec: EngineConfig, schedule: Schedule, host_opt: HostOptimizer,
               transport: Transport, keep_copy: bool,
               grad_hook: Callable[[int, jax.Array], jax.Array] | None = None):
    """Starts the threads.

    Args:
      ec: the engine config.
      schedule: the step's order (slots and resident units).
      host_opt: the masters and optimizer state (taken over).
      transport: moves bytes.
      keep_copy: keep a streaming copy of every unit in pinned host memory.
      grad_hook: see `GradientPipeline`.
    """
    self.ec, self.schedule, self.host_opt, self.transport = ec, schedule, host_opt, transport
    self.cd = jnp.dtype(ec.compute_dtype)
    self.ledger = Ledger()
    self.copies = CopyCounter()
    self.clock = UpdateClock(schedule.n_units)
    self.store = UnitStore(host_opt, transport, self.cd, keep_copy, self.ledger)
    # Updates wait for the whole sweep when the transform needs every gradient, or
    # when a non-finite step must be skippable.
    self.defer = host_opt.updates_after_sweep or ec.nonfinite == "skip"
    self._grad_hook = grad_hook
    self.open = False
    self.start()

  def start(self) -> None:
    """Starts (or, after a failure, restarts) the prefetch and gradient threads."""
    self.prefetcher = Prefetcher(self.fetch, self.ec.prefetch_depth, self.schedule.held,
                                 self.ledger, self.ec.timeout_s, ready=self.ready)
    self.pipeline = GradientPipeline(self.host_opt, self.store, self.clock, self.transport,
                                     self.ledger, self.defer, self.ec.timeout_s,
                                     self._grad_hook)
    self.store.place_resident(self.schedule.resident_units())
    self.open = True

  # -- called by the prefetch thread -------------------------------------------

  def _check_alive(self) -> None:
    self.pipeline.check()
    if not self.open:
      raise RuntimeError("The StreamingTrainer was closed during a fetch.")

  def ready(self, u: int, step: int) -> bool:
    """Whether unit u can be fetched for `step` (raises what stopped the engine)."""
    if self.clock.ready(u, step):
      return True
    self._check_alive()
    return False

  def fetch(self, u: int, step: int) -> jax.Array:
    """Unit u's copy on the device, once its update from the step before is done."""
    self.clock.wait(u, step, self._check_alive)
    return self.store.to_device(u)

  # -- called by the trainer ----------------------------------------------------

  def await_update(self, u: int, step: int) -> None:
    """The caller waits (up to `timeout_s`) for unit u's update before `step`."""
    self.clock.wait(u, step, self._check_alive,
                    deadline=time.monotonic() + self.ec.timeout_s,
                    what=self.schedule.unit_name(u))

  def snapshot(self, order, read, max_copies: int) -> Snapshot:
    """A snapshot whose parts the updates copy (at most `max_copies` ahead of the
    writer) before they change them; installed until the writer closes it."""
    snap = Snapshot(list(order), read, max_copies, self.copies)
    keys = dict(zip(self.host_opt.state_names(), self.state_keys()))

    def before_donate(units):
      if snap.closed:
        self.host_opt.set_before_donate(None)
        return
      snap.before_change([keys[u] for u in units])

    self.host_opt.set_before_donate(before_donate)
    return snap

  def state_keys(self) -> list[str]:
    """The checkpoint part names of `host_opt.state_names()`, in that order."""
    return [n if n == "optimizer" else self.schedule.state_key(n)
            for n in self.host_opt.state_names()]

  def shutdown(self) -> BaseException | None:
    """Lets queued updates finish, stops the threads, frees every device buffer the
    engine holds. Idempotent; returns the first error a thread met."""
    if not self.open:
      return None
    self.open = False
    error = None
    try:
      self.prefetcher.close()
    except BaseException as e:  # pylint: disable=broad-except
      error = e
    error = self.pipeline.close() or error
    self.store.free_device()
    self.host_opt.close()
    return error


def shutdown_quietly(runtime: Runtime) -> None:
  """The finalizer of a trainer dropped (or left at exit) without `close()`."""
  try:
    error = runtime.shutdown()
  except Exception as e:  # pylint: disable=broad-except
    error = e
  if error is not None:
    logging.error("A StreamingTrainer closed without close() had failed after its last "
                  "step returned (%s: %s); its host state may be half-updated.",
                  type(error).__name__, error)
