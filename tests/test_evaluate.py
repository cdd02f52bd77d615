"""What a step reports beside its loss, and the forward-only pass.

`grad_norm` is the global norm of the step's gradient before any clip, from both
trainers; `evaluate` is a streamed forward pass that equals the resident trainer's
loss and changes nothing.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import lora
from conftest import TINY, random_batch

BASE = TINY.replace(n_layers=3)
MOE = BASE.replace(d_ff=48, n_experts=4, n_experts_per_tok=2, moe_d_ff=16,
                   moe_layers=(True, False, True), router_aux_loss_coef=0.1)
BATCHES = [random_batch(BASE, batch_size=4, seed=s, mask_fraction=0.3) for s in range(3)]
HELD_OUT = random_batch(BASE, batch_size=4, seed=99, mask_fraction=0.3)

# (model, optimizer, engine config, trainable): per-unit fused, per-unit Optax,
# clipped (norm from the accumulated sums), whole tree, frozen units.
CASES = {
    "fused_accum2": (BASE, lambda: mt.optim.adamw(1e-2), dict(grad_accum=2), None),
    "optax_units": (BASE.replace(tie_embeddings=True), lambda: optax.lion(1e-3), {}, None),
    "clipped_moe": (MOE, lambda: mt.optim.clip_by_global_norm(0.05, mt.optim.adamw(1e-2)),
                    dict(activations="host"), None),
    "whole_tree": (BASE, lambda: optax.chain(optax.clip_by_global_norm(0.05),
                                             optax.adamw(1e-2)), {}, None),
    "lora": (BASE, lambda: optax.adamw(1e-2), {}, nnx.LoRAParam),
}


def _model(cfg, trainable):
  model = mt.Llama(cfg, rngs=nnx.Rngs(0))
  if trainable is nnx.LoRAParam:
    model = lora.apply(model, lora.LoraConfig(rank=2, alpha=4), rngs=nnx.Rngs(1))
  return model


@pytest.mark.parametrize("case", list(CASES))
def test_grad_norm_is_the_resident_gradients_global_norm_before_any_clip(case):
  cfg, tx, ec, trainable = CASES[case]
  ref = mt.ResidentTrainer(_model(cfg, trainable), tx(), trainable=trainable)
  with mt.StreamingTrainer(_model(cfg, trainable), tx(), mt.EngineConfig(**ec),
                           trainable=trainable) as eng:
    for b in BATCHES:
      # The gradient the step applies, at the parameters before it.
      _, grads = ref.loss_and_grads(b)
      want = float(optax.global_norm(grads))
      r, s = ref.step(b), eng.step(b)
      assert r["grad_norm"] == pytest.approx(want, rel=1e-6)
      np.testing.assert_allclose(float(s["grad_norm"]), want, rtol=1e-5)
      assert want > 0.05  # so the clipped cases do clip


@pytest.mark.parametrize("cfg, ec", [
    (BASE, dict(grad_accum=2)),
    (BASE.replace(tie_embeddings=True), dict(activations="host", prefetch_depth=2)),
    (MOE, dict(stream_embed_head=False, recompute="dots")),
], ids=["accum2", "tied_host_activations", "moe_resident_ends_dots"])
def test_evaluate_equals_the_resident_loss_and_changes_nothing(cfg, ec):
  tx = lambda: mt.optim.adamw(1e-2, weight_decay=0.1)
  ref = mt.ResidentTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), tx())
  plain = mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), tx(), mt.EngineConfig(**ec))
  with plain, mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), tx(),
                                  mt.EngineConfig(**ec)) as eng:
    for b in BATCHES:
      got, want = eng.evaluate(HELD_OUT), ref.evaluate(HELD_OUT)
      assert got["tokens"] == want["tokens"] == HELD_OUT["loss_mask"].sum()
      np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
      # Between a step and its next fetches: the pass cancels those and refetches.
      assert eng.step(b)["loss"] == plain.step(b)["loss"]
      ref.step(b)
    # An evaluation moved no parameter and no optimizer state: the trainer that
    # evaluated between its steps is bit for bit the one that never did.
    jax.tree.map(np.testing.assert_array_equal, eng.params(), plain.params())
    a, b = eng.snapshot(), plain.snapshot()
    try:
      for part in eng.state_layout():
        jax.tree.map(np.testing.assert_array_equal, a.take(part), b.take(part))
    finally:
      a.close()
      b.close()
    # The loss of the model alone: a MoE model's load-balancing term is left out.
    np.testing.assert_allclose(eng.evaluate(HELD_OUT)["loss"], ref.evaluate(HELD_OUT)["loss"],
                               rtol=1e-5)
  if cfg.n_experts:
    loss_with_aux, _ = ref.loss_and_grads(HELD_OUT)
    assert loss_with_aux > ref.evaluate(HELD_OUT)["loss"]


def test_both_trainers_are_the_one_interface_the_launcher_uses():
  tx = mt.optim.adamw(1e-3)
  with mt.ResidentTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), tx) as ref, \
      mt.StreamingTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), tx) as eng:
    for trainer in (ref, eng):
      assert isinstance(trainer, mt.Trainer)
      m = trainer.step(BATCHES[0])
      assert {"loss", "tokens", "grad_norm"} <= set(m) and float(m["grad_norm"]) > 0
      trainer.wait()
      assert trainer.stats()["steps"] == trainer.step_count == 1
      assert trainer.stats()["skipped_steps"] == 0
  assert not isinstance(object(), mt.Trainer)


def test_evaluate_refuses_a_bad_batch_and_the_trainer_goes_on():
  with mt.StreamingTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), mt.optim.adamw(1e-3)) as eng:
    bad = dict(HELD_OUT, labels=HELD_OUT["labels"][:, :-1])
    with pytest.raises(ValueError, match="labels"):
      eng.evaluate(bad)
    assert np.isfinite(eng.step(BATCHES[0])["loss"])


def _nan_at(nth):
  """A gradient hook poisoning the nth gradient made (head, layers top down, embed,
  layer 0)."""
  calls = {"n": 0}

  def hook(u, g):
    calls["n"] += 1
    return g * np.float32(np.nan) if calls["n"] == nth else g
  return hook


@pytest.mark.parametrize("tx", [
    lambda: mt.optim.adamw(1e-2),
    lambda: mt.optim.clip_by_global_norm(0.05, mt.optim.adamw(1e-2))],
    ids=["per_unit", "clipped"])
def test_a_retried_or_restored_step_reports_its_own_norm(tx):
  # The norm belongs to the step that applied the gradients, not to its number: a
  # refused step retried, and a trainer restored to an earlier step, number their
  # next step again.
  ref = mt.ResidentTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), tx())
  with mt.StreamingTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), tx(),
                           grad_hook=_nan_at(1)) as eng:  # the head's first gradient
    snap = eng.snapshot()
    parts = {k: snap.take(k) for k in eng.state_layout()}
    snap.close()
    with pytest.raises(FloatingPointError, match="No parameter"):
      eng.step(BATCHES[0])  # refused before any update
    for b in BATCHES[:2]:
      want = float(optax.global_norm(ref.loss_and_grads(b)[1]))
      ref.step(b)
      np.testing.assert_allclose(float(eng.step(b)["grad_norm"]), want, rtol=1e-5)
    eng.restore(lambda k: parts[k], 0)  # back to step 0: steps 1, 2 again
    ref = mt.ResidentTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), tx())
    norms = []
    for b in BATCHES[:2]:
      want = float(optax.global_norm(ref.loss_and_grads(b)[1]))
      ref.step(b)
      norms.append(eng.step(b)["grad_norm"])
      np.testing.assert_allclose(float(norms[-1]), want, rtol=1e-5)
    assert repr(norms[-1]) == repr(float(norms[-1]))


def test_a_late_bad_gradient_makes_the_norm_nan_and_evaluate_raises():
  # A slow link: the step returns before layer 0's gradient (the last) is on the host;
  # its update is refused, so the step's norm is NaN, and a pass that read the
  # half-updated parameters raises as a step would.
  with mt.StreamingTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), mt.optim.adamw(1e-2),
                           mt.EngineConfig(transport=mt.SimulatedLink(0.001)),
                           grad_hook=_nan_at(BASE.n_layers + 2)) as eng:
    m = eng.step(BATCHES[0])
    assert repr(m["grad_norm"]) in ("LateNorm(pending)", "nan")  # repr does not wait
    assert np.isnan(float(m["grad_norm"]))
    with pytest.raises(FloatingPointError, match="found after the step returned"):
      eng.evaluate(HELD_OUT)
