"""A batch shape's step plan: its schedule, its step's operations, its device peak.

`memory.step_plan` builds a `StepPlan`; its `program` is what the trainer's thread
runs (`plan.program`), its `simulate` replays that program under the modelled timing
(`plan.simulate`), and its `peak` is the figure the trainer's budget check, the
preflight and the planner read.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from megatrain_jax.engine.plan import program as program_lib
from megatrain_jax.engine.plan import simulate as simulate_lib
from megatrain_jax.engine.plan import sizes
from megatrain_jax.engine.plan.schedule import Schedule

# Steps a plan simulates from a trainer just built: the first (nothing fetched
# ahead, no gradient of a step before), then one more, which starts as every later
# step does (tests/test_memory.py checks that more steps peak at the same figure).
SIMULATED_STEPS = 2


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """A batch shape's schedule, its step's operations and the device bytes they peak at.

  Attributes:
    schedule: the `Schedule`, with the start and turn buffers and device
      checkpoints that fit.
    peak: bytes by kind at the moment of the peak, and "total".
    activations: where the checkpoints wait, "device" or "host" (resolved from
      `EngineConfig.activations`).
    host_checkpoint_bytes: the host memory the checkpoints sent there take.
    bytes: the byte rules (`sizes.StepBytes`).
    depth: `EngineConfig.prefetch_depth`.
    grad_accum: micro-batches per step.
    deferred: updates wait for the whole sweep.
    keep: every layer keeps its residuals (recompute "dots" or "none").
    pooled: kept residuals reuse pooled buffers (`sizes.pools_buffers`).
    trains: each unit's elements that train (None: all of them).
  """
  schedule: Schedule
  peak: dict[str, int] = dataclasses.field(compare=False)
  activations: str
  host_checkpoint_bytes: int
  bytes: sizes.StepBytes
  depth: int
  grad_accum: int
  deferred: bool = False
  keep: bool = False
  pooled: bool = False
  trains: tuple[int, ...] | None = None
  structures: tuple[int, ...] = ()

  @property
  def sent_groups(self) -> tuple[int, ...]:
    """Groups whose input a micro-batch sends to host memory.

    Returns:
      `schedule.host_groups()` with activations in host memory, else ().
    """
    return self.schedule.host_groups() if self.activations == "host" else ()

  def program(self, update: bool = True, started: bool = True) -> program_lib.StepProgram:
    """The operations of one step of this shape.

    Args:
      update: the step updates (`step`; else `loss_and_grads`).
      started: its first fetches were queued by the step before.

    Returns:
      The `StepProgram`.
    """
    return _program(self, update, started)

  def eval_program(self) -> program_lib.StepProgram:
    """The operations of a forward-only pass of this shape (`trainer.evaluate`).

    Returns:
      The `StepProgram` (`plan.program.eval_program`).
    """
    return _eval_program(self)

  def programs(self, steps: int = SIMULATED_STEPS) -> list[program_lib.StepProgram]:
    """The operations of a trainer's first steps of this shape.

    Args:
      steps: how many.

    Returns:
      One `StepProgram` per step (the first without fetches started ahead).
    """
    return [self.program(started=i > 0) for i in range(steps)]

  def simulate(self, steps: int = SIMULATED_STEPS, record: bool = False) -> Simulated:
    """A trainer's first steps of this shape, under the modelled timing
    (`plan.simulate`).

    Args:
      steps: how many.
      record: also the timeline a real run forced into that timing follows.

    Returns:
      The peak by kind (and its "total"), and the timeline ([] without `record`).
    """
    peak, _ = _trace(dataclasses.replace(self, bytes=None), steps).peak(self.bytes)
    timeline = (simulate_lib.timeline(self.programs(steps), self.bytes, self.depth,
                                      self.structures) if record else [])
    return Simulated(peak, timeline)

  def with_extra_buffers(self, peak: int, most: int, kind: str, positions: int
                         ) -> "StepPlan":
    """This plan with up to `most` extra buffers of `kind` ("start" or "turn") for as
    many of their positions as keep the simulated peak at `peak`: the most buffers
    that fit at least one position, then the most positions for them.

    Args:
      peak: the peak to keep.
      most: the buffers asked for.
      kind: which `Schedule` fields: `<kind>_buffers` and `<kind>_positions`.
      positions: the positions they could cover.

    Returns:
      The plan with them (this plan where none fits).
    """
    with_extra = lambda extra, n: dataclasses.replace(self, schedule=dataclasses.replace(
        self.schedule, **{f"{kind}_buffers": extra, f"{kind}_positions": n}))
    for extra in range(most, 0, -1):
      n = largest_fitting(lambda n: with_extra(extra, n).simulate().peak["total"] <= peak,
                          0, positions)
      if n:
        return with_extra(extra, n)
    return self


class Simulated(NamedTuple):
  """What `StepPlan.simulate` found: the peak by kind, and the timeline."""
  peak: dict[str, int]
  timeline: list


@functools.lru_cache(maxsize=256)
def _trace(shape: StepPlan, steps: int) -> simulate_lib.Trace:
  """The ledger's changes, as byte rules: one per plan without its bytes, so that
  every batch size of a search weighs the same trace."""
  return simulate_lib.trace(shape.programs(steps), shape.depth, shape.structures)


@functools.lru_cache(maxsize=1024)
def _program(plan: StepPlan, update: bool, started: bool) -> program_lib.StepProgram:
  return program_lib.step_program(
      plan.schedule, plan.grad_accum, update=update, started=started,
      deferred=plan.deferred, host_groups=plan.sent_groups, keep=plan.keep,
      pooled=plan.pooled,
      trains=None if plan.trains is None else tuple(n > 0 for n in plan.trains))


@functools.lru_cache(maxsize=256)
def _eval_program(plan: StepPlan) -> program_lib.StepProgram:
  return program_lib.eval_program(plan.schedule, plan.grad_accum)


def largest_fitting(fits, lo: int, hi: int) -> int:
  """The largest n in [lo, hi] with fits(n), by bisection.

  Args:
    fits: a predicate true up to some n and false after it.
    lo: a value it holds for.
    hi: the largest value to try.

  Returns:
    That n.
  """
  if lo < hi and fits(hi):  # often all of it fits (extra buffers far from the peak)
    return hi
  hi -= 1
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
  return lo
