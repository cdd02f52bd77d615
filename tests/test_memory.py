"""The device-memory model against the engine's ledger.

`memory.step_plan` replays a step's operations (`plan.program`) under the timing
the model assumes (`plan.simulate`). Forced into that timing (tests/pacing.py), a
real run's ledger goes through the same totals and peaks at exactly the modelled
figure, which the planner reports too; left free, it never passes it.
"""

import dataclasses
import time

import jax
import numpy as np
import optax
import pytest

import megatrain_jax as mt
from megatrain_jax import planner
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.plan import memory, preflight
from megatrain_jax.models import llama
from megatrain_jax.models import trainable as trainable_lib

from conftest import TINY, SlowGradients, random_batch
from pacing import GatedTransport, Pacer

CFG = TINY.replace(n_layers=4, vocab_size=512)
# The embedding and the first layer frozen (`trainable=`).
FROZEN = lambda path: not (path[0] == "embed" or path[:2] == ("blocks", 0))
MOE = CFG.replace(n_experts=4, n_experts_per_tok=2, moe_d_ff=32,
                  moe_layers=(False, True, True, True))
# (model, engine config, optimizer): every prefetch depth, checkpoint group size, place
# for the checkpoints, recompute mode, micro-batch count, tied and untied ends, the
# last layer in the head's call and not, dense and MoE layers, and updates that wait
# for the sweep.
MATRIX = {
    "default": (CFG, {}, None),
    "depth0_groups_accum_tied": (CFG.replace(tie_embeddings=True),
                                 dict(prefetch_depth=0, checkpoint_every=2, grad_accum=2),
                                 None),
    "depth1_host_tied_unfused": (CFG.replace(tie_embeddings=True),
                                 dict(prefetch_depth=1, activations="host",
                                      last_layer_in_head=False), None),
    "host_groups_accum_deep": (CFG.replace(n_layers=8),
                               dict(activations="host", checkpoint_every=2, grad_accum=2),
                               None),
    "dots_moe_aux": (MOE.replace(router_aux_loss_coef=0.01), dict(recompute="dots"), None),
    "depth1_host_dots_accum_tied_moe": (MOE.replace(tie_embeddings=True), dict(
        prefetch_depth=1, activations="host", recompute="dots", grad_accum=2), None),
    "depth0_none": (CFG, dict(prefetch_depth=0, recompute="none"), None),
    "host_none_accum": (CFG, dict(activations="host", recompute="none", grad_accum=2), None),
    "resident_ends_tied": (CFG.replace(tie_embeddings=True), dict(stream_embed_head=False),
                           None),
    "depth1_groups_unfused_moe": (MOE, dict(prefetch_depth=1, checkpoint_every=2,
                                            last_layer_in_head=False), None),
    "whole_tree_update": (CFG, {}, lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                                       optax.sgd(0.1))),
    "skip_nonfinite_host": (CFG, dict(nonfinite="skip", activations="host"), None),
    "frozen_embed_and_layer0_tied": (CFG.replace(tie_embeddings=True),
                                     dict(prefetch_depth=1), None, FROZEN),
}
B, T, STEPS = 4, 16, 3


def _case(name):
  cfg, kw, optimizer, *trainable = MATRIX[name]
  return cfg, kw, optimizer, (trainable or [None])[0]


def _trains(cfg, trainable):
  """Each unit's elements that train, as the trainer counts them."""
  masks = trainable_lib.unit_masks(cfg, trainable)
  return None if masks is None else tuple(
      FlatSpec(t, m).train_size for t, m in zip(llama.abstract_units(cfg), masks))


def _run(cfg, ec, optimizer, **kw):
  with mt.StreamingTrainer.from_config(cfg, (optimizer or (lambda: optax.sgd(0.1)))(), ec,
                                       jax.random.key(0), **kw) as eng:
    yield eng
    for s in range(STEPS):
      eng.step(random_batch(cfg, B, T, seed=s))
    yield eng.stats()


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_the_executed_ledger_is_the_model_under_its_timing(name):
  cfg, kw, optimizer, trainable = _case(name)
  transport = GatedTransport()
  ec = mt.EngineConfig(**kw, transport=transport)
  deferred = optimizer is not None
  plan = memory.step_plan(cfg, ec, B, T, deferred=deferred, packed=False,
                          trains=_trains(cfg, trainable))
  model = plan.simulate(STEPS, record=True)  # the same peak as the plan's 2 steps
  pacer = Pacer(model.timeline, transport)
  run = _run(cfg, ec, optimizer, on_op=pacer.on_op, trainable=trainable)
  pacer.start(next(run))
  try:
    stats = next(run)
  finally:
    pacer.finish()
    run.close()
  assert stats["device_peak_bytes"] == model.peak["total"] == plan.peak["total"]
  # The planner's figure is the same model's.
  if trainable is None:
    assert planner.device_peak(cfg, ec, B, T, flash_attention=False, deferred=deferred,
                               packed=False) == plan.peak["total"]


# Free timing for every config; slow gradients (the queue full, as the model assumes)
# for a few: the paced test above already forces the model's worst case on each.
SLOW = ("depth0_groups_accum_tied", "dots_moe_aux", "frozen_embed_and_layer0_tied",
        "host_groups_accum_deep")


@pytest.mark.parametrize("name,slow", [(n, False) for n in sorted(MATRIX)]
                         + [(n, True) for n in SLOW])
def test_the_ledger_never_passes_the_model(name, slow):
  cfg, kw, optimizer, trainable = _case(name)
  ec = mt.EngineConfig(**kw, transport=SlowGradients() if slow else None)
  run = _run(cfg, ec, optimizer, trainable=trainable)
  next(run)
  stats = next(run)
  run.close()
  predicted = memory.step_plan(cfg, ec, B, T, deferred=optimizer is not None, packed=False,
                               trains=_trains(cfg, trainable))
  assert stats["device_peak_bytes"] <= predicted.peak["total"]
  assert memory.device_bytes(cfg, ec, B, T, deferred=optimizer is not None,
                             plan=predicted)["total"] >= predicted.peak["total"]


@pytest.mark.parametrize("kind", ["start", "turn"])
def test_extra_buffers_stay_within_the_peak_without_them(kind):
  # Small activations, a deep model: one more buffer fits at a step's start, and at
  # the turn, where the head's call holds its buffers and no gradient is in flight.
  cfg = TINY.replace(n_layers=8)
  ec = mt.EngineConfig(transport=SlowGradients())
  plan = memory.step_plan(cfg, ec, 2, 8)
  field = "step_start_buffers" if kind == "start" else "turn_buffers"
  without = memory.step_plan(cfg, mt.EngineConfig(**{field: 0}), 2, 8)
  s = plan.schedule
  assert getattr(s, f"{kind}_buffers") == 1 and getattr(s, f"{kind}_positions") > 0
  first = 0 if kind == "start" else s.turn_start
  assert s.limit(first) == s.slots + 1 and without.schedule.limit(first) == s.slots
  assert kind == "start" or s.fetch_order[s.turn_start - 1] == s.head
  assert plan.peak == without.peak
  with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    for seed in range(3):
      eng.step(random_batch(cfg, 2, 8, seed=seed))
    stats = eng.stats()
  assert stats[f"{kind}_buffer_fetches"] > 0
  assert stats["device_peak_bytes"] <= without.peak["total"]


def test_no_start_buffers_without_prefetch():
  # prefetch_depth=0 means each fetch waits for the previous unit's compute: a
  # start (or turn) buffer would let the fetches run one unit ahead of it.
  cfg = TINY.replace(n_layers=8)
  ec = mt.EngineConfig(transport=SlowGradients(), prefetch_depth=0)
  schedule = memory.step_plan(cfg, ec, 2, 8).schedule
  assert schedule.start_buffers == 0 and schedule.turn_buffers == 0
  with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    for s in range(3):
      eng.step(random_batch(cfg, 2, 8, seed=s))
    stats = eng.stats()
  assert stats["start_buffer_fetches"] == 0 and stats["turn_buffer_fetches"] == 0
  assert stats["device_peak_bytes"] <= memory.step_plan(cfg, ec, 2, 8).peak["total"]


@pytest.mark.parametrize("turn", [0, 2])
def test_fetches_ahead_leave_a_fused_tail_its_buffers(turn):
  # The head's update is late (deferred updates run in unit order, the head's last),
  # so the thread fetches the backward's layers ahead while the compute holds the
  # last layer: it must leave the head a slot, or the step waits on itself; also
  # where those layers' positions have a turn buffer the head's does not.
  import threading
  from megatrain_jax.engine.device.ledger import Ledger
  from megatrain_jax.engine.device.prefetch import Prefetcher
  from megatrain_jax.engine.plan.schedule import Schedule
  cfg = TINY.replace(n_layers=4)
  sched = dataclasses.replace(Schedule.build(cfg, mt.EngineConfig()), turn_buffers=1,
                              turn_positions=turn)
  assert sched.fused_tail and sched.tail_needs == {cfg.n_layers + 1: 2}
  head_ready, fetched = threading.Event(), []

  def fetch(u, tag, deadline):
    fetched.append(u)
    return jax.numpy.zeros(4)

  ready = lambda u, tag: u != sched.head or head_ready.is_set()
  pf = Prefetcher(fetch, depth=2, hold=sched.held, ledger=Ledger(), timeout_s=5.0,
                  ready=ready)
  pf.start(sched.fetch_order, 1, sched.limit, sched.start_positions, sched.tail_needs)
  for u in sched.fetch_order[:cfg.n_layers]:
    pf.release(pf.get(u)[1], None)
  pf.get(cfg.n_layers)  # the last layer, held for the head's call
  deadline = time.monotonic() + 5
  while len(fetched) < cfg.n_layers + 2 and time.monotonic() < deadline:
    time.sleep(0.01)  # the thread fetches ahead what it may
  time.sleep(0.3)  # and more, if it may
  head_ready.set()
  pf.wake()  # as the update clock does when an update is done
  pf.get(sched.head)  # a TimeoutError if the fetches ahead took every slot
  assert pf.out_of_order == 1
  pf.close()


def test_the_last_checkpoints_stay_on_the_device_within_the_peak():
  # With the checkpoints in host memory, the last groups' inputs stay on the device
  # as far as the peak with only the last one kept allows: no more, and more than one.
  cfg = TINY.replace(n_layers=8)  # a small head: the peak is in the backward
  plan = lambda k: memory.step_plan(cfg, mt.EngineConfig(activations="host",
                                                         device_checkpoints=k), 4, 16)
  auto, one = plan(None), plan(1)
  k = auto.schedule.device_checkpoints
  assert k == 4
  assert plan(k).peak["total"] == auto.peak["total"] == one.peak["total"]
  assert plan(k + 1).peak["total"] > one.peak["total"]
  ck = 4 * 16 * cfg.d_model * 4
  assert (one.host_checkpoint_bytes, auto.host_checkpoint_bytes) == (7 * ck, (8 - k) * ck)


def test_the_budget_check_and_the_preflight_use_the_same_numbers():
  ec = mt.EngineConfig()
  need = memory.device_bytes(CFG, ec, 4, 16)
  tight = mt.EngineConfig(device_budget_bytes=need["total"] - 1, activations="device")
  with pytest.raises(ValueError, match=r"needs about .* over the device limit"):
    preflight.check_fits(CFG, optax.sgd(0.1), tight, 4, 16)
  with mt.StreamingTrainer.from_config(CFG, optax.sgd(0.1), tight, jax.random.key(0)) as eng:
    with pytest.raises(ValueError, match=r"needs about .* over the device limit"):
      eng.step(random_batch(CFG, 4, 16))
    assert np.isfinite(eng.step(random_batch(CFG, 2, 16))["loss"])  # a smaller batch fits
