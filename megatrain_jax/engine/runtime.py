"""The parts of a streaming trainer that its threads use, and their one shutdown.

The threads reference a `Runtime`, never the `StreamingTrainer` that wraps it, so a
trainer dropped without `close()` is collected: its finalizer shuts the runtime
down (threads stopped, device buffers freed) and the host state goes with it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from absl import logging

from megatrain_jax.engine import nonfinite
from megatrain_jax.engine.device.activations import HostActivations
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.host.gradients import GradientPipeline, UpdateClock
from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.engine.plan.memory import StepPlan
from megatrain_jax.engine.device.ledger import Ledger
from megatrain_jax.engine.device.prefetch import Prefetcher
from megatrain_jax.engine.device.pool import BufferPool
from megatrain_jax.engine.plan.schedule import Schedule
from megatrain_jax.engine.host.state import CopyCounter, Snapshot
from megatrain_jax.engine.host.copies import UnitStore
from megatrain_jax.engine.device.transport import Transport


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
    self.platform = transport.device.platform
    self.ledger = Ledger()
    self.copies = CopyCounter()
    self.clock = UpdateClock(schedule.n_units, [u for u, s in enumerate(host_opt.store.specs)
                                                if not s.train_size])
    self.clock.listen(lambda: self.prefetcher.wake())  # an update done may let it fetch
    self.store = UnitStore(host_opt, transport, self.cd, keep_copy, self.ledger)
    # Updates wait for the whole sweep when the transform needs every gradient, or
    # when a non-finite step must be skippable.
    self.defer = host_opt.updater.deferred or ec.nonfinite == "skip"
    # Each unit's elements that train, when some are frozen (`plan.memory.step_plan`).
    specs = host_opt.store.specs
    self.trains = (None if all(s.frozen_size == 0 for s in specs)
                   else tuple(s.train_size for s in specs))
    self.trained_units = sum(s.train_size > 0 for s in specs)  # updates a step makes
    self._grad_hook = grad_hook
    self.h2d_bytes = self.peak_bytes = 0
    self.last_plan: StepPlan | None = None  # the last step's (where its checkpoints went)
    self.last: dict[str, float] = {}
    self.open = False
    self.start()

  def start(self) -> None:
    """Starts (or, after a failure, restarts) the prefetch and gradient threads, and
    puts the resident units on the device.

    Raises:
      What placing the resident units met (the threads are stopped again).
    """
    self.prefetcher = Prefetcher(self.fetch, self.ec.prefetch_depth, self.schedule.held,
                                 self.ledger, self.ec.timeout_s, ready=self.ready,
                                 await_compute=self.transport.await_compute)
    self.pipeline = GradientPipeline(self.host_opt, self.store, self.clock, self.transport,
                                     self.ledger, self.defer, self.ec.timeout_s,
                                     self._grad_hook, on_error=self.clock.interrupt)
    self.activations = HostActivations(self.transport, self.ledger, self.ec.timeout_s)
    self.pool = BufferPool(self.ledger)
    self.open = True  # from here on `shutdown` stops the threads
    try:
      self.store.place_resident(self.schedule.resident_units())
    except BaseException:
      self.shutdown()
      raise

  # -- called by the prefetch thread -------------------------------------------

  def _check_alive(self) -> None:
    self.pipeline.check()
    if not self.open:
      raise RuntimeError("The StreamingTrainer was closed during a fetch.")

  def ready(self, u: int, step: int) -> bool:
    """Whether a unit can be fetched for a step now.

    Args:
      u: the unit.
      step: the step.

    Returns:
      True once its update of the step before is done (raises what stopped the
      engine, if anything did).
    """
    if self.clock.ready(u, step):
      return True
    self.pipeline.check()  # an update that failed never comes
    return False

  def fetch(self, u: int, step: int, deadline: float | None = None) -> jax.Array:
    """A unit's copy on the device, once its update of the step before is done.

    Args:
      u: the unit.
      step: the step the fetch is for.
      deadline: a caller's `time.monotonic()` limit, to wait for the update until;
        None on the prefetch thread, which fetches only units `ready` found
        updated and never waits here (a step refused since then cancels what it
        fetched).

    Returns:
      The device array.
    """
    if deadline is not None:
      self.clock.wait(u, step, self._check_alive, deadline, self.schedule.unit_name(u))
    return self.store.to_device(u)

  # -- called by the trainer ----------------------------------------------------

  def await_update(self, u: int, step: int) -> None:
    """The caller waits (up to `timeout_s`) for a unit's update before a step.

    Args:
      u: the unit.
      step: the step about to use it.
    """
    self.clock.wait(u, step, self._check_alive,
                    deadline=time.monotonic() + self.ec.timeout_s,
                    what=self.schedule.unit_name(u))

  def settle(self, guard: nonfinite.StepGuard, loss: float) -> nonfinite.Bad | None:
    """After a step's sweep: its verdict, and its deferred update queued.

    Deferred updates: every gradient is on the host, so the verdict is final; a
    clean step's update is queued on the optimizer thread (it runs while the next
    step starts), a bad one's units are marked done unchanged. Per-unit updates: the
    first update's verdict (see `nonfinite.first_verdict`).

    Args:
      guard: the step's guard.
      loss: its loss.

    Returns:
      None, or what went bad.
    """
    if not self.defer:
      return nonfinite.first_verdict(guard, loss, self.pipeline, self.ec.timeout_s)
    self.pipeline.wait()
    bad = nonfinite.find_nonfinite(loss, self.host_opt.store.nonfinite_units(),
                                   self.schedule.grad_order)
    if bad is None:
      self.pipeline.update_all(guard)
    else:
      if guard.norm is not None:
        guard.norm.refuse()
      self.clock.mark(range(self.schedule.n_units), guard.step)
    return bad

  # -- state ---------------------------------------------------------------------

  def state_keys(self) -> list[str]:
    """The checkpoint part names.

    Returns:
      One per `store.state_names()` entry, in that order.
    """
    return [n if n == "optimizer" else self.schedule.state_key(n)
            for n in self.host_opt.store.state_names()]

  def state_layout(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """The checkpoint's layout.

    Returns:
      For each part, the (shape, dtype) of its arrays.
    """
    store = self.host_opt.store
    return {key: store.state_layout(name)
            for name, key in zip(store.state_names(), self.state_keys())}

  def frozen_checksums(self) -> dict[str, int]:
    """A CRC-32 of each part's frozen values.

    Returns:
      Part name -> checksum, for the units with frozen values.
    """
    store = self.host_opt.store
    return {self.schedule.state_key(u): store.frozen_checksum(u)
            for u in range(len(store.specs)) if store.frozen[u] is not None}

  def snapshot(self, max_copies: int) -> Snapshot:
    """A snapshot of the host state, installed until the writer closes it.

    Args:
      max_copies: parts an update may copy ahead of the writer before it waits.

    Returns:
      The `Snapshot`, parts in the order the next updates change them.
    """
    store = self.host_opt.store
    key_of = dict(zip(store.state_names(), self.state_keys()))
    name_of = {k: n for n, k in key_of.items()}
    order = [key_of[u] for u in self.schedule.update_order(self.defer)]
    order += [k for k in self.state_keys() if k not in order]
    snap = Snapshot(order, lambda key: store.copy_state(name_of[key]), max_copies,
                    self.copies, stall_s=self.ec.timeout_s)

    def before_donate(names):
      if snap.closed:
        store.set_before_donate(None)
        return
      snap.before_change([key_of[n] for n in names])

    store.set_before_donate(before_donate)
    return snap

  def load_state(self, read: Callable[[str], dict], step: int) -> None:
    """Sets every part of the state.

    Args:
      read: part name -> its arrays.
      step: the step the state is at (every unit is then as of it).
    """
    store = self.host_opt.store
    for name, key in zip(store.state_names(), self.state_keys()):
      store.load_state(name, read(key))
    store.drop_gradients()
    self.clock.reset(step)

  def take_gradients(self) -> list[Any]:
    """The accumulated gradients as unit trees, which are then dropped.

    Returns:
      One tree of fp32 numpy arrays per unit.
    """
    host_opt = self.host_opt
    store = host_opt.store
    grads = [s.unflatten(store.gradient(u)) for u, s in enumerate(store.trained)]
    self.pipeline.drop_gradients()
    return grads

  def remake_copies(self) -> None:
    """After the masters changed outside an update: every unit's copies anew."""
    for u in range(self.schedule.n_units):
      self.store.master_changed(u)

  # -- counters ------------------------------------------------------------------

  def _counters(self) -> tuple[float, ...]:
    moved = self.activations.bytes_moved
    return (self.pipeline.d2h_bytes, self.prefetcher.busy_s, self.pipeline.d2h_s,
            self.pipeline.opt_s, moved["d2h"], moved["h2d"])

  def start_step(self) -> tuple[float, ...]:
    """A step starts: the ledger's peak restarts.

    Returns:
      The running totals, for `end_step`.
    """
    self.ledger.reset_peak()
    return self._counters()

  def count_fetches(self, step: int, input_bytes: int) -> int:
    """Adds a step's host -> device bytes to the total.

    Args:
      step: the step (its fetches, some made during the step before).
      input_bytes: the batch's bytes.

    Returns:
      The step's bytes.
    """
    h2d = (self.prefetcher.bytes_for.pop(step, 0) + self.store.take_resident_h2d_bytes()
           + input_bytes)
    self.h2d_bytes += h2d
    return h2d

  def end_step(self, step: int, before: tuple[float, ...], input_bytes: int, t0: float,
               t_compute: float, t_end: float) -> None:
    """Records a step's bytes, peak and phase times (`stats()["last_step"]`).

    Args:
      step: the step.
      before: `start_step()`'s totals.
      input_bytes: the batch's bytes.
      t0: when the step started.
      t_compute: when its sweep was dispatched.
      t_end: when it returned.
    """
    now = self._counters()
    self.peak_bytes = max(self.peak_bytes, self.ledger.peak)
    act_d2h, act_h2d = now[4] - before[4], now[5] - before[5]
    self.last = {"step_time_s": t_end - t0, "wait_optimizer_s": t_end - t_compute,
                 "h2d_bytes": self.count_fetches(step, input_bytes),
                 "h2d_s": now[1] - before[1], "d2h_s": now[2] - before[2],
                 "host_opt_s": now[3] - before[3], "d2h_bytes": now[0] - before[0],
                 "activation_bytes": {"d2h": act_d2h, "h2d": act_h2d},
                 "device_peak_bytes": self.ledger.peak}

  def stats(self) -> dict[str, Any]:
    """The runtime's part of `StreamingTrainer.stats()`.

    Returns:
      Counters by name (docs/engine.md lists them).
    """
    host_opt = self.host_opt
    return {"h2d_bytes": self.h2d_bytes, "d2h_bytes": self.pipeline.d2h_bytes,
            "device_peak_bytes": self.peak_bytes, "last_step": dict(self.last),
            "device_bytes": self.ledger.current,
            "param_count": sum(s.size for s in host_opt.store.specs),
            "data_parallel_devices": getattr(getattr(self.transport, "base", self.transport),
                                             "n_devices", 1),
            "stream_bytes": self.store.stream_bytes(), "prefetch_slots": self.schedule.slots,
            "optimizer_mode": host_opt.updater.mode,
            "fused_optimizer": host_opt.updater.fused,
            "host_update_parts": max(len(b) for b in host_opt.store.bounds),
            "stream_copy": ("disk" if self.store.files is not None
                            else "keep" if self.store.keep_copy else "on_fetch"),
            "state_tier": host_opt.store.tier, "disk": host_opt.store.io_stats(),
            "out_of_order_fetches": self.prefetcher.out_of_order,
            "start_buffer_fetches": self.prefetcher.start_buffer_fetches,
            "turn_buffer_fetches": self.prefetcher.turn_buffer_fetches,
            "activations": self.last_plan and self.last_plan.activations,
            "host_checkpoint_groups": len(self.last_plan.sent_groups) if self.last_plan else 0,
            "activation_bytes_moved": dict(self.activations.bytes_moved),
            "host_activation_peak_bytes": self.activations.host_peak_bytes,
            "snapshot_copy_bytes": self.copies.current,
            "snapshot_copy_peak_bytes": self.copies.peak}

  def shutdown(self) -> BaseException | None:
    """Lets queued updates finish, stops the threads and frees every device buffer
    the engine holds. Idempotent.

    Returns:
      The first error a thread met, or None.
    """
    if not self.open:
      return None
    self.open = False
    error = None
    try:
      self.prefetcher.close()
    except BaseException as e:  # pylint: disable=broad-except
      error = e
    self.activations.close()
    self.pool.clear()
    pipeline_error, prefetch_error = self.pipeline.close(), self.prefetcher.take_error()
    error = pipeline_error or prefetch_error or error
    self.store.free_device()
    # Entries a failed step left (its activations, gradients never sent): nothing
    # of this runtime is on the device any more.
    self.ledger.clear()
    try:
      self.host_opt.close()  # the disk tier's last writes
    except BaseException as e:  # pylint: disable=broad-except
      error = error or e
    return error


def shutdown_quietly(runtime: Runtime) -> None:
  """The finalizer of a trainer dropped (or left at exit) without `close()`: shuts
  the runtime down and logs a failure it had met. When the collection happens on one
  of the engine's own threads, the shutdown (which joins them) runs on a new one.

  Args:
    runtime: the trainer's runtime.
  """
  if threading.current_thread().name.startswith("megatrain-"):
    threading.Thread(target=shutdown_quietly, args=(runtime,), name="shutdown",
                     daemon=True).start()
    return
  try:
    error = runtime.shutdown()
  except Exception as e:  # pylint: disable=broad-except
    error = e
  if error is not None:
    logging.error("A StreamingTrainer closed without close() had failed after its last "
                  "step returned (%s: %s); its host state may be half-updated.",
                  type(error).__name__, error)
