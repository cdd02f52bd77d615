"""What a `StreamingTrainer` offers checkpoints and notebooks: its parameters and its
host state, read and restored part by part (`engine/host/state.py`).

A mixin of `StreamingTrainer`, kept apart from the step: it reads the trainer's
runtime (`_rt`), health (`_health`) and schedule, and never runs a step.
"""

from __future__ import annotations

from typing import Any, Callable

from megatrain_jax.engine.host.state import Snapshot
from megatrain_jax.models import llama


class TrainerState:
  """Parameters, state layout, snapshot and restore of a `StreamingTrainer`."""

  frozen_checksums = property(lambda self: self._rt.frozen_checksums(), doc="Part name -> "
                              "a CRC-32 of its frozen values (`trainable=`; they never change).")

  closed = property(lambda self: self._health.closed, doc="Whether `close()` was called "
                    "(parameters and state stay readable; no step runs).")

  @property
  def step_count(self) -> int:
    """Steps taken (skipped ones included), restored from a checkpoint."""
    return self._steps

  host_optimizer = property(lambda self: self._rt.host_opt,
                            doc="The `HostOptimizer`: the state store and the updater.")
  transport = property(lambda self: self._rt.transport, doc="How this trainer moves bytes.")
  runtime = property(lambda self: self._rt, doc="The `Runtime`: the parts its threads "
                     "share (the ledger, the update clock, the prefetcher).")

  def _settled(self) -> None:
    """Valid, with the last step's updates done (nothing to wait for once closed)."""
    if self._health.error is not None or not self._health.closed:
      self.wait()

  def params(self) -> dict[str, Any]:
    """The fp32 master parameters, once the last updates are done.

    Returns:
      A tree of numpy arrays, the model's layout.
    """
    return llama.assemble_units([self.unit_params(u) for u in range(self.schedule.n_units)])

  def unit_params(self, u: int) -> dict[str, Any]:
    """One unit's fp32 master parameters, once the last updates are done.

    Args:
      u: the unit (0 embed, 1..L the blocks, L + 1 head).

    Returns:
      A tree of numpy arrays (a copy).
    """
    self._settled()
    store = self._rt.host_opt.store
    return store.specs[u].unflatten(store.master(u))

  def state_layout(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """What `snapshot` holds.

    Returns:
      For each part, the (shape, dtype) of its arrays.
    """
    self._settled()
    return self._rt.state_layout()

  def snapshot(self, max_copies: int = 1) -> Snapshot:
    """The host state at this step boundary, for a writer to read part by part while
    training goes on (see `engine/host/state.py`).

    Args:
      max_copies: parts an update copies ahead of the writer before it waits for it.

    Returns:
      The `Snapshot` (parts in the order the next updates change them), which the
      writer closes.
    """
    self._settled()
    return self._rt.snapshot(max_copies)

  def restore(self, read: Callable[[str], dict[str, Any]], step_count: int) -> None:
    """Loads every part of `state_layout()`, one unit at a time.

    A trainer invalid after a failure is revived once every part is loaded; if `read`
    fails partway the trainer is invalid. Parts without "frozen" keep their own.

    Args:
      read: part name -> its arrays (the caller checked the layout).
      step_count: the step the state is at.

    Raises:
      RuntimeError: the trainer is closed.
    """
    health = self._health
    if health.closed:
      raise RuntimeError("This StreamingTrainer is closed; build a new one to restore into.")
    revive = health.error is not None
    if not revive:
      self.wait()
      self._cancel_prefetch()
    health.restore(lambda: self._rt.load_state(read, int(step_count)), int(step_count),
                   revive)
    self._steps, self._next_started = int(step_count), None

