"""Forcing a real run into the timing the memory model assumes (`plan.simulate`).

The model's timeline (`StepPlan.simulate(record=True)`) lists the start of every
operation of the step's thread and every event a real run would do sooner than the
model: a gradient leaving, a checkpoint leaving, a compute being done (so that a
released buffer can be freed). `GatedTransport` holds each of those back until it
is let through. `Pacer` walks the timeline on a thread of its own: it waits until
the trainer's ledger and update clock are what the model says at that point, with
every engine thread settled, then lets the step's thread start the operation, or
lets one held-back event through. Every change of the ledger then happens in the
model's order, so its peak is the model's, exactly; a run that does anything the
model does not times out here with both states in the message.
"""

from __future__ import annotations

import threading
import time

from megatrain_jax.engine.device import transport as transport_lib
from megatrain_jax.engine.plan.trace import GATES


class Gate:
  """Holds calls back until they are let through, one per `open_one`."""

  def __init__(self):
    self._cond = threading.Condition()
    self._permits = 0
    self.waiting = 0
    self.free = False

  def open_one(self, timeout_s: float) -> bool:
    """Lets one call through, and waits for one to go.

    Returns:
      Whether one went within the timeout.
    """
    deadline = time.monotonic() + timeout_s
    with self._cond:
      self._permits += 1
      self._cond.notify_all()
      while self._permits and not self.free:
        if not self._cond.wait(max(0.0, deadline - time.monotonic())):
          return False
      return True

  def open_all(self) -> None:
    with self._cond:
      self.free = True
      self._cond.notify_all()

  def through(self) -> None:
    with self._cond:
      self.waiting += 1
      while not (self.free or self._permits):
        self._cond.wait()
      self.waiting -= 1
      if not self.free:
        self._permits -= 1
        self._cond.notify_all()


class GatedTransport(transport_lib.DeviceTransport):
  """A `DeviceTransport` whose gradient copies to the host, checkpoint copies to the
  host and waits for a compute go through gates."""

  def __init__(self):
    super().__init__()
    self.gates = {g: Gate() for g in GATES}

  def d2h(self, device_array):
    self.gates["d2h"].through()
    return super().d2h(device_array)

  def offload(self, tree):
    self.gates["offload"].through()
    return super().offload(tree)

  def await_compute(self, array):
    self.gates["compute"].through()
    super().await_compute(array)

  def open_all(self) -> None:
    for g in self.gates.values():
      g.open_all()


class Pacer:
  """Walks a timeline against a trainer: use `on_op` as the trainer's hook, then
  `start(trainer)` before its first step, and `finish()` after its last."""

  def __init__(self, timeline, transport: GatedTransport, timeout_s: float = 30.0):
    self.timeline, self.transport, self.timeout_s = timeline, transport, timeout_s
    self._cond = threading.Condition()
    self._go = None  # the operation the step's thread may start
    self._taken = 0
    self.error: str | None = None
    self._thread = None

  def start(self, trainer) -> None:
    self.rt = trainer.runtime
    self._thread = threading.Thread(target=self._walk, daemon=True)
    self._thread.start()

  def on_op(self, op) -> None:
    """The trainer's hook: waits until the timeline lets `op` start."""
    with self._cond:
      deadline = time.monotonic() + 2 * self.timeout_s  # the walk reports first
      while self._go is None and self.error is None:
        if not self._cond.wait(max(0.0, deadline - time.monotonic())):
          self._fail(f"the step's thread waited for {op} too long")
      if self.error is not None:
        raise AssertionError(self.error)
      if self._go != op:
        self._fail(f"the step ran {op} where the program has {self._go}")
        raise AssertionError(self.error)
      self._go = None
      self._taken += 1
      self._cond.notify_all()

  def _fail(self, message: str) -> None:
    """Records the first divergence and lets everything through, so that the engine
    can stop and the test can report it."""
    with self._cond:
      self.error = self.error or message
      self._cond.notify_all()
    self.transport.open_all()

  def _settled(self, entry) -> bool:
    compute = self.transport.gates["compute"]
    return (self.rt.ledger.state() == entry.state and self.rt.clock.snapshot() == entry.clock
            and (self.rt.prefetcher.idle or compute.waiting > 0))

  def _walk(self) -> None:
    for i, entry in enumerate(self.timeline):
      deadline = time.monotonic() + self.timeout_s
      while not self._settled(entry):
        if time.monotonic() > deadline:
          self._fail(f"timeline point {i} ({entry.kind} {entry.op}): the ledger "
                     f"holds {self.rt.ledger.state()} with updates "
                     f"{self.rt.clock.snapshot()}, the model {entry.state} with "
                     f"{entry.clock}")
          return
        self.rt.ledger.wait_for(lambda s: s == entry.state, 0.01)
      if entry.kind == "op":
        with self._cond:
          self._go, taken = entry.op, self._taken
          self._cond.notify_all()
          while self._taken == taken and self.error is None:
            self._cond.wait(self.timeout_s)
      elif not self.transport.gates[entry.kind].open_one(self.timeout_s):
        self._fail(f"timeline point {i}: no {entry.kind} came when the model has one")
        return

  def finish(self) -> None:
    """After the last step: the walk is done, and nothing is held back any more."""
    self._thread.join(self.timeout_s)
    self.transport.open_all()
    assert self.error is None, self.error
    assert not self._thread.is_alive(), "the timeline was not walked to its end"
