"""The trace of a simulated step: the ledger's changes as byte rules, weighed later.

`plan.simulate` replays a step's operations once per schedule and records each
ledger change as the byte rule it counts (a unit's bytes, a gradient's, an
activation's, a layer's checkpoint), not as bytes. `Trace.peak` weighs those
changes with a batch shape's `StepBytes`, so that the planner's searches over batch
sizes replay nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatrain_jax.engine.device.ledger import KINDS
from megatrain_jax.engine.plan import ops
from megatrain_jax.engine.plan.sizes import StepBytes

# The events of the timeline a real run must be held back for: a gradient's copy to
# the host, a checkpoint's, and a compute that frees a released buffer.
GATES = ("d2h", "offload", "compute")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One point of the timeline.

  Attributes:
    kind: "op" (the step's thread starts `op`) or one of `GATES`.
    state: the ledger just before it: sorted (kind, bytes) of every entry.
    clock: each unit's last step whose update is done, just before it.
    op: the operation, for "op".
  """
  kind: str
  state: tuple[tuple[str, int], ...]
  clock: tuple[int, ...]
  op: ops.Op | None = None


# The kinds, numbered for the trace.
KIND_NAMES = tuple(sorted(set(KINDS.values())))
KIND_INDEX = {k: i for i, k in enumerate(KIND_NAMES)}


def symbols(n_units: int, n_layers: int) -> StepBytes:
  """The byte rules as indices into `values(b)`: what a trace's entries name.

  Args:
    n_units: the model's units.
    n_layers: its layers.

  Returns:
    A `StepBytes` whose every field holds its own index.
  """
  n = n_units
  return StepBytes(tuple(range(n)), tuple(range(n, 2 * n)), 2 * n, 2 * n + 1,
                   tuple(range(2 * n + 2, 2 * n + 2 + n_layers)))


def values(b: StepBytes) -> np.ndarray:
  """A batch shape's bytes, in the order `symbols` numbers them.

  Args:
    b: the byte rules.

  Returns:
    An int64 vector.
  """
  return np.array([*b.unit, *b.grad, b.tied_grad, b.act, *b.ckpt], np.int64)


@dataclasses.dataclass(frozen=True)
class Trace:
  """The ledger's changes over the simulated steps, as rules, not bytes.

  Attributes:
    sign: +1 (added) or -1 (freed), per change.
    rule: the byte rule each change counts (an index into `values`).
    kinds: the kind of each change (an index into `KIND_NAMES`).
    bursts: the changes of every burst of compute that could make the ledger go
      higher, one after another, as (sign, rule, kind) arrays like the above.
    burst_starts: where each burst begins in those arrays.
    point_starts: where each burst's points begin in `points`.
    points: the number of changes before each point a burst branches off at.
  """
  sign: np.ndarray
  rule: np.ndarray
  kinds: np.ndarray
  bursts: tuple[np.ndarray, np.ndarray, np.ndarray]
  burst_starts: np.ndarray
  point_starts: np.ndarray
  points: np.ndarray

  def peak(self, b: StepBytes) -> tuple[dict[str, int], tuple[int, int] | None]:
    """The largest total the ledger reaches with these bytes, and the burst of
    compute that reaches it.

    Args:
      b: the byte rules.

    Returns:
      (bytes by kind at the peak, and "total"; (the burst, the index among its
      points) it needs, or None when the lazy timing reaches it).
    """
    v = values(b)
    delta = self.sign * v[self.rule]
    total = np.concatenate([[0], np.cumsum(delta)])
    at = int(np.argmax(total))
    by = np.bincount(self.kinds[:at], weights=delta[:at], minlength=len(KIND_NAMES))
    burst = None
    if len(self.burst_starts):
      sign, rule, kinds = self.bursts
      d = sign * v[rule]
      c = np.cumsum(d)
      lengths = np.diff(np.append(self.burst_starts, len(d)))
      base = c[self.burst_starts] - d[self.burst_starts]  # the sum before each burst
      # Each burst branches off at several points: the highest of them counts.
      branch = np.maximum.reduceat(total[self.points], self.point_starts)
      heights = c - np.repeat(base, lengths) + np.repeat(branch, lengths)
      j = int(np.argmax(heights))
      if heights[j] > total[at]:
        i = int(np.searchsorted(self.burst_starts, j, side="right") - 1)
        ends = np.append(self.point_starts, len(self.points))
        choices = self.points[ends[i]:ends[i + 1]]
        k = int(np.argmax(total[choices]))
        first, point = int(self.burst_starts[i]), int(choices[k])
        by = (np.bincount(self.kinds[:point], weights=delta[:point],
                          minlength=len(KIND_NAMES))
              + np.bincount(kinds[first:j + 1], weights=d[first:j + 1],
                            minlength=len(KIND_NAMES)))
        burst = (i, k)
    out = {k: int(by[i]) for i, k in enumerate(KIND_NAMES) if by[i]}
    out["total"] = sum(out.values())
    return out, burst
