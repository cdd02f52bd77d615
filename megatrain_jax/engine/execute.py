"""Runs a step's operations (`plan.program`) on the trainer's thread.

Each operation has one executor method here: it calls the templates, the
prefetcher, the gradient pipeline or the activations' thread, and applies the
operation's ledger effects with the bytes of the arrays it made (`Ledger.apply`).
What the operations are, in which order, and what each adds to or frees from
device memory lives in `plan.program`; this module only carries it out. The
per-micro-batch state the operations hand each other (the running activation and
gradient, the checkpoints, the buffers taken, the gradients not yet sent) lives in
a `Micro`, made fresh for every micro-batch.

So each unit crosses host -> device at most twice per micro-batch (a fused tail's
layer once) and its gradient crosses device -> host once.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine.device.templates import Templates
from megatrain_jax.engine.nonfinite import Bad, StepGuard
from megatrain_jax.engine.plan import ops
from megatrain_jax.engine.plan import program as P
from megatrain_jax.engine.plan.memory import StepPlan
from megatrain_jax.engine.runtime import Runtime
from megatrain_jax.models import lora, moe
from megatrain_jax.models.policy import POLICY_KEYS

OpHook = Callable[[ops.Op], None]


@dataclasses.dataclass
class Micro:
  """What one micro-batch's operations hand each other."""
  batch: dict[str, Any]  # its device inputs
  extra: dict[str, Any]  # positions and segment ids, if packed; LoRA dropout's keys
  buffers: dict[int, tuple] = dataclasses.field(default_factory=dict)  # position -> (array, key)
  unit_at: dict[int, int] = dataclasses.field(default_factory=dict)  # unit -> its last position
  x: Any = None  # the running activation
  g: Any = None  # the running gradient
  g_e: Any = None  # the head's gradient for a tied embedding
  token: Any = None  # the last array computed (a released buffer is free once it is)
  x_in: Any = None  # the last forward's input, when it keeps residuals
  kept: Any = None  # the last forward's kept residuals
  ckpts: dict[int, Any] = dataclasses.field(default_factory=dict)
  xs: list = dataclasses.field(default_factory=list)  # a group's inputs in its backward
  router: list = dataclasses.field(default_factory=list)
  g_probs: Any = None
  grads: dict[int, tuple] = dataclasses.field(default_factory=dict)  # unit -> (grad, its sumsq)
  loss: Any = None


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What a step's run gives the trainer.

  Attributes:
    loss: the batch's mean loss.
    input_bytes: the bytes of the batch moved to the device.
    bad: what went bad (`nonfinite`), or None.
    t_sweep: when the last micro-batch's backward was dispatched.
    metric_sums: a policy loss's metrics, summed over the masked tokens.
    logprobs: with `logprobs=True`, each label's log-probability (this process's
      rows, float32 [B, T]); else None.
  """
  loss: float
  input_bytes: int
  bad: Bad | None
  t_sweep: float
  metric_sums: dict[str, float]
  logprobs: np.ndarray | None = None


class Executor:
  """Carries out a step's program with a trainer's runtime and templates."""

  def __init__(self, rt: Runtime, tpl: Templates, on_op: OpHook | None = None):
    """Ties the executor to its parts.

    Args:
      rt: the runtime.
      tpl: the templates.
      on_op: `on_op(op)` is called on this thread before each operation runs.
    """
    self.rt, self.tpl, self.on_op = rt, tpl, on_op
    # One method per operation kind of `plan.ops`, named after it: a kind without one
    # fails here.
    self._run = {cls: getattr(self, "_" + cls.__name__) for cls in ops.Op.__subclasses__()
                 if cls.__module__ == ops.__name__}

  def run(self, plan: StepPlan, prog: P.StepProgram, batch: dict[str, Any], total: float,
          guard: StepGuard, key: jax.Array | None = None, logprobs: bool = False
          ) -> Outcome:
    """Runs every operation of a step.

    Args:
      plan: the batch shape's plan (its byte rules name the ledger's keys).
      prog: the step's operations.
      batch: the whole batch, host arrays.
      total: the loss's normalizer over the global batch (cross-entropy: its mask sum).
      guard: the step's guard.
      key: the step's LoRA dropout key (None: no dropout).
      logprobs: the head gives each label's log-probability (a forward-only
        program's `HeadLoss`) instead of the loss.

    Returns:
      The `Outcome`.
    """
    self.plan, self.prog, self.guard = plan, prog, guard
    self.want_logprobs, self.metric_parts, self.logprob_parts = logprobs, [], []
    self.scale = jnp.float32(1.0 / total)
    self.total, self.sums, self.input_bytes = total, [], 0
    self.bad, self.loss, self.t_sweep = None, float("nan"), None
    self.last_m = prog.grad_accum - 1
    self.updates = any(isinstance(op, ops.Settle) and op.update for op in prog.ops)
    rows, self.micro, self.m = batch["input_ids"].shape[0], None, -1
    self.rt.last_plan = plan
    try:
      for op in prog.ops:
        if op.m != self.m and op.m < prog.grad_accum:
          self.m = op.m
          lo, hi = op.m * rows // prog.grad_accum, (op.m + 1) * rows // prog.grad_accum
          # Rows of the global batch: each process holds a contiguous block of it.
          self.micro = self._inputs({k: v[lo:hi] for k, v in batch.items()}, key,
                                    lo + jax.process_index() * rows)
        if self.on_op is not None:
          self.on_op(op)
        self._run[type(op)](op)
      metric_sums = {k: float(sum(part[k] for part in self.metric_parts))
                     for k in (self.metric_parts[0] if self.metric_parts else {})}
      lp = (np.concatenate([_local_rows(a) for a in self.logprob_parts])
            if logprobs else None)
      return Outcome(self.loss, self.input_bytes, self.bad, self.t_sweep, metric_sums, lp)
    finally:  # no device array of the step stays alive here, whatever happened
      self.micro, self.sums, self.guard = None, [], None
      self.metric_parts, self.logprob_parts = [], []

  def _inputs(self, micro: dict[str, Any], key, row0: int) -> Micro:
    to = self.rt.transport.to_device
    self.input_bytes += sum(v.nbytes for v in micro.values())
    extra = {k: to(micro[k]) for k in ("positions", "segment_ids") if k in micro}
    lc = self.tpl.cfg.lora
    if key is not None and lc is not None and lc.dropout:  # masks by global batch row
      rows = np.arange(row0, row0 + micro["input_ids"].shape[0])
      extra["dropout_keys"] = to(np.asarray(lora.sequence_keys(key, rows)))
    keys = ("input_ids", "labels", "loss_mask", *(POLICY_KEYS if self.tpl.policy else ()))
    return Micro({k: to(micro[k]) for k in keys if k in micro}, extra)

  def _apply(self, op: ops.Op, *arrays) -> None:
    self.rt.ledger.apply(op.effects(self.plan.bytes), arrays)

  def _param(self, u: int):
    return self.micro.buffers[self.micro.unit_at[u]][0]

  # -- fetches -----------------------------------------------------------------

  def _StartFetches(self, op: ops.StartFetches) -> None:
    s = self.prog.schedule
    self.rt.prefetcher.start(s.fetch_order, self.guard.step + op.ahead, s.limit,
                             s.start_positions, s.tail_needs)

  def _Take(self, op: ops.Take) -> None:
    self.micro.buffers[op.position] = self.rt.prefetcher.get(op.unit)
    self.micro.unit_at[op.unit] = op.position

  def _UseResident(self, op: ops.UseResident) -> None:
    self.rt.await_update(op.unit, self.guard.step)  # then read the copy its update made
    self.micro.buffers[-1 - op.unit] = (self.rt.store.resident(op.unit), None)
    self.micro.unit_at[op.unit] = -1 - op.unit

  def _Release(self, op: ops.Release) -> None:
    _, key = self.micro.buffers.pop(op.position)
    self.rt.prefetcher.release(key, self.micro.token)

  def _JobDone(self, op: ops.JobDone) -> None:
    self.rt.prefetcher.job_done()  # no activation is left: later jobs may use start buffers

  # -- forward -----------------------------------------------------------------

  def _EmbedForward(self, op: ops.EmbedForward) -> None:
    mb = self.micro
    mb.x = mb.token = self.tpl.embed_fwd(self._param(0), mb.batch["input_ids"])
    self._apply(op, mb.x)

  def _Checkpoint(self, op: ops.Checkpoint) -> None:
    mb = self.micro
    saved = (mb.x_in, mb.kept) if mb.kept is not None else mb.x
    mb.x_in = mb.kept = None
    if op.host:
      self.rt.activations.flush()  # the one before has left: at most one is leaving
    self._apply(op, saved)
    if op.host:
      self.rt.activations.put(("ckpt", op.m, op.group), saved)  # freed once it has left
    else:
      mb.ckpts[op.group] = saved

  def _BlockForward(self, op: ops.BlockForward) -> None:
    mb, p = self.micro, self._param(1 + op.layer)
    if op.keep:
      reuse = self._reuse(p, op.layer) if op.pooled else None
      mb.x_in = mb.x
      y, stats, mb.kept = self.tpl.block_fwd_keep(p, mb.x, op.layer, **mb.extra, reuse=reuse)
    else:
      y, stats = self.tpl.block_fwd(p, mb.x, op.layer, **mb.extra)
    mb.x = mb.token = y
    if stats is not None:
      mb.router.append(stats)

  def _reuse(self, p, layer: int) -> tuple:
    """Buffers for a forward to write its output and residuals into: the pool's, or
    new ones when it has none of these shapes (the first step), so that the template
    has one signature."""
    mb = self.micro
    shapes = self.tpl.kept_shapes(p, mb.x, layer, **mb.extra)
    return self.rt.pool.take(shapes) or tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)

  def _Flush(self, op: ops.Flush) -> None:
    self.rt.activations.flush()  # a failed copy out is raised before any gradient leaves

  def _Head(self, op: ops.Head) -> None:
    mb, tpl = self.micro, self.tpl
    aux, mb.g_probs = _load_balancing(tpl.cfg, mb.router, mb.batch["input_ids"].size,
                                      self.scale)
    mb.router = []
    labels, mask, rows = mb.batch["labels"], mb.batch["loss_mask"], self._rows()
    p_h = self._param(op.head)
    p_e = self._param(0) if op.tied else None
    made = []
    if op.last_layer is not None:
      loss_sum, g, g_h, g_e, finite, g_last, finite_last, metrics = tpl.tail(
          self._param(op.last_layer), p_h, p_e, mb.x, labels, mask, self.scale, rows,
          **mb.extra)
      mb.grads[op.last_layer] = (g_last, finite_last)
      made = [g_last] if op.last_trains else []
    else:
      loss_sum, g, g_h, g_e, finite, metrics = tpl.head(p_h, p_e, mb.x, labels, mask,
                                                        self.scale, rows)
    self.metric_parts.append(metrics)
    mb.g = mb.token = g
    mb.g_e = g_e
    mb.grads[op.head] = (g_h, finite)
    self._apply(op, g, *([g_e] if op.tied else []), g_h, *made)
    mb.loss = loss_sum + aux
    self.guard.loss_parts.append(mb.loss)  # before any gradient: updates wait for it
    self.sums.append(mb.loss)

  def _rows(self) -> dict[str, Any]:
    """The policy loss's per-token inputs of this micro-batch ({} for cross-entropy)."""
    return {k: v for k, v in self.micro.batch.items() if k in POLICY_KEYS}

  def _HeadLoss(self, op: ops.HeadLoss) -> None:
    mb, tpl = self.micro, self.tpl
    mb.router = []  # an evaluation's loss is the model's alone
    p_h, p_e = self._param(op.head), self._param(0) if op.tied else None
    if self.want_logprobs:
      out = tpl.head_logprobs(p_h, p_e, mb.x, mb.batch["labels"])
      self.logprob_parts.append(out)
    else:
      out, metrics = tpl.head_loss(p_h, p_e, mb.x, mb.batch["labels"],
                                   mb.batch["loss_mask"], self._rows())
      self.metric_parts.append(metrics)
      self.sums.append(out)
    mb.x = mb.token = out
    self._apply(op)

  def _SendGradient(self, op: ops.SendGradient) -> None:
    g, finite = self.micro.grads.pop(op.unit)
    self.rt.pipeline.send(("grad", op.m, op.unit), op.unit, g, finite,
                          self.updates and op.m == self.last_m, self.guard)

  # -- backward ----------------------------------------------------------------

  def _Reload(self, op: ops.Reload) -> None:
    self.rt.activations.prefetch(("ckpt", op.m, op.group))  # while this group computes

  def _Restore(self, op: ops.Restore) -> None:
    mb = self.micro
    saved = (self.rt.activations.take(("ckpt", op.m, op.group)) if op.host
             else mb.ckpts.pop(op.group))
    mb.xs = [saved]

  def _Recompute(self, op: ops.Recompute) -> None:
    mb = self.micro
    x = self.tpl.block_fwd(self._param(1 + op.layer), mb.xs[-1], op.layer, **mb.extra)[0]
    mb.xs.append(x)
    self._apply(op, x)

  def _BlockBackward(self, op: ops.BlockBackward) -> None:
    mb, p = self.micro, self._param(1 + op.layer)
    saved, mb.xs[op.j] = mb.xs[op.j], None
    if op.kept:
      x_in, kept = saved
      mb.g, g_p, finite = self.tpl.block_bwd_kept(p, x_in, kept, mb.g, op.layer, mb.g_probs,
                                                  **mb.extra)
    else:
      mb.g, g_p, finite = self.tpl.block_bwd(p, saved, mb.g, op.layer, mb.g_probs,
                                             **mb.extra)
    mb.token = mb.g
    mb.grads[1 + op.layer] = (g_p, finite)
    self._apply(op, *([g_p] if op.trains else []))
    if op.pooled:  # the next forward of these shapes writes into them
      self.rt.pool.give((saved[0], *saved[1]))

  def _DropCheckpoint(self, op: ops.DropCheckpoint) -> None:
    self.micro.ckpts.pop(op.group, None)
    self._apply(op)

  def _EmbedBackward(self, op: ops.EmbedBackward) -> None:
    mb, made = self.micro, []
    if op.trains:  # a frozen embedding needs no gradient: the backward ends here
      g_embed, finite = self.tpl.embed_bwd(mb.batch["input_ids"], mb.g, mb.g_e)
      mb.grads[0], made = (g_embed, finite), [g_embed]
    mb.x = mb.g = mb.g_e = None
    self._apply(op, *made)

  # -- the step's end ----------------------------------------------------------

  def _Settle(self, op: ops.Settle) -> None:
    self.t_sweep = time.perf_counter()
    self.micro = None  # nothing of the last micro-batch stays alive
    self.loss = float(sum(float(s) for s in self.sums)) / self.total
    self.guard.loss = self.loss
    if op.update:
      self.bad = self.rt.settle(self.guard, self.loss)
    else:
      self.rt.pipeline.wait()

  def _Drain(self, op: ops.Drain) -> None:
    self.rt.prefetcher.drain()


def _load_balancing(cfg, router: list, tokens: int, scale: jax.Array
                    ) -> tuple[jax.Array, jax.Array | None]:
  """The load-balancing loss, in the units of a loss sum (times 1 / scale), and the
  gradient every MoE layer's router-probability sum gets from it."""
  if not router or not cfg.router_aux_loss_coef:
    return jnp.float32(0.0), None
  stats, rows = moe.total_stats(router), len(router) * tokens
  aux = cfg.router_aux_loss_coef * moe.aux_loss(cfg, stats, rows)
  return aux / scale, moe.aux_grad(cfg, stats.picks, rows)


def _local_rows(a: jax.Array) -> np.ndarray:
  """This process's rows of a batch-sharded array, in order."""
  if a.is_fully_addressable:
    return np.asarray(a)
  shards = {s.index[0].start or 0: s for s in a.addressable_shards}  # replicas once
  return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])
