"""One micro-batch through the streaming engine: forward, head, backward.

  forward   embed, then every block through its template, keeping the block input
            every `checkpoint_every` layers, or with recompute "dots"/"none" every
            layer's input and residuals (`engine.residuals`), on the device or sent
            to host memory with activations="host" (`engine.activations`); the
            prefetcher moves the next units to the device while the current one
            computes;
  head      final norm + LM head + chunked CE, value and gradient in one call; the
            MoE layers' router stats give the load-balancing loss and the
            gradient each router's probabilities get from it; with a fused tail
            (`Schedule.fused_tail`) the last layer runs in that call, forward and
            backward, its parameters kept from the forward's fetch;
  backward  blocks in reverse groups: recompute the group's inputs from its
            checkpoint (one brought back from host memory a group ahead), then
            `jax.vjp` layer by layer (each backward template recomputes its
            layer's forward, or with kept residuals only what they leave out); a
            group's parameters are fetched once and held until its backward ends;
  gradients each unit's gradient goes to the pipeline as soon as it exists, in the
            schedule's `grad_order` (the embedding's before layer 0's).
So each unit crosses host -> device at most twice per micro-batch (a fused tail's
layer once) and its gradient crosses device -> host once. Every device buffer the
step holds is counted in the runtime's ledger under the kinds `memory.step_plan`
models.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from megatrain_jax.engine.device.activations import tree_bytes
from megatrain_jax.engine.plan.memory import StepPlan
from megatrain_jax.engine.nonfinite import StepGuard
from megatrain_jax.engine.runtime import Runtime
from megatrain_jax.engine.plan.schedule import Schedule
from megatrain_jax.engine.device.templates import Templates
from megatrain_jax.models import moe
from megatrain_jax.engine.plan import sizes


def micro_step(rt: Runtime, tpl: Templates, schedule: Schedule, batch: dict[str, Any],
               scale: jax.Array, guard: StepGuard, last: bool, start_next: bool,
               host_checkpoints: bool = False) -> tuple[jax.Array, int]:
  """Forward, head and backward of one micro-batch; its gradients go to the pipeline.

  Args:
    rt: the runtime (prefetcher, pipeline, ledger, resident units).
    tpl: the templates.
    schedule: this batch shape's schedule (its fetch order and slot limits).
    batch: the micro-batch, host arrays.
    scale: 1 / the whole batch's mask sum (seeds the head's vjp).
    guard: the step's guard (its loss parts are appended here).
    last: the step's last micro-batch (per-unit updates run on its gradients).
    start_next: queue the next step's fetches behind this micro-batch's, so the
      link keeps working through the step's tail.
    host_checkpoints: the checkpoints wait in host memory (all but the last
      `schedule.device_checkpoints` groups').

  Returns:
    (this micro-batch's loss sum as a device scalar, input bytes moved).
  """
  ledger, tp, pf = rt.ledger, rt.transport, rt.prefetcher
  ids = tp.to_device(batch["input_ids"])
  labels = tp.to_device(batch["labels"])
  mask = tp.to_device(batch["loss_mask"])
  extra = {k: tp.to_device(batch[k]) for k in ("positions", "segment_ids") if k in batch}
  if start_next:
    start_fetches(pf, schedule, guard.step + 1)

  def get(u: int):
    if u in rt.schedule.resident_units():
      rt.await_update(u, guard.step)  # then read the copy its update made
      return rt.store.resident(u), None
    return pf.get(u)

  def release(key, token):
    if key is not None:
      pf.release(key, token)

  def send(u, g, finite):
    rt.pipeline.send(u, g, finite, last, guard)

  p, key = get(schedule.embed)
  x = tpl.embed_fwd(p, ids)
  release(key, x)
  act_bytes = x.nbytes
  ckpts, starts, router = {}, {s for s, _ in schedule.groups}, []
  offload = rt.activations if host_checkpoints else None
  sent = set(schedule.host_groups()) if offload is not None else set()
  keep = tpl.recompute != "full"  # every layer keeps its residuals (groups of one)
  pool = rt.pool if sizes.pools_buffers(
      tpl.recompute, "host" if host_checkpoints else "device", rt.platform) else None

  def checkpoint(i, saved):
    if i in sent:
      offload.put(i, saved)  # counted in the ledger until it has left the device
    else:
      ckpts[i] = saved
      ledger.add(("ckpt", i), tree_bytes(saved))

  fused = schedule.fused_tail
  held = None  # a fused tail's layer: (its parameters, key), held for the head
  for i in range(schedule.n_layers):
    if i in starts and not keep:
      checkpoint(i, x)
    p, key = get(1 + i)
    if fused and i == schedule.n_layers - 1:
      held, p = (p, key), None
      ledger.add("x", act_bytes)
      break
    if keep:
      y, stats, kept = tpl.block_fwd_keep(p, x, i, **extra, reuse=_reuse(tpl, pool, p, x, i, extra))
      checkpoint(i, (x, kept))
      x = kept = None
    else:
      y, stats = tpl.block_fwd(p, x, i, **extra)
    x = y
    if stats is not None:
      router.append(stats)
    ledger.add("x", act_bytes)
    release(key, x)
  p = y = None  # a released buffer must not stay alive through the backward
  aux_sum, g_probs = _load_balancing(tpl.cfg, router, ids.size, scale)

  if offload is not None:
    offload.flush()  # a failed copy out is raised before any gradient leaves
  p_h, key_h = get(schedule.head)
  p_e, key_e = get(schedule.embed) if schedule.tied else (None, None)
  if held is not None:
    loss_sum, g, g_h, g_e, finite, g_last, finite_last = tpl.tail(
        held[0], p_h, p_e, x, labels, mask, scale, **extra)
    release(held[1], g)
    held = None
    ledger.add(("grad", schedule.n_layers), g_last.nbytes)  # made with the head's
  else:
    loss_sum, g, g_h, g_e, finite = tpl.head(p_h, p_e, x, labels, mask, scale)
  release(key_h, g)
  release(key_e, g)
  p_h = p_e = x = None
  ledger.add("g", act_bytes)
  loss_sum = loss_sum + aux_sum
  guard.loss_parts.append(loss_sum)  # before any gradient: updates wait for it
  if g_e is not None:
    ledger.add("tied_embedding_grad", g_e.nbytes)
  ledger.add(("grad", schedule.head), g_h.nbytes)
  send(schedule.head, g_h, finite)

  layer0 = None
  backward = list(reversed(schedule.groups))
  if fused:  # the last layer's backward ran in the tail: its gradient leaves now
    s = backward.pop(0)[0]
    if offload is not None and backward:
      offload.prefetch(backward[0][0])
    ckpts.pop(s, None)
    ledger.remove(("ckpt", s))
    if s:
      send(1 + s, g_last, finite_last)
    else:
      layer0 = (g_last, finite_last)
    g_last = None
  for gi, (s, e) in enumerate(backward):
    if offload is not None and gi + 1 < len(backward):
      offload.prefetch(backward[gi + 1][0])  # the next group's input, while this one runs
    params = [get(1 + i) for i in range(s, e)]
    xs = [ckpts.pop(s) if s in ckpts else offload.take(s)]
    for j in range(e - s - 1):
      xs.append(tpl.block_fwd(params[j][0], xs[-1], s + j, **extra)[0])
      ledger.add(("recompute", j), act_bytes)
    for j in reversed(range(e - s)):
      if keep:
        (x_in, kept), xs[j] = xs[j], None
        g, g_p, finite = tpl.block_bwd_kept(params[j][0], x_in, kept, g, s + j, g_probs,
                                            **extra)
        if pool is not None:  # the next forward of these shapes writes into them
          ledger.remove(("ckpt", s))
          pool.give((x_in, *kept))
        x_in = kept = None
      else:
        g, g_p, finite = tpl.block_bwd(params[j][0], xs[j], g, s + j, g_probs, **extra)
      release(params[j][1], g)
      params[j], xs[j] = None, None  # released: nothing keeps them alive
      ledger.add(("grad", 1 + s + j), g_p.nbytes)
      if s + j:
        send(1 + s + j, g_p, finite)
      else:
        layer0 = (g_p, finite)  # held until the embedding's gradient has left
      ledger.remove(("recompute", j))
    ledger.remove(("ckpt", s))
    params = xs = None
  g_embed, finite = tpl.embed_bwd(ids, g, g_e)
  ledger.remove("x")
  ledger.remove("g")
  ledger.remove("tied_embedding_grad")
  # The embedding's gradient leaves before layer 0's: the next forward needs it first.
  ledger.add(("grad", schedule.embed), g_embed.nbytes)
  send(schedule.embed, g_embed, finite)
  if layer0 is not None:
    send(1, *layer0)
  pf.job_done()  # no activation is left: the next job may use its start buffers
  return loss_sum, sum(v.nbytes for v in batch.values())


def start_fetches(pf, schedule: Schedule, step: int) -> None:
  """Queues one micro-batch's fetches for `step` in the schedule's order, under its
  slot limits (start buffers, a fused tail's needs).

  Args:
    pf: the `Prefetcher`.
    schedule: the micro-batch's schedule.
    step: the step the fetches are for.
  """
  pf.start(schedule.fetch_order, step, schedule.limit, schedule.start_positions,
           schedule.tail_needs)


def _reuse(tpl: Templates, pool, p, x, layer: int, extra: dict) -> tuple | None:
  """Buffers for `block_fwd_keep` to write into: the pool's, or new ones when it has
  none of these shapes (the first step), so that the template has one signature."""
  if pool is None:
    return None
  shapes = tpl.kept_shapes(p, x, layer, **extra)
  return pool.take(shapes) or tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)


def _load_balancing(cfg, router: list, tokens: int, scale: jax.Array
                    ) -> tuple[jax.Array, jax.Array | None]:
  """The load-balancing loss, in the units of a loss sum (times 1 / scale), and the
  gradient every MoE layer's router-probability sum gets from it."""
  if not router or not cfg.router_aux_loss_coef:
    return jnp.float32(0.0), None
  stats, rows = moe.total_stats(router), len(router) * tokens
  aux = cfg.router_aux_loss_coef * moe.aux_loss(cfg, stats, rows)
  return aux / scale, moe.aux_grad(cfg, stats.picks, rows)


def sweep(rt: Runtime, tpl: Templates, plan: StepPlan, batch: dict[str, Any], total: float,
          guard: StepGuard, grad_accum: int, update: bool, started: bool
          ) -> tuple[float, int]:
  """Every micro-batch's forward and backward; the gradients go to the pipeline.

  Args:
    rt: the runtime.
    tpl: the templates.
    plan: this batch shape's plan.
    batch: the whole batch, host arrays.
    total: the batch's mask sum.
    guard: the step's guard.
    grad_accum: micro-batches.
    update: this step updates (its last micro-batch's gradients are applied, and the
      next step's fetches start behind it).
    started: the first micro-batch's fetches were started by the step before.

  Returns:
    (the batch's mean loss, input bytes moved).
  """
  b = batch["input_ids"].shape[0]
  scale, sums, input_bytes = jnp.float32(1.0 / total), [], 0
  rt.last_plan = plan
  for m in range(grad_accum):
    if not (m == 0 and started):
      start_fetches(rt.prefetcher, plan.schedule, guard.step)
    last = update and m == grad_accum - 1
    micro = {k: v[m * b // grad_accum:(m + 1) * b // grad_accum] for k, v in batch.items()}
    loss_sum, nbytes = micro_step(rt, tpl, plan.schedule, micro, scale, guard, last,
                                  start_next=last,
                                  host_checkpoints=plan.activations == "host")
    sums.append(loss_sum)
    input_bytes += nbytes
  return float(sum(float(s) for s in sums)) / total, input_bytes
