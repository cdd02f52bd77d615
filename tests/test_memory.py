"""The device-memory model (`engine.memory.step_plan`) against the engine's own ledger."""

import time

import jax
import numpy as np
import optax
import pytest

import megatrain_jax as mt
from megatrain_jax.engine.plan import memory, preflight
from megatrain_jax.engine.device import transport as transport_lib

from conftest import TINY, SlowGradients, random_batch


class _SlowActivations(transport_lib.DeviceTransport):
  """Checkpoints take 30 ms each way: the forward outruns their copies out."""

  def offload(self, device_array):
    time.sleep(0.03)
    return super().offload(device_array)

  def reload(self, host_array):
    time.sleep(0.03)
    return super().reload(host_array)


class _SlowBoth(SlowGradients, _SlowActivations):
  """A full gradient queue while the checkpoints move."""


CFG = TINY.replace(n_layers=4, vocab_size=512)
CASES = {
    "default": (CFG, {}),
    "no_prefetch": (CFG, dict(prefetch_depth=0)),
    "slow_link": (CFG, dict(transport="slow")),
    "slow_link_tied": (CFG.replace(tie_embeddings=True), dict(transport="slow")),
    "slow_link_groups": (CFG, dict(transport="slow", checkpoint_every=2)),
    "slow_link_resident_ends": (CFG, dict(transport="slow", stream_embed_head=False)),
    "slow_link_accum_tied": (CFG.replace(tie_embeddings=True),
                             dict(transport="slow", grad_accum=2)),
    "host_activations_slow": (CFG.replace(n_layers=6), dict(transport="slow_activations",
                                                            activations="host")),
    "kept_matmuls_host_slow": (CFG.replace(n_layers=6), dict(
        transport="slow_activations", activations="host", recompute="dots")),
    "kept_residuals_slow_link": (CFG, dict(transport="slow", recompute="none")),
    "host_activations_last_kept_slow": (TINY.replace(n_layers=8), dict(
        transport="slow_both", activations="host", checkpoint_every=2, grad_accum=2)),
}
TRANSPORTS = {"slow": SlowGradients, "slow_activations": _SlowActivations,
              "slow_both": _SlowBoth}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_ledger_never_passes_the_model(name):
  cfg, kw = CASES[name]
  slow = kw.get("transport") in ("slow", "slow_both")
  ec = mt.EngineConfig(**{**kw, "transport": TRANSPORTS[kw["transport"]]()
                          if "transport" in kw else None})
  with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    for s in range(3):
      eng.step(random_batch(cfg, 4, 16, seed=s))
    measured = eng.stats()["device_peak_bytes"]
  predicted = memory.step_plan(cfg, ec, 4, 16).peak["total"]
  assert measured <= predicted
  if slow:  # the worst case the model assumes happens: the bound is tight
    assert measured >= 0.75 * predicted, (measured, predicted)
  assert memory.device_bytes(cfg, ec, 4, 16)["total"] >= predicted


def test_start_buffers_stay_within_the_peak_without_them():
  # Small activations, a deep model: one more buffer at a step's start fits.
  cfg = TINY.replace(n_layers=8)
  ec = mt.EngineConfig(transport=SlowGradients())
  plan = memory.step_plan(cfg, ec, 2, 8)
  without = memory.step_plan(cfg, mt.EngineConfig(step_start_buffers=0), 2, 8)
  assert plan.schedule.start_buffers == 1 and plan.schedule.start_positions > 0
  assert plan.peak == without.peak
  with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    for s in range(3):
      eng.step(random_batch(cfg, 2, 8, seed=s))
    stats = eng.stats()
  assert stats["start_buffer_fetches"] > 0
  assert stats["device_peak_bytes"] <= without.peak["total"]


def test_no_start_buffers_without_prefetch():
  # prefetch_depth=0 means each fetch waits for the previous unit's compute: a
  # start buffer would let the forward's fetches run one unit ahead of it.
  cfg = TINY.replace(n_layers=8)
  ec = mt.EngineConfig(transport=SlowGradients(), prefetch_depth=0)
  assert memory.step_plan(cfg, ec, 2, 8).schedule.start_buffers == 0
  with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    for s in range(3):
      eng.step(random_batch(cfg, 2, 8, seed=s))
    stats = eng.stats()
  assert stats["start_buffer_fetches"] == 0
  assert stats["device_peak_bytes"] <= memory.step_plan(cfg, ec, 2, 8).peak["total"]


def test_fetches_ahead_leave_a_fused_tail_its_buffers():
  # The head's update is late (deferred updates run in unit order, the head's last),
  # so the thread fetches the backward's layers ahead while the compute holds the
  # last layer: it must leave the head a slot, or the step waits on itself.
  import threading
  from megatrain_jax.engine.device.ledger import Ledger
  from megatrain_jax.engine.device.prefetch import Prefetcher
  from megatrain_jax.engine.plan.schedule import Schedule
  from megatrain_jax.engine.execute import start_fetches
  cfg = TINY.replace(n_layers=4)
  sched = Schedule.build(cfg, mt.EngineConfig())
  assert sched.fused_tail and sched.tail_needs == {cfg.n_layers + 1: 2}
  head_ready, fetched = threading.Event(), []

  def fetch(u, tag, deadline, stop):
    fetched.append(u)
    return jax.numpy.zeros(4)

  ready = lambda u, tag: u != sched.head or head_ready.is_set()
  pf = Prefetcher(fetch, depth=2, hold=sched.held, ledger=Ledger(), timeout_s=5.0,
                  ready=ready)
  start_fetches(pf, sched, 1)
  for u in sched.fetch_order[:cfg.n_layers]:
    pf.release(pf.get(u)[1], None)
  pf.get(cfg.n_layers)  # the last layer, held for the head's call
  deadline = time.monotonic() + 5
  while len(fetched) < cfg.n_layers + 2 and time.monotonic() < deadline:
    time.sleep(0.01)  # the thread fetches ahead what it may
  time.sleep(0.3)  # and more, if it may
  head_ready.set()
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
