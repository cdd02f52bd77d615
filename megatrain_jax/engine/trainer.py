"""StreamingTrainer: host-resident state, one unit on the accelerator at a time.

A facade over the engine's parts (docs/engine.md has the map): it builds them,
runs a step through `step.micro_step`, applies the non-finite policy, and offers
the state interface checkpoints use. The threads live in a `Runtime`, which the
facade's finalizer shuts down if it is dropped without `close()`.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from megatrain_jax.engine import memory, nonfinite
from megatrain_jax.engine.build import build, host_units
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.host_optimizer import HostOptimizer
from megatrain_jax.engine.runtime import shutdown_quietly
from megatrain_jax.engine.state import Snapshot
from megatrain_jax.engine.step import micro_step
from megatrain_jax.engine.transport import Transport
from megatrain_jax.models import llama
from megatrain_jax.models.batch import check_batch
from megatrain_jax.models.config import LlamaConfig

GradHook = Callable[[int, jax.Array], jax.Array]


class StreamingTrainer:
  """Trains a Llama-family model whose parameters and optimizer state live on the host.

  Build it from an NNX model, or unit by unit on the host (`from_config`, or
  `megatrain_jax.hf.streaming_trainer` for a checkpoint). `close()` or a `with`
  block stops its threads and raises a failure found after the last step returned.
  """

  def __init__(self, model: llama.Llama, optimizer: optax.GradientTransformation,
               config: EngineConfig | None = None, *, grad_hook: GradHook | None = None):
    """Copies `model`'s parameters into the host store.

    Args:
      model: the NNX model (not modified).
      optimizer: any Optax transform (see `EngineConfig.optimizer_mode`).
      config: the engine config (default `EngineConfig()`).
      grad_hook: `hook(unit, gradient) -> gradient` on each device gradient before it
        leaves the device (inspection, fault injection); its result is checked for
        finiteness again.

    Raises:
      ValueError: a config the device budget cannot hold, or optimizer_mode="per_unit"
        for a transform that needs the whole tree.
    """
    units = [model.embed.tree(), *(b.tree() for b in model.blocks), model.head.tree()]
    self._setup(model.cfg, optimizer, config or EngineConfig(), units, grad_hook)

  @classmethod
  def from_units(cls, cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                 config: EngineConfig | None, unit_trees: Iterable[Any], *,
                 grad_hook: GradHook | None = None) -> "StreamingTrainer":
    """A trainer over unit trees (embed, each block, head) produced one at a time, so
    the whole model never exists at once; args as `__init__`."""
    self = cls.__new__(cls)
    self._setup(cfg, optimizer, config or EngineConfig(), unit_trees, grad_hook)
    return self

  @classmethod
  def from_config(cls, cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                  config: EngineConfig | None = None, key: jax.Array | None = None, *,
                  grad_hook: GradHook | None = None) -> "StreamingTrainer":
    """Initialises every unit on the host CPU backend, one at a time. With the same
    key the parameters equal `Llama(cfg, rngs=nnx.Rngs(params=key))`.

    Raises:
      ValueError: no key (PRNG keys are passed explicitly), or as `__init__`.
    """
    if key is None:
      raise ValueError("from_config needs an explicit PRNG key, e.g. jax.random.key(0).")
    return cls.from_units(cfg, optimizer, config, host_units(cfg, key),
                          grad_hook=grad_hook)

  def _setup(self, cfg, optimizer, ec: EngineConfig, unit_trees, grad_hook) -> None:
    self.cfg, self.config = cfg, ec
    self.schedule, self.templates, self._rt = build(cfg, optimizer, ec, unit_trees, grad_hook)
    self._finalizer = weakref.finalize(self, shutdown_quietly, self._rt)
    self._steps = self._skipped = self._h2d = self._peak = 0
    self._last: dict[str, float] = {}
    self._late = nonfinite.StepGuard(step=0)  # the last step; its updates may run on
    self._error: BaseException | None = None
    self._closed = False
    self._next_started: memory.StepPlan | None = None  # the plan fetched ahead for

  # -- the step -------------------------------------------------------------------

  def step(self, batch: dict[str, Any]) -> dict[str, Any]:
    """One optimizer step; returns {"loss", "tokens", "step_time_s"} (+ "skipped").

    The step returns once its backward is dispatched and its first update has
    decided: the last units' updates finish while the next step starts (each
    unit's next fetch waits for its own). A NaN or infinite loss or gradient
    skips the step (`nonfinite="skip"`) or raises FloatingPointError naming the
    step and the first unit found; docs/reliability.md says what state that
    leaves. An error found after the step returned is raised by the next call.
    """
    batch, total, plan = self._prepare(batch)
    rt, t0 = self._rt, time.perf_counter()
    before = (rt.pipeline.d2h_bytes, rt.prefetcher.busy_s, rt.pipeline.d2h_s,
              rt.pipeline.opt_s)
    rt.ledger.reset_peak()
    guard = nonfinite.StepGuard(step=self._steps + 1, prev=None if rt.defer else self._late)
    try:
      loss = guard.loss = self._sweep(batch, total, plan, guard, update=True)
      t_compute = time.perf_counter()
      if rt.defer:
        rt.pipeline.wait()
        bad = nonfinite.find_nonfinite(loss, rt.host_opt.nonfinite_units(),
                                       self.schedule.grad_order)
        if bad is None:  # on the optimizer thread, while the next step starts
          rt.pipeline.update_all(guard.step)
        else:
          rt.clock.mark(range(self.schedule.n_units), guard.step)
      else:
        bad = nonfinite.first_verdict(guard, loss, rt.pipeline, self.config.timeout_s)
      rt.prefetcher.drain()
    except BaseException as e:
      self._fail(e)
      raise
    t_end = time.perf_counter()
    self._steps += 1
    h2d = rt.prefetcher.bytes_for.pop(guard.step, 0) + rt.store.take_resident_h2d_bytes()
    self._h2d += h2d + self._input_bytes
    self._peak = max(self._peak, rt.ledger.peak)
    self._last = {"step_time_s": t_end - t0, "wait_optimizer_s": t_end - t_compute,
                  "h2d_s": rt.prefetcher.busy_s - before[1],
                  "d2h_s": rt.pipeline.d2h_s - before[2],
                  "host_opt_s": rt.pipeline.opt_s - before[3],
                  "h2d_bytes": h2d + self._input_bytes,
                  "d2h_bytes": rt.pipeline.d2h_bytes - before[0],
                  "device_peak_bytes": rt.ledger.peak}
    out = {"loss": loss, "tokens": total, "step_time_s": t_end - t0}
    if bad is not None:
      self._nonfinite_step(bad, guard)
      out["skipped"] = True
    self._late = guard
    return out

  def _prepare(self, batch):
    self._check_usable()
    batch = check_batch(self.cfg, batch)
    b, t = batch["input_ids"].shape
    if b % self.config.grad_accum:
      raise ValueError(f"Batch size {b} is not divisible by grad_accum="
                       f"{self.config.grad_accum}.")
    total = float(batch["loss_mask"].sum())
    if total <= 0:
      raise ValueError("The batch's loss_mask is all zero: no token to train on.")
    budget = self.config.device_budget_bytes
    need = memory.device_bytes(self.cfg, self.config, b, t)
    if budget is not None and need["total"] > budget:
      raise memory.device_budget_error(f"A step on batch [{b}, {t}]", need, budget, 2**20)
    return batch, total, memory.step_plan(self.cfg, self.config, b, t)

  def _sweep(self, batch, total: float, plan, guard, update: bool) -> float:
    """Every micro-batch's forward and backward; the gradients go to the pipeline."""
    rt = self._rt
    rt.pipeline.check()  # a failure after the last step returned
    self._check_late()
    if self._next_started is not None and self._next_started != plan:
      self._cancel_prefetch()  # fetched ahead for another batch shape
    n, b = self.config.grad_accum, batch["input_ids"].shape[0]
    scale, sums, self._input_bytes = jnp.float32(1.0 / total), [], 0
    for m in range(n):
      if not (m == 0 and self._next_started is not None):
        rt.prefetcher.start(plan.schedule.fetch_order, guard.step, plan.schedule.limit)
      last = update and m == n - 1
      micro = {k: v[m * b // n:(m + 1) * b // n] for k, v in batch.items()}
      loss_sum, nbytes = micro_step(rt, self.templates, plan.schedule, micro, scale,
                                    guard, last, start_next=last)
      self._next_started = plan if last else None
      sums.append(loss_sum)
      self._input_bytes += nbytes
    return float(sum(float(s) for s in sums)) / total

  def _nonfinite_step(self, bad, guard) -> None:
    """Skips the step (counted) or raises, as `config.nonfinite` says."""
    self._rt.pipeline.drop_gradients()
    if bad[0] == "previous":
      self._check_late()  # the step before went bad after it returned
    guard.bad, guard.reported = bad, True
    if self.config.nonfinite == "skip":
      self._skipped += 1
      logging.warning("%s; step skipped (%d skipped so far), no parameter changed.",
                      nonfinite.describe(guard, self.schedule.unit_name), self._skipped)
      return
    err = nonfinite.error(guard, self.schedule.unit_name)
    if guard.updated:
      self._fail(err)
      raise err
    self._steps -= 1  # nothing was applied
    self._cancel_prefetch()  # the caller may change the state before the next try
    raise err

  def _check_late(self) -> None:
    """Raises a non-finite gradient the last step's updates found after it returned."""
    if self._late.late_error_pending:
      self._late.reported = True
      err = nonfinite.error(self._late, self.schedule.unit_name, late=True)
      self._fail(err)
      raise err

  def loss_and_grads(self, batch: dict[str, Any]):
    """(loss, gradient tree of numpy fp32) at the current parameters; no update."""
    batch, total, plan = self._prepare(batch)
    guard = nonfinite.StepGuard(step=self._steps + 1)
    try:
      loss = self._sweep(batch, total, plan, guard, update=False)
      self._rt.pipeline.wait()
      self._rt.prefetcher.drain()
      self._h2d += self._rt.prefetcher.bytes_for.pop(guard.step, 0) + self._input_bytes
    except BaseException as e:
      self._fail(e)
      raise
    host_opt = self._rt.host_opt
    grads = [s.unflatten(host_opt.gradient(u)) for u, s in enumerate(host_opt.specs)]
    self._rt.pipeline.drop_gradients()
    return loss, llama.assemble_units(grads)

  # -- failure and shutdown --------------------------------------------------------

  def _check_usable(self) -> None:
    if self._error is not None:
      raise RuntimeError(
          "This StreamingTrainer is invalid after an earlier failure "
          f"({type(self._error).__name__}: {self._error}); its host state may be "
          "half-updated. Restore a checkpoint into it (`restore`), build a new trainer "
          "or resume from the last checkpoint.")
    if self._closed:
      raise RuntimeError("This StreamingTrainer is closed.")

  def _fail(self, e: BaseException) -> None:
    """Marks the trainer invalid and stops its threads."""
    self._error = e
    if isinstance(e, Exception) and not isinstance(e, FloatingPointError):
      e.add_note("The StreamingTrainer failed during a step; its host state may be "
                 "half-updated, so it is now invalid: resume from the last checkpoint.")
    self._rt.shutdown()

  def _cancel_prefetch(self) -> None:
    """Drops fetches started for the next step (the state changes outside a step)."""
    if self._next_started is not None and self._rt.open:
      self._rt.prefetcher.cancel()
    self._next_started = None

  def wait(self) -> None:
    """Blocks until the last step's updates are done; raises a failure or non-finite
    gradient they met (RuntimeError once the trainer is invalid)."""
    self._check_usable()
    try:
      self._rt.pipeline.wait()
    except BaseException as e:
      self._fail(e)
      raise
    self._check_late()

  def close(self) -> None:
    """Lets the last updates finish, stops the threads and frees the device buffers.

    Raises:
      The failure (or FloatingPointError) the last step's updates met after it
      returned, if not reported yet; the trainer is then invalid.
    """
    if self._closed:
      return
    self._closed = True
    self._finalizer.detach()
    error = self._rt.shutdown()
    if error is None and self._late.late_error_pending:
      self._late.reported = True
      error = nonfinite.error(self._late, self.schedule.unit_name, late=True)
    if error is not None and self._error is None:
      self._error = error
      raise error

  def __enter__(self) -> "StreamingTrainer":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    try:  # never hide the exception leaving the `with` block
      self.close()
    except BaseException as e:  # pylint: disable=broad-except
      logging.error("Closing the StreamingTrainer also failed: %s: %s", type(e).__name__, e)

  # -- state -------------------------------------------------------------------------

  @property
  def step_count(self) -> int:
    """Steps taken (skipped ones included), restored from a checkpoint."""
    return self._steps

  @property
  def n_units(self) -> int:
    """Units of the model (embedding, blocks, head)."""
    return self.schedule.n_units

  @property
  def host_optimizer(self) -> HostOptimizer:
    """The host store: masters, optimizer state and their parts."""
    return self._rt.host_opt

  @property
  def transport(self) -> Transport:
    """How this trainer moves bytes."""
    return self._rt.transport

  def _settled(self) -> None:
    """Valid, with the last step's updates done (nothing to wait for once closed)."""
    if self._error is not None:
      self._check_usable()
    if not self._closed:
      self.wait()

  def params(self) -> dict[str, Any]:
    """The fp32 master parameters as a tree of numpy arrays (same as the model's)."""
    return llama.assemble_units([self.unit_params(u) for u in range(self.n_units)])

  def unit_params(self, u: int) -> dict[str, Any]:
    """Unit u's fp32 master parameters as a tree of numpy arrays (a copy)."""
    self._settled()
    return self._rt.host_opt.specs[u].unflatten(self._rt.host_opt.master(u))

  def state_layout(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """What `snapshot` holds: for each part, the (shape, dtype) of its arrays."""
    self._settled()
    host_opt = self._rt.host_opt
    return {key: host_opt.state_layout(name)
            for name, key in zip(host_opt.state_names(), self._rt.state_keys())}

  def snapshot(self, max_copies: int = 1) -> Snapshot:
    """The host state at this step boundary, for a writer to read part by part while
    training goes on (see `engine/state.py`: an update copies at most `max_copies`
    parts ahead of the writer, then waits for it). Parts come in the order the next
    updates change them; the writer closes the snapshot when done."""
    self._settled()
    host_opt, rt = self._rt.host_opt, self._rt
    key_of = dict(zip(host_opt.state_names(), rt.state_keys()))
    name_of = {k: n for n, k in key_of.items()}
    order = [key_of[u] for u in self.schedule.update_order(rt.defer)]
    order += [k for k in rt.state_keys() if k not in order]
    return rt.snapshot(order, lambda key: host_opt.copy_state(name_of[key]), max_copies)

  def restore(self, read: Callable[[str], dict[str, np.ndarray]], step_count: int) -> None:
    """Loads every part of `state_layout()` from `read(key)`, one unit at a time; the
    caller checked the layout. A trainer invalid after a failure is revived once
    every part is loaded. If `read` fails partway the trainer is invalid.

    Raises:
      RuntimeError: the trainer is closed.
    """
    if self._closed:
      raise RuntimeError("This StreamingTrainer is closed; build a new one to restore into.")
    rt, revive = self._rt, self._error is not None
    if not revive:
      self.wait()
      self._cancel_prefetch()
    try:
      for name, key in zip(rt.host_opt.state_names(), rt.state_keys()):
        rt.host_opt.load_state(name, read(key))
    except BaseException as e:
      self._error = self._error or e
      rt.shutdown()
      raise
    rt.host_opt.drop_gradients()
    self._steps = int(step_count)
    rt.clock.reset(self._steps)
    if revive:
      rt.start()
      self._error, self._next_started = None, None
      self._late = nonfinite.StepGuard(step=self._steps)
    for u in range(self.n_units):
      rt.store.master_changed(u)

  def unit_on_device(self, u: int) -> jax.Array:
    """Unit u's compute-dtype copy on the device, made as a fetch makes it (for
    profiling the templates alone; it is not counted in the ledger)."""
    self._settled()
    return self._rt.store.to_device(u)

  def estimate_device_bytes(self, batch_size: int, seq_len: int) -> dict[str, int]:
    """Device bytes for batches of this shape, by kind (`memory.device_bytes`)."""
    return memory.device_bytes(self.cfg, self.config, batch_size, seq_len)

  def stats(self) -> dict[str, Any]:
    """Counters since construction, plus the last step's bytes and phase times."""
    rt, host_opt = self._rt, self._rt.host_opt
    return {
        "steps": self._steps, "skipped_steps": self._skipped, "h2d_bytes": self._h2d,
        "d2h_bytes": rt.pipeline.d2h_bytes, "device_peak_bytes": self._peak,
        "device_bytes": rt.ledger.current, "compiles": self.templates.compiles,
        "last_step": dict(self._last), "param_count": sum(s.size for s in host_opt.specs),
        "layer_bytes": memory.unit_param_bytes(self.cfg, self.config)[1],
        "stream_bytes": rt.store.stream_bytes(), "prefetch_slots": self.schedule.slots,
        "optimizer_mode": host_opt.mode, "fused_optimizer": host_opt.fused,
        "host_update_parts": max(len(p) for p in host_opt.parts),
        "stream_copy": "keep" if rt.store.keep_copy else "on_fetch",
        "out_of_order_fetches": rt.prefetcher.out_of_order,
        "start_buffer_fetches": rt.prefetcher.start_buffer_fetches,
        "snapshot_copy_bytes": rt.copies.current,
        "snapshot_copy_peak_bytes": rt.copies.peak}
