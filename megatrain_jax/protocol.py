"""What every trainer offers: the interface the launcher, checkpoints and notebooks use.

`StreamingTrainer` (the engine) and `ResidentTrainer` (the reference) both implement
`Trainer`, so code that drives a run never asks which one it has.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import jax

from megatrain_jax.engine.host.state import Snapshot


@runtime_checkable
class Trainer(Protocol):
  """One model and its optimizer, trained a batch at a time."""

  def step(self, batch: dict[str, Any], key: jax.Array | None = None) -> dict[str, Any]:
    """One optimizer step.

    Args:
      batch: {"input_ids", "labels", "loss_mask"} (and packing's keys), each [B, T].
      key: the step's PRNG key (LoRA dropout), or None.

    Returns:
      {"loss", "tokens", "grad_norm"} at least; `float(out["grad_norm"])` is the
      global gradient norm before any clip. A policy-gradient loss
      (`mt.rl.PolicyLoss`) adds its metrics.
    """

  def evaluate(self, batch: dict[str, Any]) -> dict[str, float]:
    """The loss at the current parameters, forward only; nothing changes.

    Args:
      batch: as `step`.

    Returns:
      {"loss", "tokens"}, and a policy loss's metrics.
    """

  def logprobs(self, batch: dict[str, Any], adapters: bool = True) -> Any:
    """Each label's log-probability at the current parameters; nothing changes.

    Args:
      batch: as `step` (a policy loss's keys may be absent).
      adapters: False leaves LoRA adapters out (the frozen base's log-probs).

    Returns:
      float32 [B, T] numpy array.
    """

  def params(self) -> dict[str, Any]:
    """The current parameters, as a tree of arrays in the model's layout.

    Returns:
      The tree.
    """

  def stats(self) -> dict[str, Any]:
    """Counters: "steps" and "skipped_steps" at least.

    Returns:
      Counters by name.
    """

  def wait(self) -> None:
    """Blocks until the last step's work is done (raises what it met)."""

  def close(self) -> None:
    """Frees what the trainer holds; raises what its last step met, if unreported."""

  @property
  def step_count(self) -> int:
    """Steps taken (restored from a checkpoint)."""

  def state_layout(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """The parts of a checkpoint and the (shape, dtype) of each array.

    Returns:
      Part name -> array name -> (shape, dtype).
    """

  def snapshot(self) -> Snapshot:
    """The state at this step boundary, for a checkpoint writer to read part by part.

    Returns:
      The `Snapshot`.
    """

  def restore(self, read: Callable[[str], dict[str, Any]], step_count: int) -> None:
    """Loads every part of `state_layout()`.

    Args:
      read: part name -> its arrays.
      step_count: the step the state is at.
    """
