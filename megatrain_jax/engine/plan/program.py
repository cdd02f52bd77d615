"""A step as one ordered list of typed operations: what the trainer's thread does.

`step_program(schedule, ...)` turns a batch shape's `Schedule` into the operations
of one step, in the order the trainer's thread runs them: for each micro-batch its
fetches taken, the forward, the checkpoints kept or sent, the head, the backward
group by group, each gradient sent, each buffer released; then the step's verdict
and the end of its fetches. The executor (`engine.execute`) runs the list; the
simulation (`plan.simulate`) replays the same list to find the device peak; the
planner counts template calls, link bytes and recomputed layers from it.

Each operation says what it adds to and frees from device memory (`effects`), as
ledger keys with the bytes the byte rules give (`StepBytes`); the executor applies
the same effects with the bytes of the arrays it made. What other threads do
(fetches ahead, gradients leaving, checkpoints moving, buffers reclaimed) follows
from the operations that start it or wait for it (see `plan.simulate`).
"""

from __future__ import annotations

import dataclasses

from megatrain_jax.engine.plan.ops import (
    TEMPLATE_CALLS, BlockBackward, BlockForward, Checkpoint, Drain, DropCheckpoint,
    EmbedBackward, EmbedForward, Flush, Head, HeadLoss, JobDone, Op, Recompute, Release, Reload,
    Restore, SendGradient, Settle, StartFetches, Take, UseResident)
from megatrain_jax.engine.plan.schedule import Schedule


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """The operations of one step, and what they were made from.

  Attributes:
    ops: in the order the trainer's thread runs them.
    schedule: the batch shape's schedule.
    grad_accum: micro-batches.
  """
  ops: tuple[Op, ...]
  schedule: Schedule
  grad_accum: int

  def count(self, *types: type) -> int:
    """Operations of these types.

    Args:
      *types: operation classes.

    Returns:
      How many the step runs.
    """
    return sum(isinstance(op, types) for op in self.ops)

  def template_calls(self) -> int:
    """Jitted calls a step makes.

    Returns:
      Its operations that run a template.
    """
    return self.count(*TEMPLATE_CALLS)

  def fetched_units(self) -> list[int]:
    """Units a step fetches, once per fetch.

    Returns:
      The unit of every `Take`, in order.
    """
    return [op.unit for op in self.ops if isinstance(op, Take)]

  def sent_units(self) -> list[int]:
    """Units whose gradient a step sends to the host, once per micro-batch.

    Returns:
      The unit of every `SendGradient`, in order.
    """
    return [op.unit for op in self.ops if isinstance(op, SendGradient)]

  def reloads(self) -> int:
    """Checkpoints a step brings back from host memory (as many as it sends).

    Returns:
      The number of `Reload`s.
    """
    return self.count(Reload)


def micro_ops(s: Schedule, m: int, *, last: bool, started: bool, host_groups=(),
              keep: bool = False, pooled: bool = False, trains=None) -> list[Op]:
  """One micro-batch's operations.

  Args:
    s: the schedule.
    m: the micro-batch's index.
    last: it is the step's last and the step updates: the next step's fetches are
      queued behind its own.
    started: its fetches were queued already (by the step before).
    host_groups: groups whose input goes to host memory.
    keep: every layer keeps its residuals (recompute "dots" or "none").
    pooled: kept residuals reuse pooled buffers (`sizes.pools_buffers`).
    trains: `trains[u]`, whether unit u has a gradient (default: every unit).

  Returns:
    The operations, in order.
  """
  trains = trains or (True,) * s.n_units
  L, head = s.n_layers, s.head
  resident = set(s.resident_units())
  pos = iter(range(len(s.fetch_order)))
  ops: list[Op] = []
  if not started:
    ops.append(StartFetches(m))
  if last:
    ops.append(StartFetches(m, ahead=True))

  def take(u: int) -> Op | None:
    if u in resident:
      ops.append(UseResident(m, u))
      return None
    op = Take(m, u, next(pos))
    ops.append(op)
    return op

  def release(t: Op | None) -> None:
    if t is not None:
      ops.append(Release(m, t.unit, t.position))

  def send(u: int) -> None:
    if trains[u]:
      ops.append(SendGradient(m, u))

  starts = {a for a, _ in s.groups}
  sent = set(host_groups)
  t = take(s.embed)
  ops.append(EmbedForward(m))
  release(t)
  held = None
  for i in range(L):
    if s.fused_tail and i == L - 1:  # its input stays the running activation
      held = take(1 + i)
      break
    if i in starts and not keep:
      ops.append(Checkpoint(m, i, i, host=i in sent))
    t = take(1 + i)
    ops.append(BlockForward(m, i, keep=keep, pooled=pooled))
    if keep:
      ops.append(Checkpoint(m, i, i, host=i in sent))
    release(t)
  if sent:
    ops.append(Flush(m))
  t_head = take(head)
  t_embed = take(s.embed) if s.tied else None
  ops.append(Head(m, head, last_layer=L if held is not None else None, tied=s.tied,
                  last_trains=trains[L] if held is not None else True))
  release(held)
  release(t_head)
  release(t_embed)
  send(head)
  backward = list(reversed(s.groups))
  layer0 = False  # layer 0's gradient waits for the embedding's to leave first
  if held is not None:
    g, _ = backward.pop(0)
    if backward and backward[0][0] in sent:
      ops.append(Reload(m, backward[0][0]))
    if g:
      send(1 + g)
    else:
      layer0 = True
  for gi, (a, e) in enumerate(backward):
    if gi + 1 < len(backward) and backward[gi + 1][0] in sent:
      ops.append(Reload(m, backward[gi + 1][0]))
    taken = [take(1 + i) for i in range(a, e)]
    ops.append(Restore(m, a, host=a in sent))
    for j in range(e - a - 1):
      ops.append(Recompute(m, a + j, j))
    for j in reversed(range(e - a)):
      ops.append(BlockBackward(m, a + j, j, a, kept=keep, pooled=pooled,
                               trains=trains[1 + a + j]))
      release(taken[j])
      if a + j:
        send(1 + a + j)
      else:
        layer0 = True
    if not pooled:
      ops.append(DropCheckpoint(m, a))
  ops.append(EmbedBackward(m, trains=trains[0]))
  send(s.embed)
  if layer0:
    send(1)
  ops.append(JobDone(m))
  return ops


def step_program(s: Schedule, grad_accum: int, *, update: bool = True,
                 started: bool = True, deferred: bool = False, host_groups=(),
                 keep: bool = False, pooled: bool = False, trains=None) -> StepProgram:
  """Every operation of one step.

  Args:
    s: the batch shape's schedule.
    grad_accum: micro-batches.
    update: the step updates (else its gradients are only gathered on the host).
    started: its first micro-batch's fetches were queued by the step before.
    deferred: updates wait for the whole sweep (whole-tree or clipped transforms,
      or `nonfinite="skip"`).
    host_groups: groups whose input goes to host memory.
    keep: every layer keeps its residuals.
    pooled: kept residuals reuse pooled buffers.
    trains: `trains[u]`, whether unit u has a gradient (default: every unit).

  Returns:
    The `StepProgram`.
  """
  ops: list[Op] = []
  for m in range(grad_accum):
    ops += micro_ops(s, m, last=update and m == grad_accum - 1, started=started and m == 0,
                     host_groups=host_groups, keep=keep, pooled=pooled, trains=trains)
  ops += [Settle(grad_accum, update=update, deferred=deferred), Drain(grad_accum)]
  return StepProgram(tuple(ops), s, grad_accum)


def eval_program(s: Schedule, grad_accum: int) -> StepProgram:
  """The operations of a forward-only pass (an evaluation), in the step's
  micro-batches: each unit fetched once per micro-batch in forward order (a tied
  embedding again for the head), no checkpoint, no backward, no gradient, no update.

  Args:
    s: the batch shape's schedule.
    grad_accum: micro-batches.

  Returns:
    The `StepProgram`, whose schedule is `forward_schedule(s)`.
  """
  fwd = forward_schedule(s)
  resident = set(fwd.resident_units())
  ops: list[Op] = []
  for m in range(grad_accum):
    pos = iter(range(len(fwd.fetch_order)))
    ops.append(StartFetches(m))

    def take(u: int) -> Op | None:
      ops.append(UseResident(m, u) if u in resident else Take(m, u, next(pos)))
      return None if u in resident else ops[-1]

    def release(t: Op | None) -> None:
      if t is not None:
        ops.append(Release(m, t.unit, t.position))

    t = take(s.embed)
    ops.append(EmbedForward(m))
    release(t)
    for i in range(s.n_layers):
      t = take(1 + i)
      ops.append(BlockForward(m, i))
      release(t)
    held = [take(s.head)] + ([take(s.embed)] if s.tied else [])
    ops.append(HeadLoss(m, s.head, tied=s.tied))
    for t in held:
      release(t)
    ops.append(JobDone(m))
  ops += [Settle(grad_accum, update=False), Drain(grad_accum)]
  return StepProgram(tuple(ops), fwd, grad_accum)


def forward_schedule(s: Schedule) -> Schedule:
  """A schedule's forward alone: the units an evaluation fetches, in its order.

  Args:
    s: the step's schedule.

  Returns:
    The same schedule with `fetch_order` cut to the forward, the head and the tied
    embedding, and no fused tail.
  """
  order = [0, *range(1, s.head + 1)] + ([0] if s.tied else [])
  if not s.streamed_ends:
    order = [u for u in order if u not in (s.embed, s.head)]
  return dataclasses.replace(s, fetch_order=tuple(order), fused_tail=False,
                             start_positions=min(s.start_positions, len(order)),
                             turn_positions=0)
