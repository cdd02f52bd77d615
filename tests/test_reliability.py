"""Bad input and non-finite steps: each refused or handled with a message naming it."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import train as train_lib
from megatrain_jax.engine.plan import memory, sizes

from conftest import TINY, random_batch


def _same_params(a, b):
  return all(np.array_equal(x, y, equal_nan=True)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _set_master_entry(trainer, unit, value):
  """Sets element 0 of one unit's fp32 master, through the public state interface."""
  snap = trainer.snapshot()
  parts = {k: snap.take(k) for k in snap.keys}
  snap.close()
  parts[trainer.schedule.state_key(unit)]["master"][0] = value
  trainer.restore(lambda key: parts[key], trainer.step_count)


def _nan_at(nth):
  """A gradient hook making the `nth` gradient non-finite where the device makes it
  (per step: 1 = the head's, then the layers from the top down to layer 1, the
  embedding's, layer 0's)."""
  calls = {"n": 0}

  def hook(u, g):
    calls["n"] += 1
    return g * np.float32(np.nan) if calls["n"] == nth else g
  return hook


def _engine(opt, nan_at=None, **kw):
  return mt.StreamingTrainer.from_config(TINY, opt, mt.EngineConfig(**kw), jax.random.key(0),
                                         grad_hook=_nan_at(nan_at) if nan_at else None)


# --- Non-finite loss ---------------------------------------------------------

@pytest.mark.parametrize("opt", [mt.optim.adamw(1e-2), optax.chain(
    optax.clip_by_global_norm(1.0), optax.adam(1e-2))], ids=["per_unit", "whole_tree"])
def test_nan_loss_raises_and_changes_nothing(opt):
  with _engine(opt) as eng:
    _set_master_entry(eng, 1, np.nan)
    before = eng.params()
    with pytest.raises(FloatingPointError, match=r"Non-finite loss nan at step 1\. No "
                                                 r"parameter or optimizer state was changed"):
      eng.step(random_batch(TINY))
    assert _same_params(eng.params(), before)
    assert eng.step_count == 0
    # The trainer is still usable: repair the unit and train on.
    _set_master_entry(eng, 1, 0.0)
    assert np.isfinite(eng.step(random_batch(TINY))["loss"])


def test_nan_loss_skip_counts_the_step():
  with _engine(mt.optim.adamw(1e-2), nonfinite="skip") as eng:
    _set_master_entry(eng, 2, np.nan)
    before = eng.params()
    out = eng.step(random_batch(TINY))
    assert out["skipped"] and np.isnan(out["loss"])
    assert eng.stats()["skipped_steps"] == 1
    assert _same_params(eng.params(), before)


def test_resident_nan_loss_raises_and_changes_nothing():
  model = mt.Llama(TINY, rngs=nnx.Rngs(0))
  tree = model.blocks[0].tree()
  tree["attn"]["q"]["kernel"] = tree["attn"]["q"]["kernel"].at[0, 0].set(np.nan)
  model.blocks[0].set_tree(tree)
  ref = mt.ResidentTrainer(model, optax.adamw(1e-2))
  before = ref.params()
  with pytest.raises(FloatingPointError, match="Non-finite loss .* at step 1. No parameter"):
    ref.step(random_batch(TINY))
  assert _same_params(ref.params(), before) and ref.step_count == 0


# --- Non-finite gradient with a finite loss ---------------------------------

def test_nan_gradient_after_per_unit_updates_invalidates_the_trainer():
  # Gradients arrive head, layer 1, embed, layer 0: poison layer 0's (the 4th).
  with _engine(mt.optim.adamw(1e-2), nan_at=4) as eng:
    with pytest.raises(FloatingPointError) as e:
      eng.step(random_batch(TINY))
      eng.wait()  # the step may return before its last updates ran
    msg = str(e.value)
    assert "Non-finite gradient at step 1" in msg and "first found in layer 0" in msg
    assert "head, layer 1, embed had" in msg and "now invalid" in msg
    with pytest.raises(RuntimeError, match="resume from the last checkpoint"):
      eng.step(random_batch(TINY))


def test_nan_gradient_in_the_first_update_changes_nothing():
  with _engine(mt.optim.adamw(1e-2), nan_at=1) as eng:  # the head's: the first updated
    before = eng.params()
    with pytest.raises(FloatingPointError, match="first found in head. No parameter"):
      eng.step(random_batch(TINY))
    assert _same_params(eng.params(), before) and eng.step_count == 0
    assert np.isfinite(eng.step(random_batch(TINY, seed=1))["loss"])
    assert not _same_params(eng.params(), before)


@pytest.mark.parametrize("opt", [mt.optim.adamw(1e-2), optax.chain(
    optax.clip_by_global_norm(1.0), optax.adam(1e-2))], ids=["per_unit", "whole_tree"])
def test_steps_after_a_refused_step_use_updated_units(opt):
  # A step refused with nothing changed, then training goes on: every later step
  # must fetch each unit after its update, exactly as a run that never met it.
  clean = [random_batch(TINY, seed=s) for s in range(1, 5)]
  with _engine(opt) as ref:
    want = [ref.step(b)["loss"] for b in clean]
    want_params = ref.params()
  with _engine(opt, nan_at=1) as eng:  # the first gradient (the head's) is NaN
    with pytest.raises(FloatingPointError, match="No parameter"):
      eng.step(random_batch(TINY, seed=0))
    assert [eng.step(b)["loss"] for b in clean] == want
    assert _same_params(eng.params(), want_params)


def test_nan_gradient_found_after_the_step_returned_is_raised_by_the_next_call():
  # A slow gradient link: the step returns before layer 0's gradient is on the host.
  with _engine(mt.optim.adamw(1e-2), nan_at=4,  # layer 0's, the last
               transport=mt.SimulatedLink(0.001)) as eng:
    assert np.isfinite(eng.step(random_batch(TINY))["loss"])
    with pytest.raises(FloatingPointError,
                       match=r"step 1 .*layer 0 \(found after the step returned\).*now invalid"):
      eng.step(random_batch(TINY, seed=1))
    with pytest.raises(RuntimeError, match="resume from the last checkpoint"):
      eng.step(random_batch(TINY, seed=2))


@pytest.mark.parametrize("mode", ["skip", "whole_tree", "split_clip"])
def test_nan_gradient_checked_before_any_update(mode):
  opt = {"skip": mt.optim.adamw(1e-2),
         "whole_tree": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
         "split_clip": mt.optim.clip_by_global_norm(1.0, mt.optim.adamw(1e-2))}[mode]
  kw = {"nonfinite": "skip"} if mode == "skip" else {}
  with _engine(opt, nan_at=2, **kw) as eng:
    before = eng.params()
    if mode == "skip":
      assert eng.step(random_batch(TINY))["skipped"]
      assert eng.stats()["skipped_steps"] == 1
    else:
      with pytest.raises(FloatingPointError, match="first found in layer 1. No parameter"):
        eng.step(random_batch(TINY))
    assert _same_params(eng.params(), before)
    assert np.isfinite(eng.step(random_batch(TINY, seed=1))["loss"])  # poisoned once
    assert not _same_params(eng.params(), before)


def test_nan_in_loss_mask_is_refused():
  batch = random_batch(TINY)
  batch["loss_mask"][0, 3] = np.nan
  with _engine(optax.sgd(0.1)) as eng, pytest.raises(ValueError, match="loss_mask.*NaN"):
    eng.step(batch)


# --- Preflight -----------------------------------------------------------------

def test_memory_arithmetic_matches_a_hand_count():
  cfg = mt.LlamaConfig(vocab_size=1000, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                       d_ff=128, max_seq_len=64)
  ec = mt.EngineConfig(compute_dtype="bfloat16")
  block = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q,o + k,v + mlp + 2 norms
  counts = [1000 * 64] + [block] * 3 + [64 + 64 * 1000]
  n = sum(counts)
  assert sizes.unit_sizes(cfg) == counts and n == cfg.param_count()
  host = memory.host_bytes(cfg, optax.adamw(1e-3), ec, on_cpu=False)
  assert host["masters"] == 4 * n
  assert host["optimizer_state"] == 8 * n + 5 * 4  # mu, nu + an int32 count per unit
  assert host["pinned_copies"] == 2 * (n + max(counts))  # kept on an accelerator
  assert memory.host_bytes(cfg, optax.adamw(1e-3), ec, on_cpu=True)["pinned_copies"] == 0
  assert host["gradient_buffers"] == 5 * 4 * max(counts)  # queued between the threads
  clipped = memory.host_bytes(cfg, optax.chain(optax.clip_by_global_norm(1.0),
                                               optax.adamw(1e-3)), ec)
  assert clipped["gradient_buffers"] == 4 * n + 5 * 4 * max(counts)  # + fp32 accumulators
  # The device side is checked against the engine's own ledger in test_memory.py.
  dev = memory.device_bytes(cfg, ec, batch_size=4, seq_len=64)
  assert dev["logits_chunk"] == 2 * 4 * 64 * 1000 * 4


TINY_RUN = mt.preset("tiny")


def _tc(tmp_path, **kw):
  return train_lib.TrainConfig(workdir=str(tmp_path), steps=2, batch_size=4, seq_len=32,
                               max_data_bytes=100_000, progress=False, **kw)


def _no_trainer(monkeypatch):
  def refuse(*a, **k):
    raise AssertionError("the preflight let the run allocate its model")
  monkeypatch.setattr(train_lib, "make_trainer", refuse)


def test_preflight_refuses_a_run_over_host_ram(tmp_path, monkeypatch):
  _no_trainer(monkeypatch)
  with pytest.raises(ValueError) as e:
    train_lib.run(_tc(tmp_path, host_memory_limit_bytes=2**20))
  msg = str(e.value)
  tc = _tc(tmp_path)
  need = (memory.host_bytes(TINY_RUN, train_lib.make_optimizer(tc), tc.engine)["total"]
          + memory.device_bytes(TINY_RUN, tc.engine, 4, 32)["total"])  # CPU backend
  assert f"needs about {need / 2**30:.2f} GiB of host memory" in msg
  assert "masters 0.00, optimizer_state 0.01" in msg and "only 0.00 GiB is available" in msg
  assert "smaller model" in msg


def test_preflight_refuses_a_run_over_the_device_budget(tmp_path, monkeypatch):
  _no_trainer(monkeypatch)
  with pytest.raises(ValueError, match=r"needs about .* GiB of device memory .*over the "
                                       r"device limit .*Lower the batch size"):
    train_lib.run(_tc(tmp_path, engine=mt.EngineConfig(device_budget_bytes=100_000)))


def test_missing_data_file_is_named_before_anything_is_built(tmp_path, monkeypatch):
  _no_trainer(monkeypatch)
  with pytest.raises(FileNotFoundError, match="/no/such/corpus.txt"):
    train_lib.run(_tc(tmp_path, data="/no/such/corpus.txt"))
