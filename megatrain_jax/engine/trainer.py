"""StreamingTrainer: host-resident state, one unit on the accelerator at a time.

A facade over the engine's parts (docs/engine.md has the map): it builds them, runs a
step's program through the `Executor`, applies the non-finite policy, and offers the
state interface checkpoints use. Its `Runtime` holds the threads (shut down by a
finalizer if the trainer is dropped without `close()`).
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Iterable

import jax
import numpy as np
import optax
from absl import logging

from megatrain_jax.engine import nonfinite
from megatrain_jax.engine.plan import memory, preflight, sizes
from megatrain_jax.engine.build import build, host_units
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.health import Health
from megatrain_jax.engine.runtime import shutdown_quietly
from megatrain_jax.engine.execute import Executor, OpHook, Outcome
from megatrain_jax.engine.host.norms import LateNorm, StepNorm
from megatrain_jax.engine.trainer_state import TrainerState
from megatrain_jax.models import llama, lora
from megatrain_jax.models import trainable as trainable_lib
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.policy import POLICY_KEYS, PolicyLoss, token_means

GradHook = Callable[[int, jax.Array], jax.Array]


class StreamingTrainer(TrainerState):
  """Trains a Llama-family model whose parameters and optimizer state live on the host.

  Build it from an NNX model, or unit by unit on the host (`from_config`, or
  `megatrain_jax.hf.streaming_trainer` for a checkpoint). `close()` or a `with`
  block stops its threads and raises a failure found after the last step returned.
  """

  def __init__(self, model: llama.Llama, optimizer: optax.GradientTransformation,
               config: EngineConfig | None = None, *, trainable: trainable_lib.Filter = None,
               grad_hook: GradHook | None = None, on_op: OpHook | None = None,
               loss: PolicyLoss | None = None):
    """Copies `model`'s parameters into the host store.

    Args:
      model: the NNX model (not modified).
      optimizer: any Optax transform (see `EngineConfig.optimizer_mode`).
      config: the engine config (default `EngineConfig()`).
      trainable: which parameters train: an NNX filter or a predicate over parameter
        paths (`models.trainable`; None: every `nnx.Param`). The others keep their
        values, in `EngineConfig.frozen_dtype`, with no gradient sent to the host.
      grad_hook: `hook(unit, gradient) -> gradient` on each device gradient before it
        leaves the device (inspection, fault injection); its result is checked for
        finiteness again.
      on_op: `on_op(op)` before each operation of a step (`plan.program`), on the
        step's thread: tracing, profiling, or pacing the engine in a test.
      loss: what the head minimizes: None for masked cross-entropy, or a
        policy-gradient loss (`mt.rl.PolicyLoss`), whose batches add its keys.

    Raises:
      ValueError: a config the device budget cannot hold, optimizer_mode="per_unit"
        for a transform that needs the whole tree, or a `trainable` that selects
        nothing.
    """
    units = [model.embed.tree(), *(b.tree() for b in model.blocks), model.head.tree()]
    self._setup(model.cfg, optimizer, config, units, trainable_lib.unit_masks(
        model, trainable), grad_hook, on_op, loss)

  @classmethod
  def from_units(cls, cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                 config: EngineConfig | None, unit_trees: Iterable[Any], *,
                 trainable: trainable_lib.Filter = None, **hooks) -> "StreamingTrainer":
    """A trainer over unit trees produced one at a time (the whole model never exists).

    Args:
      cfg: the model.
      optimizer: any Optax transform.
      config: the engine config (None: `EngineConfig()`).
      unit_trees: embed, each block, head (numpy or host arrays), consumed lazily.
      trainable: as `__init__` (NNX filters see the variable types of `Llama(cfg)`).
      **hooks: `grad_hook`, `on_op` and `loss`, as `__init__`.

    Returns:
      The trainer.
    """
    self = cls.__new__(cls)
    self._setup(cfg, optimizer, config, unit_trees, trainable_lib.unit_masks(cfg, trainable),
                **hooks)
    return self

  @classmethod
  def from_config(cls, cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                  config: EngineConfig | None = None, key: jax.Array | None = None,
                  **options) -> "StreamingTrainer":
    """Initialises every unit on the host CPU backend, one at a time.

    Args:
      cfg: the model.
      optimizer: any Optax transform.
      config: the engine config (None: `EngineConfig()`).
      key: the PRNG key; with the same key the parameters equal
        `Llama(cfg, rngs=nnx.Rngs(params=key))`'s.
      **options: `trainable`, `grad_hook`, `on_op` and `loss`, as `__init__`.

    Returns:
      The trainer.

    Raises:
      ValueError: no key (PRNG keys are passed explicitly), or as `__init__`.
    """
    if key is None:
      raise ValueError("from_config needs an explicit PRNG key, e.g. jax.random.key(0).")
    return cls.from_units(cfg, optimizer, config, host_units(cfg, key), **options)

  def _setup(self, cfg, optimizer, ec, unit_trees, masks, grad_hook=None, on_op=None,
             loss=None):
    self.cfg, self.config, self._loss = cfg, ec or EngineConfig(), loss
    self.schedule, self.templates, self._rt = build(cfg, optimizer, self.config, unit_trees,
                                                    grad_hook, masks, loss)
    self._executor = Executor(self._rt, self.templates, on_op)
    self._base: Executor | None = None  # LoRA's base alone (`logprobs(adapters=False)`)
    self._finalizer = weakref.finalize(self, shutdown_quietly, self._rt)
    self._health = Health(self._rt, self.schedule.unit_name)
    self._steps = 0
    self._next_started: memory.StepPlan | None = None  # the plan fetched ahead for

  def step(self, batch: dict[str, Any], key: jax.Array | None = None) -> dict[str, Any]:
    """One optimizer step.

    It returns once its backward is dispatched and its first update has decided: the
    last units' updates finish while the next step starts (each unit's next fetch
    waits for its own). An error found after it returned is raised by the next call.

    Args:
      batch: {"input_ids", "labels", "loss_mask"}, each [B, T].
      key: the step's PRNG key for LoRA dropout: the global batch's sequence r draws
        its masks from `fold_in(key, r)`, as in `ResidentTrainer`.

    Returns:
      {"loss", "tokens", "step_time_s", "grad_norm"}, and "skipped": True for a
      non-finite step skipped under `nonfinite="skip"` (its grad_norm NaN); a
      policy loss adds its metrics ("clip_fraction", "entropy", "kl": means over
      the masked tokens). "tokens" is the mask's sum.
      "grad_norm" is the global norm of the gradient, before any clip, summed from
      each unit's as its update applies it: a `LateNorm`, whose `float()` waits for
      the step's last updates.

    Raises:
      FloatingPointError: a NaN or infinite loss or gradient (`nonfinite="raise"`),
        naming the step and the first unit found; docs/reliability.md says what
        state that leaves.
      ValueError: a bad batch, or one over the device budget, or LoRA dropout
        without a key.
      RuntimeError: the trainer is invalid or closed.
    """
    batch, total, tokens, plan = self._prepare(batch, key)
    rt, t0, before = self._rt, time.perf_counter(), self._rt.start_step()
    guard = nonfinite.StepGuard(step=self._steps + 1,
                                prev=None if rt.defer else self._health.late,
                                norm=StepNorm(rt.trained_units, self.config.timeout_s))
    try:
      run = self._sweep(batch, total, plan, guard, update=True, key=key)
    except BaseException as e:
      self._health.fail(e)
      raise
    t_end = time.perf_counter()
    self._steps += 1
    rt.end_step(guard.step, before, run.input_bytes, t0, run.t_sweep, t_end)
    out = {"loss": run.loss, "tokens": tokens, "step_time_s": t_end - t0,
           "grad_norm": LateNorm(guard.norm), **token_means(run.metric_sums, tokens)}
    if run.bad is not None:
      rt.pipeline.drop_gradients()
      err = self._health.bad_step(run.bad, guard, skip=self.config.nonfinite == "skip")
      if err is not None:
        if not guard.updated:  # nothing was applied: the caller may fix it and retry
          self._steps -= 1
          rt.clock.reset(self._steps)  # the refused units are not as of this step
          self._cancel_prefetch()
        raise err
      out["skipped"], out["grad_norm"] = True, float("nan")
    self._health.late = guard
    return out

  def evaluate(self, batch: dict[str, Any]) -> dict[str, float]:
    """The loss at the current parameters from a forward-only streamed pass: no
    gradient, no update, nothing of the state changes (`ResidentTrainer.evaluate`).

    Args:
      batch: as `step` (an evaluation applies no LoRA dropout).

    Returns:
      {"loss": the batch's loss (cross-entropy's: the mean over the masked
      tokens), without an MoE model's load-balancing loss; "tokens": the masked
      tokens' count}, and a policy loss's metrics as `step` gives them.

    Raises:
      ValueError: a bad batch, or one over the device budget.
      RuntimeError: the trainer is invalid or closed.
      FloatingPointError: the last step's late updates found a bad value.
    """
    batch, total, tokens, plan = self._prepare(batch, trains=False)
    run = self._forward(batch, total, plan, logprobs=False)
    return {"loss": run.loss, "tokens": tokens, **token_means(run.metric_sums, tokens)}

  def logprobs(self, batch: dict[str, Any], adapters: bool = True) -> np.ndarray:
    """Each label's log-probability at the current parameters, from a forward-only
    streamed pass (`evaluate`'s): no gradient, no update, nothing changes.

    Args:
      batch: as `step` (a policy loss's keys may be absent).
      adapters: False leaves LoRA adapters out: the frozen base's log-probs, a
        policy's reference at no extra memory.

    Returns:
      float32 [B, T] (this process's rows): log softmax(logits)[label].

    Raises:
      As `evaluate`.
    """
    batch, total, _, plan = self._prepare(batch, need_policy_keys=False, trains=False)
    base = not adapters and self.cfg.lora is not None
    if base and self._base is None:
      self._base = Executor(self._rt, self.templates.without_adapters())
    return self._forward(batch, total, plan, True, self._base if base else None).logprobs

  def _forward(self, batch, total, plan, logprobs: bool, executor=None) -> Outcome:
    self._cancel_prefetch()  # fetched ahead for the next step, in a step's order
    guard = nonfinite.StepGuard(step=self._steps + 1)
    try:
      self._rt.pipeline.check()
      self._health.check_late()
      run = (executor or self._executor).run(plan, plan.eval_program(), batch, total, guard,
                                             logprobs=logprobs)
      self._rt.count_fetches(guard.step, run.input_bytes)
    except BaseException as e:
      self._health.fail(e)
      raise
    # The last step's late updates are all done now (the pass fetched every unit): a
    # bad value they found means the pass saw half-updated parameters.
    self._rt.pipeline.check()
    self._health.check_late()
    return run

  def _prepare(self, batch, key=None, need_policy_keys: bool = True, trains: bool = True):
    self._health.check_usable()
    if trains:  # a forward-only pass applies no dropout
      lora.check_key(self.cfg.lora, key)
    if not need_policy_keys and isinstance(batch, dict):  # log-probs read neither the
      batch = {k: v for k, v in batch.items() if k not in POLICY_KEYS}  # policy keys
      if "input_ids" in batch:  # nor the mask: any mask, all zero included, will do
        batch["loss_mask"] = np.ones(np.shape(batch["input_ids"]), np.float32)
    return preflight.check_step(self.cfg, self.config, batch, self._rt.transport.global_sum,
                                deferred=self._rt.defer, trains=self._rt.trains,
                                policy=self._loss if need_policy_keys else None)

  def _sweep(self, batch, total: float, plan, guard, update: bool, key=None) -> Outcome:
    self._rt.pipeline.check()  # a failure after the last step returned
    self._health.check_late()
    if self._next_started is not None and self._next_started != plan:
      self._cancel_prefetch()  # fetched ahead for another batch shape
    started, self._next_started = self._next_started is not None, None
    run = self._executor.run(plan, plan.program(update, started), batch, total, guard, key)
    self._next_started = plan if update else None
    return run

  def loss_and_grads(self, batch: dict[str, Any], key: jax.Array | None = None):
    """The loss and gradient at the current parameters; no update.

    Args:
      batch: as `step`.
      key: as `step`.

    Returns:
      (loss, the gradient as a tree of fp32 numpy arrays, the model's layout).

    Raises:
      What a failed sweep met; the trainer is then invalid.
    """
    batch, total, _, plan = self._prepare(batch, key)
    guard = nonfinite.StepGuard(step=self._steps + 1)
    try:
      run = self._sweep(batch, total, plan, guard, update=False, key=key)
      self._rt.count_fetches(guard.step, run.input_bytes)
    except BaseException as e:
      self._health.fail(e)
      raise
    return run.loss, llama.assemble_units(self._rt.take_gradients())

  def _cancel_prefetch(self) -> None:
    """Drops fetches started for the next step (the state changes outside a step)."""
    if self._next_started is not None and self._rt.open:
      try:
        self._rt.prefetcher.cancel()
      except BaseException as e:
        self._health.fail(e)
        raise
    self._next_started = None

  loss = property(lambda self: self._loss, doc="The policy loss, or None: cross-entropy.")

  def wait(self) -> None:
    """Blocks until the last step's updates are done.

    Raises:
      The failure or FloatingPointError they met (the trainer is then invalid);
      RuntimeError when it already was, or is closed.
    """
    self._health.wait()

  def close(self) -> None:
    """Lets the last updates finish, stops the threads and frees the device buffers.

    Raises:
      The failure (or FloatingPointError) the last step's updates met after it
      returned, if not reported yet; the trainer is then invalid.
    """
    self._finalizer.detach()
    self._health.close()

  def __enter__(self) -> "StreamingTrainer":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      self.close()
    except BaseException as e:  # pylint: disable=broad-except
      if exc_type is None:
        raise
      # Never hide the exception leaving the `with` block.
      logging.error("Closing the StreamingTrainer also failed: %s: %s", type(e).__name__, e)

  def stats(self) -> dict[str, Any]:
    """Counters since construction, plus the last step's bytes and phase times.

    Returns:
      Counters by name (docs/engine.md lists each).
    """
    rt = self._rt.stats()
    layer_bytes = max(sizes.unit_param_bytes(self.cfg, self.config)[1:-1], default=0)
    return {"steps": self._steps, "skipped_steps": self._health.skipped,
            **self.templates.stats(rt["device_peak_bytes"]), **rt, "layer_bytes": layer_bytes}
