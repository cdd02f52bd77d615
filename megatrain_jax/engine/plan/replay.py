"""The ledger's largest total over one micro-batch, replayed from its `Schedule`.

`memory.step_plan` calls `replay` the way `step.micro_step` runs a micro-batch: the
parameter buffers in flight around each position, resident units, activation
checkpoints (all of them, or with activations in host memory those moving and
those that stay), the running activation and gradient, a group's recomputed inputs,
and the gradients waiting for the link in the worst case of a slow one. It knows
the step's order and sizes only, so `memory` sizes the units and this replays them.
"""

from __future__ import annotations

from megatrain_jax.engine.config import MAX_PENDING_GRADIENTS
from megatrain_jax.engine.plan.schedule import Schedule

# Checkpoints on the device at once when they wait in host memory: the group being
# worked on and the one moving (out during the forward, in ahead of the backward),
# besides the last groups' inputs, which stay (`Schedule.device_checkpoints`).
HOST_CHECKPOINTS_ON_DEVICE = 2


def _host_checkpoints_on_device(n: int, groups: int, kept: int, phase: str) -> int:
  """Checkpoints on the device while `n` groups' inputs exist (in the forward, at
  the head, or in the backward), with activations in host memory and the last
  `kept` groups' inputs staying on the device."""
  stay = max(0, n - (groups - kept))
  sent = n - stay
  if not stay:  # the group worked on, and one moving (out, or in ahead of it)
    return min(sent, HOST_CHECKPOINTS_ON_DEVICE)
  if phase == "forward" or (phase == "backward" and stay == 1):
    return stay + min(sent, 1)  # the last one sent may still be leaving, or the
    # next one is coming in while the lowest kept group runs
  return stay  # at the head every copy out has arrived, and nothing comes in yet


def replay(unit: list[int], grad: list[int], activations: str, sched: Schedule, act: int,
           ck: int, pooled: bool, updates_follow: bool = False) -> dict[str, int]:
  """The ledger's largest total over one micro-batch, by kind.

  Args:
    unit: each unit's bytes as fetched.
    grad: each unit's gradient bytes as it leaves the device.
    activations: where the checkpoints wait, "device" or "host".
    sched: the micro-batch's schedule (slot limits, groups, checkpoints kept).
    act: one activation's bytes.
    ck: one checkpoint's bytes (the block input, with its kept residuals).
    pooled: the step reuses its kept residuals' buffers (`pool.BufferPool`).
    updates_follow: the next micro-batch's fetches wait for this one's updates
      (every micro-batch is its step's last: grad_accum 1), so they take only
      units whose gradient has left the device.

  Returns:
    Bytes by kind at the replay's largest total, and "total".
  """
  if activations == "host":
    ckpt = lambda n, phase="forward": _host_checkpoints_on_device(
        n, len(sched.groups), sched.device_checkpoints, phase) * ck
  elif pooled:  # every layer's buffers stay on the device, in use or in the pool
    ckpt = lambda n, phase="forward": len(sched.groups) * ck
  else:
    ckpt = lambda n, phase="forward": n * ck
  order = sched.fetch_order
  both = order + order  # this micro-batch's fetches, then the next one's
  widest = max(sched.limit(q) for q in range(len(order))) if order else 0
  ahead = widest - sched.held

  def params(p: int) -> int:
    """Buffers alive while position p computes: released ones not yet reclaimed
    (a fetch under position p's limit reclaims the oldest first), held ones and
    ones fetched ahead (in or out of order): at most the limit in force, among the
    positions around p. The next micro-batch's fetches get no start buffers before
    this one's compute is done, and with `updates_follow` take only units whose
    gradient has left."""
    if not order:
      return 0
    lo, hi = max(0, p - sched.limit(p) + 1), min(len(both), p + widest + ahead)
    count = max(sched.limit(q) if q < len(order) else sched.slots for q in range(lo, hi))
    alive = [unit[u] for q, u in enumerate(both[lo:hi], lo)
             if q < len(order) or not updates_follow or u in left]
    return sum(sorted(alive, reverse=True)[:count])

  resident = sum(unit[u] for u in sched.resident_units())
  tied_g = unit[0] if sched.tied else 0  # the head's gradient for the tied embedding
  # The gradient queue, worst case (a slow link): it starts with the tail of the
  # step before (unit None here), and a new gradient waits for the oldest to leave
  # when it is full.
  queue: list[tuple[int | None, int]] = [
      (None, grad[u]) for u in sched.grad_order[-MAX_PENDING_GRADIENTS:]]
  left: set[int] = set()  # units whose gradient of this micro-batch has left
  queued = lambda: sum(g for _, g in queue)
  best: dict[str, int] = {"total": -1}
  pos = {"p": -1}

  def at(kinds: dict[str, int]) -> None:
    kinds = {"params_in_flight": params(max(pos["p"], 0)), "resident_units": resident,
             **kinds}
    kinds["total"] = sum(kinds.values())
    if kinds["total"] > best["total"]:
      best.clear()
      best.update(kinds)

  def take(u: int) -> None:
    if u not in sched.resident_units():
      pos["p"] += 1

  def send(u: int) -> None:
    if len(queue) == MAX_PENDING_GRADIENTS:
      gone = queue.pop(0)[0]
      if gone is not None:
        left.add(gone)
    queue.append((u, grad[u]))

  groups = sched.groups
  L, c = sched.n_layers, groups[0][1] - groups[0][0]
  take(0)
  at({"activation_checkpoints": ckpt(0), "gradients_in_flight": queued()})
  for i in range(L):
    take(1 + i)
    at({"activation_checkpoints": ckpt(i // c + 1), "activations": act,
        "gradients_in_flight": queued()})
  take(sched.head)
  if sched.tied:
    take(0)
  ckpts = ckpt(len(groups), "head")
  at({"activation_checkpoints": ckpts, "activations": act,
      "gradients_in_flight": queued()})
  tail_g = grad[L] if sched.fused_tail else 0  # made in the head's call
  at({"activation_checkpoints": ckpts, "activations": 2 * act,
      "gradients_in_flight": queued() + grad[sched.head] + tied_g + tail_g})
  send(sched.head)
  layer0 = 0
  for gi, (s, e) in enumerate(reversed(groups)):
    ckpts = ckpt(len(groups) - gi, "backward")
    for i in range(s, e):
      if not (sched.fused_tail and gi == 0):  # a fused tail's layer is still here
        take(1 + i)
    for j in range(e - s - 1):  # the group's inputs, recomputed
      at({"activation_checkpoints": ckpts, "activations": (3 + j) * act,
          "gradients_in_flight": queued() + tied_g})
    for j in reversed(range(e - s)):
      recomputed = min(j + 1, e - s - 1) * act
      at({"activation_checkpoints": ckpts, "activations": 2 * act + recomputed,
          "gradients_in_flight": queued() + tied_g})
      new = grad[1 + s + j]
      at({"activation_checkpoints": ckpts, "activations": 2 * act + recomputed,
          "gradients_in_flight": queued() + new + tied_g})
      if s + j:
        send(1 + s + j)
      else:
        layer0 = new  # held until the embedding's gradient has left
  at({"activation_checkpoints": ckpt(0), "activations": 2 * act,
      "gradients_in_flight": queued() + layer0 + tied_g})
  at({"activation_checkpoints": ckpt(0), "gradients_in_flight": queued() + layer0 + grad[0]})
  return best


def largest_fitting(fits, lo: int, hi: int) -> int:
  """The largest n in [lo, hi] with fits(n), by bisection.

  Args:
    fits: a predicate true up to some n and false after it.
    lo: a value it holds for.
    hi: the largest value to try.

  Returns:
    That n.
  """
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
  return lo
