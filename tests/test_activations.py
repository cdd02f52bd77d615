"""Activation checkpoints in host memory: the same step, a device peak flat in depth."""

import dataclasses
import threading
import time

import jax
import numpy as np
import optax
import pytest

import megatrain_jax as mt
from megatrain_jax import planner
from megatrain_jax.engine.plan import memory, sizes
from megatrain_jax.engine.device import residuals
from megatrain_jax.engine.device import transport as transport_lib

from conftest import TINY, random_batch

# Activations outweigh a layer's parameters: 4 x 64 tokens x 32 x 4 B = 32 KiB each.
CFG = TINY.replace(max_seq_len=64)


def _train(cfg, steps=3, grad_hook=None, **kw):
  ec = mt.EngineConfig(**kw)
  with mt.StreamingTrainer.from_config(cfg, optax.adamw(1e-2), ec, jax.random.key(0),
                                       grad_hook=grad_hook) as eng:
    losses = [eng.step(random_batch(cfg, 4, 64, seed=s))["loss"] for s in range(steps)]
    return losses, eng.params(), eng.stats()


@pytest.mark.parametrize("kw", [dict(checkpoint_every=1, device_checkpoints=1),
                                dict(checkpoint_every=2, grad_accum=2, device_checkpoints=1),
                                dict(checkpoint_every=1)],
                         ids=["every_layer", "groups_accum", "last_ones_kept"])
def test_host_checkpoints_give_the_same_step_bit_for_bit(kw):
  cfg = CFG.replace(n_layers=5)
  alive = []  # activation-shaped arrays in device memory when the head's gradient leaves

  def at_the_head(u, g):
    if u == cfg.n_layers + 1:
      shape = (4 // kw.get("grad_accum", 1), 64, cfg.d_model)
      alive.append(sum(1 for a in jax.live_arrays()
                       if a.shape == shape and a.sharding.memory_kind == "device"))
    return g
  want_losses, want, _ = _train(cfg, 2, at_the_head, activations="device", **kw)
  got_losses, got, stats = _train(cfg, 2, at_the_head, activations="host", **kw)
  assert got_losses == want_losses
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  assert stats["activations"] == "host"
  groups = -(-5 // kw["checkpoint_every"])
  act = 4 // kw.get("grad_accum", 1) * 64 * cfg.d_model * 4
  # All but the last group's input went out (or all but the last few that fit within
  # the peak, by default) and came back, every micro-batch.
  sent = stats["host_checkpoint_groups"]
  # By default 3 of the 5 inputs fit within the peak here.
  assert sent == groups - kw.get("device_checkpoints", 3)
  moved = 2 * kw.get("grad_accum", 1) * sent * act
  assert stats["activation_bytes_moved"] == {"d2h": moved, "h2d": moved}
  assert stats["host_activation_peak_bytes"] == sent * act
  # Every checkpoint sent has left the device by the first step's head (nothing holds
  # it there; later heads may still see the arrays of the micro-batch before).
  assert alive[0] - alive[len(alive) // 2] == sent


def test_the_device_peak_is_flat_in_depth():
  act = 4 * 64 * CFG.d_model * 4
  peaks = {}
  for where in ("device", "host"):
    for n in (4, 10):
      peaks[where, n] = _train(CFG.replace(n_layers=n), steps=1, activations=where)[2][
          "device_peak_bytes"]
  assert peaks["device", 10] - peaks["device", 4] >= 5 * act  # one checkpoint per layer
  # At most one activation apart (the one a checkpoint coming in while gradients wait
  # for the link may add, which the shallow model's step need not reach), where
  # the device's checkpoints add six.
  assert abs(peaks["host", 10] - peaks["host", 4]) <= act
  assert peaks["host", 10] <= peaks["device", 10] - 5 * act


def test_auto_sends_them_to_the_host_when_the_device_is_too_small():
  cfg = CFG.replace(n_layers=8)
  on_device = memory.device_bytes(cfg, mt.EngineConfig(activations="device"), 4, 64)
  on_host = memory.device_bytes(cfg, mt.EngineConfig(activations="host"), 4, 64)
  budget = (on_device["total"] + on_host["total"]) // 2
  ec = mt.EngineConfig(device_budget_bytes=budget)
  assert memory.step_plan(cfg, ec, 4, 64).activations == "host"
  assert memory.step_plan(cfg, ec, 1, 64).activations == "device"  # a small batch fits
  fixed = mt.EngineConfig(device_budget_bytes=budget, activations="device")
  with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), fixed, jax.random.key(0)) as eng:
    with pytest.raises(ValueError, match="device_budget_bytes"):
      eng.step(random_batch(cfg, 4, 64))
  losses, _, stats = _train(cfg, steps=2, device_budget_bytes=budget)
  assert stats["activations"] == "host" and stats["device_peak_bytes"] <= budget
  # The planner decides the same for a device of that size.
  hw = dataclasses.replace(planner.PROFILES["h100_pcie"], device_bytes=budget,
                           flash_attention=False)
  assert planner.plan(cfg, optax.sgd(0.1), mt.EngineConfig(), hw, 4, 64).activations == "host"
  assert planner.plan(cfg, optax.sgd(0.1), mt.EngineConfig(), hw, 1, 64).activations == "device"


class _Broken(transport_lib.DeviceTransport):
  """The activation path fails on the way down (the last checkpoint sent, whose
  copy nothing in the forward waits for), or on the way back up."""

  def __init__(self, way):
    super().__init__()
    self.way, self.sent = way, 0

  def offload(self, device_array):
    self.sent += 1
    if self.way == "down" and self.sent == 2:
      raise OSError("pinned host memory exhausted")
    return super().offload(device_array)

  def reload(self, host_array):
    if self.way == "up":
      raise OSError("the link went away")
    return super().reload(host_array)


@pytest.mark.parametrize("way, message", [("down", "pinned host memory exhausted"),
                                          ("up", "the link went away")])
def test_a_failed_transfer_is_raised_in_the_caller_and_stops_the_thread(way, message):
  ec = mt.EngineConfig(activations="host", transport=_Broken(way), timeout_s=10,
                       device_checkpoints=1)
  sent = []  # units whose gradient left the device
  eng = mt.StreamingTrainer.from_config(CFG.replace(n_layers=3), optax.sgd(0.1), ec,
                                        jax.random.key(0),
                                        grad_hook=lambda u, g: sent.append(u) or g)
  t0 = time.monotonic()
  with pytest.raises(OSError, match=message):
    eng.step(random_batch(CFG, 4, 64))
  assert time.monotonic() - t0 < 10
  if way == "down":  # raised before any gradient left: nothing was updated
    assert sent == []
  eng.close()
  assert not any(t.name == "megatrain-activations" and t.is_alive()
                 for t in threading.enumerate())


WIDE = mt.LlamaConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                      d_ff=256, max_seq_len=128)


@pytest.mark.parametrize("recompute", ["full", "dots"])
def test_sixteen_layers_peak_near_four_and_the_bytes_moved_are_the_formula(recompute):
  # Per step: the parameters fetched (each layer twice), the batch, every gradient
  # once, and each checkpoint down and up once.
  peaks = {}
  for n in (4, 16):
    cfg = WIDE.replace(n_layers=n)
    ec = mt.EngineConfig(activations="host", recompute=recompute)
    batch = random_batch(cfg, 8, 128)
    with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
      eng.step(batch)
      eng.step(batch)
      stats = eng.stats()
    peaks[n] = stats["device_peak_bytes"]
    last, sched = stats["last_step"], memory.step_plan(cfg, ec, 8, 128).schedule
    # Every checkpoint but the last layers' (those that fit within the peak) goes
    # down once and comes up once: the block input, with its kept matmul outputs
    # for "dots".
    ckpt = 8 * 128 * 128 * 4 + sizes.kept_bytes(cfg, 0, recompute, 8, 128, "float32")
    assert ckpt <= sizes.checkpoint_bytes(cfg, ec, 8, 128)  # the model's bound
    # Within the peak: 3 with full recompute, 1 with the larger "dots" checkpoints.
    sent = n - {"full": 3, "dots": 1}[recompute]
    assert sent == stats["host_checkpoint_groups"] == len(sched.host_groups())
    assert last["activation_bytes"] == {"d2h": sent * ckpt, "h2d": sent * ckpt}
    assert last["h2d_bytes"] == (sched.fetched_bytes(sizes.unit_param_bytes(cfg, ec))
                                 + sum(v.nbytes for v in batch.values()))
    assert last["d2h_bytes"] == sum(sizes.unit_grad_bytes(cfg, ec))
  assert peaks[16] <= 1.15 * peaks[4], peaks


def test_kept_residuals_hold_activations_not_weights():
  # One layer's weights (0.6 MB, the smallest kernel 32 KiB) against 2 tokens of
  # activations (1 KiB each): a kept weight would pass the bound.
  layer = sizes.unit_param_bytes(WIDE, mt.EngineConfig())[1]
  for recompute in ("dots", "none"):
    kept = sizes.kept_bytes(WIDE, 0, recompute, 1, 2, "float32")
    assert 0 < kept < layer / 20, (recompute, kept, layer)
  assert sizes.kept_bytes(WIDE, 0, "full", 1, 2, "float32") == 0


def test_recompute_none_keeps_one_score_sized_array_per_head():
  # What grows with T^2 is the attention's: with c bytes per head and query-key pair,
  # kept(T) - 2 kept(2T) + kept(3T) = 2 c T^2 (the constant and linear terms cancel).
  # The probabilities alone are 4 bytes (fp32); the exp, the mask and a zeros array
  # would add 9 more.
  t = 32
  kept = lambda n: sizes.kept_bytes(WIDE, 0, "none", 1, n, "float32")
  per_pair = (kept(t) - 2 * kept(2 * t) + kept(3 * t)) / (2 * t * t)
  assert per_pair == WIDE.n_heads * 4, per_pair


def test_residuals_that_do_not_match_the_forward_are_refused():
  spec = mt.engine.FlatSpec(mt.models.llama.abstract_units(WIDE)[1])
  flat = jax.numpy.zeros((spec.size,), jax.numpy.float32)
  x = jax.numpy.ones((1, 4, WIDE.d_model), jax.numpy.float32)
  y, _, kept, layout = residuals.forward(WIDE, spec, None, "dots", flat, x, None, None)
  g_flat, g_x = residuals.backward(spec, layout, flat, x, kept, y, None)
  assert g_flat.shape == flat.shape and g_x.shape == x.shape
  with pytest.raises(ValueError, match="recompute='full'"):
    residuals.backward(spec, layout, flat, x, kept[::-1], y, None)


def test_a_forward_given_buffers_writes_its_residuals_into_them():
  cfg = CFG.replace(n_layers=1)
  ec = mt.EngineConfig(recompute="none")
  with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    t = eng.templates
    flat = eng.transport.h2d_cast(eng.host_optimizer.store.fetch_parts(1), jax.numpy.float32)
    x = jax.random.normal(jax.random.key(1), (2, 64, cfg.d_model))
    shapes = t.kept_shapes(flat, x, 0)
    reuse = tuple(jax.numpy.zeros(s.shape, s.dtype) for s in shapes)
    where = sorted(a.unsafe_buffer_pointer() for a in reuse)
    y, _, kept = t.block_fwd_keep(flat, x, 0, reuse=reuse)
    assert all(a.is_deleted() for a in reuse)  # donated
    assert sorted(a.unsafe_buffer_pointer() for a in (y, *kept)) == where
    y0, _, kept0 = t.block_fwd_keep(flat, x, 0, reuse=tuple(
        jax.numpy.zeros(s.shape, s.dtype) for s in shapes))
    for a, b in zip((y, *kept), (y0, *kept0)):
      np.testing.assert_array_equal(a, b)


def test_the_cpu_backend_step_reuses_the_residual_buffers_of_the_step_before():
  # Every device buffer is a fresh allocation on the CPU backend; with recompute
  # "none" the layers' inputs and residuals are written into last step's buffers,
  # which wait on the device between steps (and the ledger counts them).
  cfg = CFG.replace(n_layers=3)
  ec = mt.EngineConfig(recompute="none")
  ck = 4 * 64 * cfg.d_model * 4 + sizes.kept_bytes(cfg, 0, "none", 4, 64, "float32")
  with mt.StreamingTrainer.from_config(cfg, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    kept = []
    for s in range(3):
      eng.step(random_batch(cfg, 4, 64, seed=s))
      eng.wait()
      kept.append({a.unsafe_buffer_pointer(): a.nbytes for a in jax.live_arrays()
                   if not a.is_deleted() and a.sharding.memory_kind == "device"})
      assert eng.stats()["device_bytes"] >= cfg.n_layers * ck
  same = sum(n for p, n in kept[2].items() if kept[1].get(p) == n)
  assert same >= cfg.n_layers * ck, (same, ck)
