"""What a streaming run holds in host and device memory, by kind, before it is built.

Everything here is arithmetic over the model's unit shapes (`jax.eval_shape`, no
allocation), so a launcher can refuse a run that cannot fit before it spends
anything. The device side is one model, `step_plan`: it replays a micro-batch's
`Schedule` the way the trainer runs it and returns the most bytes the engine's
ledger can hold at once (`stats()["device_peak_bytes"]` never exceeds it; a test
checks this). The trainer's budget check, the preflight and the planner all call it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from megatrain_jax.engine.plan import sizes, workspace
from megatrain_jax.engine.config import MAX_PENDING_GRADIENTS, EngineConfig
from megatrain_jax.engine.platform import accelerator_bytes, on_cpu_backend
from megatrain_jax.engine.host.probe import resolve_for_config, trained_units
from megatrain_jax.engine.plan.schedule import Schedule
from megatrain_jax.engine.plan.step_plan import StepPlan, largest_fitting
from megatrain_jax.models import trainable as trainable_lib
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.loss import default_chunk_tokens

GiB = 2**30


# -- host ---------------------------------------------------------------------------

def _state_bytes(cfg: LlamaConfig, optimizer, trains=None) -> list[int]:
  """Optimizer-state bytes of each unit (traced once per distinct structure), of the
  parameters that train (`trains`: per unit, each leaf's flag; None: all)."""
  if trains is not None:
    return [sizes.nbytes(jax.eval_shape(optimizer.init, t))
            for t in trained_units(cfg, trains)]
  by_tree: dict[int, int] = {}
  out = []
  for t in sizes.unit_trees(cfg):
    if id(t) not in by_tree:
      by_tree[id(t)] = sizes.nbytes(jax.eval_shape(optimizer.init, t))
    out.append(by_tree[id(t)])
  return out


def _trained_sizes(cfg: LlamaConfig, flags) -> list[int]:
  """Each unit's elements that train (`flags` from `leaf_flags`; None: all)."""
  if flags is None:
    return list(sizes.unit_sizes(cfg))
  return [sum(x.size for x, f in zip(jax.tree.leaves(t), fl) if f)
          for t, fl in zip(sizes.unit_trees(cfg), flags)]


def leaf_flags(cfg: LlamaConfig, trainable) -> tuple[tuple[bool, ...], ...] | None:
  """Per unit, whether each parameter leaf trains (in `jax.tree` order).

  Args:
    cfg: the model.
    trainable: as the trainers' `trainable=` (None: everything trains).

  Returns:
    The flags, or None when everything trains.
  """
  masks = trainable_lib.unit_masks(cfg, trainable)
  return None if masks is None else tuple(tuple(jax.tree.leaves(m)) for m in masks)


def disk_state_bytes(cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                     ec: EngineConfig, trainable=None) -> int:
  """Bytes of the state files of a run with `state_tier="disk"`: each unit's master
  and optimizer state (the files' page padding apart).

  Args:
    cfg: the model.
    optimizer: the transform the engine runs.
    ec: the engine config.
    trainable: as the trainers' `trainable=`.

  Returns:
    The bytes.
  """
  flags = leaf_flags(cfg, trainable)
  r = resolve_for_config(optimizer, cfg, ec.optimizer_mode, flags)
  return 4 * sum(_trained_sizes(cfg, flags)) + sum(_state_bytes(cfg, r.optimizer, flags))


def snapshot_copy_bytes(cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                        ec: EngineConfig, max_copies: int = 1, trainable=None) -> int:
  """The most bytes the updates copy for a checkpoint writer still at work.

  Args:
    cfg: the model.
    optimizer: the transform the engine runs.
    ec: the engine config.
    max_copies: units an update may copy ahead of the writer (`snapshot(max_copies)`).
    trainable: as `host_bytes` (frozen values are never copied: they never change).

  Returns:
    `max_copies` x the largest unit's master and optimizer state. (The writer holds
    one more unit while it writes it, counted in `host_bytes` as checkpoint_copies.)
  """
  flags = leaf_flags(cfg, trainable)
  r = resolve_for_config(optimizer, cfg, ec.optimizer_mode, flags)
  mode, inner = r.mode, r.optimizer
  counts, states = _trained_sizes(cfg, flags), _state_bytes(cfg, inner, flags)
  if mode == "whole_tree":  # units hold masters; the state is one more part
    largest = max(4 * max(counts), sum(states))
  else:
    largest = max(4 * n + s for n, s in zip(counts, states))
  return max_copies * largest


def host_bytes(cfg: LlamaConfig, optimizer: optax.GradientTransformation,
               ec: EngineConfig, on_cpu: bool | None = None, batch_size: int | None = None,
               seq_len: int | None = None, trainable=None) -> dict[str, int]:
  """Host bytes of a streaming run by kind, and their total.

  Args:
    cfg: the model.
    optimizer: the transform the engine runs.
    ec: the engine config.
    on_cpu: whether the run is on the CPU backend (default: this process's backend).
    batch_size: sequences per step; with `seq_len`, the activation checkpoints
      sent to host memory are counted too.
    seq_len: tokens per sequence.
    trainable: which parameters train, as the trainers' `trainable=` (None: all).

  Returns:
    masters: fp32 parameters that train. frozen_params: the others, in
    `EngineConfig.frozen_dtype` (present when some are frozen). optimizer_state: the transform's state (from
    `optimizer.init` traced on the unit shapes). With `state_tier="disk"` (unless the
    transform is whole-tree) both are 0, and state_in_flight and read_buffers are
    the units' state in RAM at once and the store's read buffers, in pieces with the
    fused AdamW, else in whole units (`sizes.disk_state_in_ram`).
    gradient_buffers: fp32 accumulators of the whole model when updates wait for the
    sweep or grad_accum > 1, plus the gradients queued between the threads.
    pinned_copies: the compute-dtype copy of every unit plus one being replaced,
    where they are kept (`keeps_stream_copy`); with `stream_copy="disk"` instead
    copy_buffers: a unit's copy read for a fetch and staged, and one made by an
    update and written (4 of the largest). checkpoint_copies: what a save
    adds while training goes on (`snapshot_copy_bytes`, plus the unit the writer
    holds). activation_checkpoints (with a batch shape): those `step_plan` sends
    to host memory. total.
  """
  counts = sizes.unit_sizes(cfg)
  n = sum(counts)
  flags = leaf_flags(cfg, trainable)
  trained = _trained_sizes(cfg, flags)
  nt = sum(trained)
  cd = jnp.dtype(ec.compute_dtype).itemsize
  r = resolve_for_config(optimizer, cfg, ec.optimizer_mode, flags)
  states = _state_bytes(cfg, r.optimizer, flags)
  deferred = r.deferred or ec.nonfinite == "skip"
  queued = (2 * MAX_PENDING_GRADIENTS + 1) * 4 * max(trained)
  copies = snapshot_copy_bytes(cfg, optimizer, ec, trainable=trainable)
  out = {
      "masters": 4 * nt,
      "optimizer_state": sum(states),
      "gradient_buffers": (4 * nt if deferred or ec.grad_accum > 1 else 0) + queued,
      "pinned_copies": cd * (n + max(counts)) if sizes.keeps_stream_copy(ec, on_cpu) else 0,
      "checkpoint_copies": 2 * copies,
  }
  if ec.state_tier == "disk" and r.mode != "whole_tree":
    # On disk; in RAM only the units read ahead, in an update, and written behind.
    out["masters"] = out["optimizer_state"] = 0
    out["state_in_flight"], out["read_buffers"] = sizes.disk_state_in_ram(
        ec, trained, states, r.kind.pieces)
  if ec.stream_copy == "disk":
    out["copy_buffers"] = 4 * cd * max(counts)
  if nt < n:
    out["frozen_params"] = (n - nt) * jnp.dtype(ec.frozen_dtype_name).itemsize
  if batch_size is not None:
    out["activation_checkpoints"] = step_plan(cfg, ec, batch_size,
                                              seq_len).host_checkpoint_bytes
  out["total"] = sum(out.values())
  return out


# -- device -------------------------------------------------------------------------

def step_plan(cfg: LlamaConfig, ec: EngineConfig, batch_size: int,
              seq_len: int, platform: str | None = None, deferred: bool | None = None,
              trains: tuple[int, ...] | None = None, packed: bool | None = None
              ) -> StepPlan:
  """The schedule, operations and device peak of a step on batches [batch_size, seq_len].

  The peak is the largest total of the ledger over `step_plan.SIMULATED_STEPS` steps of the
  step's program from a trainer just built, under the modelled timing
  (`plan.simulate`: fetches as early as the slot rules allow, gradients and sent
  checkpoints leaving as late as the step allows). XLA's scratch inside one call
  (e.g. a chunk of logits) is not in it. With activations in host memory and
  `device_checkpoints=None`, the last groups' inputs stay on the device as far as
  the peak with only the last one kept allows. Extra start buffers
  (`EngineConfig.step_start_buffers`) are granted to as many of a micro-batch's
  first fetches as keep the peak where it is without them, and turn buffers
  (`EngineConfig.turn_buffers`) likewise to the first fetches of its backward; both
  only with prefetch (`prefetch_depth` > 0). `activations="auto"` is resolved by
  `resolve_activations` against the budget or the accelerator. On the CPU backend,
  with recompute "dots" or "none" and the checkpoints on the device, every layer's
  buffers stay on the device between steps (`pool.BufferPool`).

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step (split into `ec.grad_accum` micro-batches).
    seq_len: tokens per sequence.
    platform: the JAX platform the step runs on (None: this process's).
    deferred: updates wait for the whole sweep (a transform that needs the whole
      tree); None: only with `nonfinite="skip"`.
    trains: each unit's elements that train, a frozen unit 0 (None: all of them).
    packed: the batches carry packed-document ids, which can change what a layer
      keeps (None: the larger of both).

  Returns:
    The `StepPlan`.
  """
  # The transport does not change the bytes; leaving it out of the cache key keeps
  # no transport alive.
  ec = dataclasses.replace(ec, transport=None)
  if ec.activations == "auto":
    ec = dataclasses.replace(ec, activations=_auto(cfg, ec, batch_size, seq_len))
  # The platform is asked for only where it decides, so that a launcher counting
  # pinned bytes before `jax.distributed.initialize` starts no backend.
  pooled = sizes.pools_buffers(ec.recompute, ec.activations, "cpu") and (
      platform or ("cpu" if on_cpu_backend() else "gpu")) == "cpu"
  deferred = ec.nonfinite == "skip" if deferred is None else deferred or ec.nonfinite == "skip"
  return _step_plan(cfg, ec, batch_size, seq_len, pooled, deferred,
                    None if trains is None else tuple(trains),
                    None if ec.recompute == "full" else packed)


def resolve_activations(cfg: LlamaConfig, ec: EngineConfig, batch_size: int, seq_len: int,
                        limit: int | None = None, platform: str | None = None) -> str:
  """Where `ec.activations` puts the checkpoints for this shape: "device" or "host".

  "auto" is "host" when the step with its checkpoints on the device (`device_bytes`)
  would pass `limit`; and "device" when it fits or there is no limit.

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    limit: the device bytes available (default: the budget, else the accelerator's).
    platform: as `device_bytes`.

  Returns:
    "device" or "host".
  """
  if ec.activations != "auto":
    return ec.activations
  limit = limit or ec.device_budget_bytes or accelerator_bytes()
  if limit is None:
    return "device"
  on_device = dataclasses.replace(ec, activations="device", transport=None)
  need = device_bytes(cfg, on_device, batch_size, seq_len, platform)["total"]
  return "device" if need <= limit else "host"


@functools.lru_cache(maxsize=512)
def _auto(cfg, ec, batch_size, seq_len) -> str:
  return resolve_activations(cfg, ec, batch_size, seq_len)


@functools.lru_cache(maxsize=512)
def _step_plan(cfg, ec, batch_size, seq_len, pooled, deferred, trains, packed) -> StepPlan:
  b = sizes.step_bytes(cfg, ec, batch_size, seq_len, trains, packed)
  base = StepPlan(Schedule.build(cfg, ec), {}, ec.activations, 0, b, ec.prefetch_depth,
                  ec.grad_accum, deferred, ec.recompute != "full", pooled, trains,
                  sizes.layer_structures(cfg))
  with_schedule = lambda **kw: dataclasses.replace(
      base, schedule=dataclasses.replace(base.schedule, **kw))
  total = lambda plan: plan.simulate().peak["total"]
  peak = total(base)
  if ec.activations == "host" and ec.device_checkpoints is None:
    # Keep on the device the most last groups' inputs that leave the peak as it is
    # with only the last one kept: each one kept is a checkpoint the link does not
    # carry twice. (The peak grows with the number kept, so bisect.)
    kept = largest_fitting(lambda k: total(with_schedule(device_checkpoints=k)) <= peak,
                           1, len(base.schedule.groups))
    base = with_schedule(device_checkpoints=kept)
  forward = sum(1 for u in base.schedule.fetch_order[:cfg.n_layers + 1]
                if u not in base.schedule.resident_units())
  # Without prefetch (depth 0) every fetch waits for the previous unit's compute:
  # a start buffer would let the forward's fetches run one unit ahead.
  base = base.with_extra_buffers(peak, ec.step_start_buffers if ec.prefetch_depth else 0,
                                 "start", forward)
  # Likewise at the turn: the head's call holds its buffers while the backward's
  # first units wait for one, and no gradient is in flight yet.
  base = base.with_extra_buffers(peak, ec.turn_buffers if ec.prefetch_depth else 0, "turn",
                                 len(base.schedule.fetch_order) - base.schedule.turn_start)
  host_ckpts = sum(b.ckpt[g] for g in base.sent_groups)
  return dataclasses.replace(base, peak=base.simulate().peak, host_checkpoint_bytes=host_ckpts)


def device_bytes(cfg: LlamaConfig, ec: EngineConfig, batch_size: int,
                 seq_len: int, platform: str | None = None,
                 deferred: bool | None = None, plan: StepPlan | None = None
                 ) -> dict[str, int]:
  """Device bytes of a step on batches of this shape, by kind, and their total:
  the ledger's peak (`step_plan`) plus one chunk of fp32 logits with its gradient,
  which lives inside the head's call, and one layer's backward scratch
  (`workspace.workspace_bytes`).

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    platform: the platform the attention kernel is chosen for (None: this
      process's).
    deferred: as `step_plan`.
    plan: the shape's `StepPlan`, when the caller has it (a trainer's own: its
      frozen units, its batches' packing).

  Returns:
    Bytes by kind and "total".
  """
  plan = plan or step_plan(cfg, ec, batch_size, seq_len, platform, deferred)
  out = {k: v for k, v in plan.peak.items() if k != "total"}
  b = batch_size // ec.grad_accum
  chunk = ec.loss_chunk_tokens or default_chunk_tokens(cfg.vocab_size, b * seq_len)
  out["logits_chunk"] = 2 * min(chunk, b * seq_len) * cfg.vocab_size * 4
  out["workspace"] = workspace.workspace_bytes(cfg, ec, batch_size, seq_len, platform)
  out["total"] = sum(out.values())
  return out


def static_device_bytes(cfg: LlamaConfig, ec: EngineConfig) -> int:
  """Device bytes any batch needs, before a single activation.

  Args:
    cfg: the model.
    ec: the engine config.

  Returns:
    The parameter buffers in flight (slots, or what a fused tail holds where
    that is more, x the largest streamed unit) plus the resident units.
  """
  sched = Schedule.build(cfg, ec)
  unit = sizes.unit_param_bytes(cfg, ec)
  streamed = [unit[u] for u in sched.fetch_order] or [0]
  buffers = max(sched.slots, *sched.tail_needs.values(), 0)
  return buffers * max(streamed) + sum(unit[u] for u in sched.resident_units())


def resident_device_bytes(cfg: LlamaConfig, optimizer: optax.GradientTransformation
                          ) -> dict[str, int]:
  """Device bytes of `ResidentTrainer`'s state.

  Args:
    cfg: the model.
    optimizer: its transform.

  Returns:
    fp32 parameters, gradients and optimizer state by kind, and "total"
    (activations are not counted).
  """
  n = sum(sizes.unit_sizes(cfg))
  out = {"params": 4 * n, "gradients": 4 * n,
         "optimizer_state": sum(_state_bytes(cfg, optimizer))}
  out["total"] = sum(out.values())
  return out


# -- this machine's limits ------------------------------------------------------------
