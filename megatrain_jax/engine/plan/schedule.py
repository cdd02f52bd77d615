"""The order of a step, as data: units, checkpoint groups, fetches, gradients, slots.

Units are numbered 0 = embedding, 1..L = the blocks, L + 1 = head. Everything that
needs an order (the trainer's loop, the prefetcher, the memory model, the planner, a
checkpoint's part order) reads it from a `Schedule`, so the order lives here only.
"""

from __future__ import annotations

import dataclasses
import functools

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.models.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class Schedule:
  """One micro-batch's order of work for a model and an engine config.

  Attributes:
    n_layers: decoder blocks (L).
    groups: layer ranges [start, end) whose input is an activation checkpoint, in
      forward order; the backward runs them in reverse.
    fetch_order: units in the order one micro-batch fetches them: the forward, the
      head (then the tied embedding), then each group's layers, last group first
      (but a fused tail's, still on the device). Resident units
      (`stream_embed_head=False`) are not fetched.
    grad_order: units in the order their gradients leave the device: the head, the
      layers from the top down to layer 1, the embedding, then layer 0 (the next
      forward needs the embedding first). Per-unit updates run in this order.
    held: parameter buffers the compute holds at once (a group's layers in its
      backward, or the head with the tied embedding); a fused tail holds one more
      at its own fetches (`limit`).
    slots: parameter buffers alive at once: `held` plus `prefetch_depth`.
    start_buffers: extra buffers allowed for the first `start_positions` fetches of
      a micro-batch (see `memory.step_plan`, which sizes them to fit the peak).
    start_positions: how many of the first fetches may use them.
    turn_buffers: extra buffers allowed for the first `turn_positions` fetches of a
      micro-batch's backward, which run beside the head's call (see
      `memory.step_plan`, which sizes them to fit the peak).
    turn_positions: how many of the backward's first fetches may use them.
    device_checkpoints: with activations in host memory, the last groups whose
      input stays on the device (see `memory.step_plan`, which sizes it).
    fused_tail: the last layer's forward and backward run in the head's call
      (`EngineConfig.last_layer_in_head`): its parameters, fetched for the forward,
      stay until then, and the backward does not fetch them again.
  """

  n_layers: int
  groups: tuple[tuple[int, int], ...]
  fetch_order: tuple[int, ...]
  grad_order: tuple[int, ...]
  held: int
  slots: int
  tied: bool
  streamed_ends: bool
  start_buffers: int = 0
  start_positions: int = 0
  turn_buffers: int = 0
  turn_positions: int = 0
  device_checkpoints: int = 1
  fused_tail: bool = False

  @classmethod
  def build(cls, cfg: LlamaConfig, ec: EngineConfig) -> "Schedule":
    """The schedule of `cfg` under `ec`, without start or turn buffers.

    Args:
      cfg: the model.
      ec: the engine config (checkpoint_every, prefetch_depth, stream_embed_head).

    Returns:
      The `Schedule`.
    """
    L, c = cfg.n_layers, ec.checkpoint_every
    head = L + 1
    groups = tuple((s, min(s + c, L)) for s in range(0, L, c))
    fused = bool(ec.last_layer_in_head and L and ec.recompute == "full"
                 and groups[-1][1] - groups[-1][0] == 1 and not cfg.layer_is_moe(L - 1))
    order = [0, *range(1, head), head] + ([0] if cfg.tie_embeddings else [])
    for s, e in reversed(groups[:-1] if fused else groups):
      order += [1 + i for i in range(s, e)]
    if not ec.stream_embed_head:
      order = [u for u in order if u not in (0, head)]
    grads = [head, *range(L, 1, -1), 0] + ([1] if L else [])
    held = max(c, 2 if cfg.tie_embeddings and ec.stream_embed_head else 1)
    return cls(n_layers=L, groups=groups, fetch_order=tuple(order),
               grad_order=tuple(grads), held=held, slots=held + ec.prefetch_depth,
               tied=cfg.tie_embeddings, streamed_ends=ec.stream_embed_head,
               device_checkpoints=min(ec.device_checkpoints or 1, max(len(groups), 1)),
               fused_tail=fused)

  @property
  def n_units(self) -> int:
    """Units of the model: embedding, L blocks, head."""
    return self.n_layers + 2

  @property
  def embed(self) -> int:
    """The embedding's unit index."""
    return 0

  @property
  def head(self) -> int:
    """The head's unit index."""
    return self.n_layers + 1

  def resident_units(self) -> tuple[int, ...]:
    """Units kept on the device between steps instead of fetched.

    Returns:
      (embed, head) with `stream_embed_head=False`, else ().
    """
    return () if self.streamed_ends else (self.embed, self.head)

  def host_groups(self) -> tuple[int, ...]:
    """Groups whose input waits in host memory when the activations go there.

    Returns:
      The first layers of all groups but the last `device_checkpoints`.
    """
    return tuple(s for s, _ in self.groups[:len(self.groups) - self.device_checkpoints])

  def limit(self, position: int) -> int:
    """Parameter buffers a fetch at this position of a micro-batch's order may fill.

    Args:
      position: index into `fetch_order`.

    Returns:
      `slots`, plus `start_buffers` for the first `start_positions` positions and
      `turn_buffers` for `turn_positions` from `turn_start`; at a fused tail's
      fetches at least what its call holds (`tail_needs`).
    """
    return self.limits[position] if position < len(self.limits) else self.slots

  @functools.cached_property
  def limits(self) -> tuple[int, ...]:
    """`limit` of every position of `fetch_order`.

    Returns:
      One limit per position.
    """
    turn = range(self.turn_start, self.turn_start + self.turn_positions)
    return tuple(max(self.slots + (self.start_buffers if q < self.start_positions else 0)
                     + (self.turn_buffers if q in turn else 0),
                     self.tail_needs.get(q, 0)) for q in range(len(self.fetch_order)))

  @property
  def turn_start(self) -> int:
    """The position in `fetch_order` of the backward's first fetch.

    Returns:
      The forward's fetches, with the head's and the tied embedding's.
    """
    return self.n_layers + (2 + self.tied if self.streamed_ends else 0)

  @functools.cached_property
  def tail_needs(self) -> dict[int, int]:
    """The buffers a fused tail's fetches need, by position in `fetch_order`: the
    head's, with the last layer held (2), and the tied embedding's, with the head
    too (3). Only `prefetch_depth=0` has fewer slots.

    Returns:
      {position: buffers}; {} without a fused tail or when the head is resident.
    """
    if not self.fused_tail or not self.streamed_ends:
      return {}
    first = self.fetch_order.index(self.head)
    return {first + k: 2 + k for k in range(1 + self.tied)}

  def fetched_bytes(self, unit_bytes: list[int]) -> int:
    """Bytes one micro-batch's fetches move to each device.

    Args:
      unit_bytes: each unit's bytes as fetched (`sizes.unit_param_bytes`).

    Returns:
      Their sum over `fetch_order`.
    """
    return sum(unit_bytes[u] for u in self.fetch_order)

  def update_order(self, deferred: bool) -> tuple[int, ...]:
    """Units in the order a step's updates change them.

    Args:
      deferred: whether the updates wait for the sweep (whole-tree, clipped, or
        nonfinite="skip"), which then run in unit order.

    Returns:
      Unit indices.
    """
    return tuple(range(self.n_units)) if deferred else self.grad_order

  def unit_name(self, u: int) -> str:
    """A unit's name for messages.

    Args:
      u: the unit index.

    Returns:
      "embed", "layer i" (0-based) or "head".
    """
    return {self.embed: "embed", self.head: "head"}.get(u, f"layer {u - 1}")

  def state_key(self, u: int) -> str:
    """The name of a unit's part of a checkpoint.

    Args:
      u: the unit index.

    Returns:
      "embed", "block_0003" (layer 3) or "head".
    """
    return {self.embed: "embed", self.head: "head"}.get(u, f"block_{u - 1:04d}")
