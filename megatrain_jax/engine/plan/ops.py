"""The operations of a step, each with what it adds to and frees from device memory.

`plan.program` emits them in order; `engine.execute` runs each with one method;
`plan.simulate` replays them. `Op.effects` is the only place a byte rule of the
device ledger is written: the executor applies the same effects with the bytes of
the arrays it made, the simulation with the byte rules of a batch shape.
"""

from __future__ import annotations

import dataclasses

from megatrain_jax.engine.device.ledger import Key
from megatrain_jax.engine.plan.sizes import StepBytes

Effect = tuple[Key, "int | None"]  # (key, bytes added) or (key, None): freed


@dataclasses.dataclass(frozen=True)
class Op:
  """One operation of a step; `m` is its micro-batch."""
  m: int

  def effects(self, b: StepBytes) -> tuple[Effect, ...]:
    """What this operation adds to and frees from device memory.

    Args:
      b: the byte rules.

    Returns:
      (key, bytes) added, (key, None) freed, in order.
    """
    del b
    return ()


# -- fetches ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StartFetches(Op):
  """Queue a micro-batch's fetches: this step's, or with `ahead` the next step's
  (behind the last micro-batch's, so the link keeps working through its tail)."""
  ahead: bool = False


@dataclasses.dataclass(frozen=True)
class Take(Op):
  """Take a unit's buffer from the prefetcher (fetched now without prefetch)."""
  unit: int
  position: int


@dataclasses.dataclass(frozen=True)
class UseResident(Op):
  """Use a unit kept on the device, once its update is done."""
  unit: int


@dataclasses.dataclass(frozen=True)
class Release(Op):
  """The compute that used a unit's buffer frees it once it is done."""
  unit: int
  position: int


@dataclasses.dataclass(frozen=True)
class JobDone(Op):
  """No activation of the micro-batch is left: later jobs may use start buffers."""


# -- forward ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EmbedForward(Op):
  """The embedding's forward: the running activation appears."""

  def effects(self, b):
    return ((("act", self.m, "x"), b.act),)


@dataclasses.dataclass(frozen=True)
class Checkpoint(Op):
  """Keep a group's input (with `keep` residuals, the layer's whole checkpoint) on
  the device, or with `host` send it to host memory (counted until it has left)."""
  group: int
  layer: int
  host: bool = False

  def effects(self, b):
    return ((("ckpt", self.m, self.group), b.ckpt[self.layer]),)


@dataclasses.dataclass(frozen=True)
class BlockForward(Op):
  """A layer's forward; with `keep` it returns the residuals its backward needs,
  written into pooled buffers with `pooled`."""
  layer: int
  keep: bool = False
  pooled: bool = False


@dataclasses.dataclass(frozen=True)
class Flush(Op):
  """Wait until every checkpoint sent has arrived in host memory."""


@dataclasses.dataclass(frozen=True)
class Head(Op):
  """Final norm, LM head and loss, value and gradient; with `fused` the last layer's
  forward and backward too."""
  head: int
  last_layer: int | None = None  # its unit, when fused
  tied: bool = False
  last_trains: bool = True  # the fused layer has a gradient

  def effects(self, b):
    out = [(("act", self.m, "g"), b.act)]
    if self.tied:
      out.append((("tied_grad", self.m), b.tied_grad))
    out.append((("grad", self.m, self.head), b.grad[self.head]))
    if self.last_layer is not None and self.last_trains:
      out.append((("grad", self.m, self.last_layer), b.grad[self.last_layer]))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class HeadLoss(Op):
  """Final norm, LM head and loss, the value only (an evaluation): the running
  activation goes."""
  head: int
  tied: bool = False

  def effects(self, b):
    return ((("act", self.m, "x"), None),)


@dataclasses.dataclass(frozen=True)
class SendGradient(Op):
  """Hand a unit's gradient to the link (it leaves as the queue allows)."""
  unit: int


# -- backward --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reload(Op):
  """Start bringing a group's input back from host memory."""
  group: int


@dataclasses.dataclass(frozen=True)
class Restore(Op):
  """Take a group's input for its backward (from the device, or brought back)."""
  group: int
  host: bool = False


@dataclasses.dataclass(frozen=True)
class Recompute(Op):
  """Recompute the input of the `j + 1`-th layer of a group from the one before."""
  layer: int
  j: int

  def effects(self, b):
    return ((("act", self.m, "recompute", self.j), b.act),)


@dataclasses.dataclass(frozen=True)
class BlockBackward(Op):
  """A layer's backward (its forward recomputed inside, or from kept residuals);
  its gradient appears, and its input's recomputed copy goes. With `pooled` its
  checkpoint's buffers go to the pool for the next forward of its shapes."""
  layer: int
  j: int
  group: int
  kept: bool = False
  pooled: bool = False
  trains: bool = True

  def effects(self, b):
    out = []
    if self.trains:
      out.append((("grad", self.m, 1 + self.layer), b.grad[1 + self.layer]))
    out.append((("act", self.m, "recompute", self.j), None))
    if self.pooled:
      out.append((("ckpt", self.m, self.group), None))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class DropCheckpoint(Op):
  """A group's backward is done: its input goes."""
  group: int

  def effects(self, b):
    return ((("ckpt", self.m, self.group), None),)


@dataclasses.dataclass(frozen=True)
class EmbedBackward(Op):
  """The embedding's gradient (the head's part added when tied); the running
  activation and gradient go."""
  trains: bool = True

  def effects(self, b):
    out = [(("act", self.m, "x"), None), (("act", self.m, "g"), None),
           (("tied_grad", self.m), None)]
    if self.trains:
      out.append((("grad", self.m, 0), b.grad[0]))
    return tuple(out)


# -- the step's end --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Settle(Op):
  """The step's verdict: its first update (per unit), or every gradient and then
  the whole update (`deferred`); without `update`, every gradient on the host."""
  update: bool = True
  deferred: bool = False


@dataclasses.dataclass(frozen=True)
class Drain(Op):
  """Free every buffer the compute has released."""


# Operations that run a template (one jitted call each), for the planner.
TEMPLATE_CALLS = (EmbedForward, BlockForward, Head, HeadLoss, Recompute, BlockBackward,
                  EmbedBackward)
