"""The policy-gradient loss in both trainers, and `trainer.logprobs`.

`StreamingTrainer(..., loss=mt.rl.PolicyLoss(...))` must equal `ResidentTrainer` with
the same loss: loss and metrics per step, parameters after three steps; and
`logprobs` must equal the resident model's and change nothing.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import lora

CFG = mt.LlamaConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                     d_ff=64, max_seq_len=32)


def _batch(cfg, b=4, t=12, seed=0):
  """A policy batch: random completions, a ragged mask (one row empty of completion
  tokens but the first), per-token advantages."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  mask = (rng.random((b, t)) > 0.3).astype(np.float32)
  mask[-1] = 0.0
  mask[-1, 0] = 1.0
  return {"input_ids": ids, "labels": np.roll(ids, -1, 1), "loss_mask": mask,
          "advantages": rng.normal(size=(b, t)).astype(np.float32)}


def _with_policies(batch, logprobs, seed=1):
  """Old and reference log-probs a little away from the current ones, so that the
  ratio clips on both sides and the KL is not zero."""
  rng = np.random.default_rng(seed)
  noise = lambda: rng.normal(scale=0.4, size=logprobs.shape).astype(np.float32)
  return {**batch, "old_logprobs": logprobs + noise(), "ref_logprobs": logprobs + noise()}


def _model(cfg, lora_config=None):
  model = mt.Llama(cfg, rngs=nnx.Rngs(0))
  return model if lora_config is None else lora.apply(model, lora_config, rngs=nnx.Rngs(7))


def _leaf_close(got, want, rel=1e-4):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=rel * max(np.abs(w).max(), 1e-6))


@pytest.mark.parametrize("policy, ec, cfg, lora_config", [
    (mt.rl.PolicyLoss(kl_coef=0.05), dict(grad_accum=2), CFG, None),
    (mt.rl.PolicyLoss(clip_eps_high=0.28, aggregation="token_mean"), dict(), CFG, None),
    (mt.rl.PolicyLoss(kl_coef=0.1, aggregation="constant", max_tokens=16),
     dict(grad_accum=2, recompute="dots"), CFG.replace(tie_embeddings=True), None),
    (mt.rl.PolicyLoss(kl_coef=0.05), dict(grad_accum=2), CFG,
     lora.LoraConfig(rank=4, alpha=8)),
], ids=["grpo-kl-accum2", "dapo", "dr-grpo-tied-dots", "grpo-lora"])
def test_streaming_policy_loss_equals_resident(policy, ec, cfg, lora_config):
  trainable = None if lora_config is None else nnx.LoRAParam
  ref = mt.ResidentTrainer(_model(cfg, lora_config), optax.adam(1e-2), loss=policy,
                           trainable=trainable)
  batch = _with_policies(_batch(cfg), ref.logprobs(_batch(cfg)))
  with mt.StreamingTrainer(_model(cfg, lora_config), optax.adam(1e-2),
                           mt.EngineConfig(**ec), loss=policy, trainable=trainable) as eng:
    clipped = []
    for _ in range(3):
      want, got = ref.step(batch), eng.step(batch)
      for k in ("loss", "clip_fraction", "entropy", "kl"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
      np.testing.assert_allclose(float(got["grad_norm"]), want["grad_norm"], rtol=1e-4)
      clipped.append(got["clip_fraction"])
    assert max(clipped) > 0  # the clip binds somewhere, so its branch is exercised
    _leaf_close(eng.params(), ref.params())


def test_aggregations_differ_and_kl_is_reported_only_with_a_reference():
  """A loss whose aggregation were ignored would give one value for all three."""
  batch = _batch(CFG)
  values = {}
  for agg in mt.rl.AGGREGATIONS:
    ref = mt.ResidentTrainer(_model(CFG), optax.sgd(0.0),
                             loss=mt.rl.PolicyLoss(aggregation=agg))
    out = ref.evaluate(batch)
    assert "kl" not in out and 0 < out["entropy"] <= np.log(CFG.vocab_size) + 1e-5
    values[agg] = out["loss"]
  assert len({round(v, 6) for v in values.values()}) == 3, values


def test_logprobs_equal_the_resident_model_and_change_nothing():
  batch = _batch(CFG)
  model = _model(CFG)
  logits = np.asarray(model(batch["input_ids"]), np.float64)
  want = (np.take_along_axis(logits, batch["labels"][..., None], -1)[..., 0]
          - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
          - logits.max(-1))
  ref = mt.ResidentTrainer(_model(CFG), optax.adam(1e-2))
  np.testing.assert_allclose(ref.logprobs(batch), want, atol=1e-5)
  plain = {k: batch[k] for k in ("input_ids", "labels", "loss_mask")}
  with mt.StreamingTrainer(_model(CFG), optax.adam(1e-2), mt.EngineConfig(grad_accum=2)) as a, \
       mt.StreamingTrainer(_model(CFG), optax.adam(1e-2), mt.EngineConfig(grad_accum=2)) as b:
    a.step(plain)
    b.step(plain)
    got = a.logprobs(batch)  # between steps, with the policy keys present
    assert got.shape == (4, 12) and got.dtype == np.float32
    unmasked = {**plain, "loss_mask": np.zeros_like(plain["loss_mask"])}
    np.testing.assert_array_equal(a.logprobs(unmasked), got)  # the mask plays no part
    ref.step(plain)
    np.testing.assert_allclose(got, ref.logprobs(batch), atol=1e-5)
    # The trainer that scored log-probs steps on exactly as the one that did not.
    assert a.step(plain)["loss"] == b.step(plain)["loss"]
    for x, y in zip(jax.tree.leaves(a.params()), jax.tree.leaves(b.params())):
      np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("make", [
    lambda: mt.ResidentTrainer(_model(CFG), optax.sgd(0.1)),
    lambda: mt.StreamingTrainer(_model(CFG), optax.sgd(0.1)),
], ids=["resident", "streaming"])
def test_the_batch_must_suit_the_loss(make):
  trainer = make()
  with pytest.raises(ValueError, match="only a policy-gradient loss reads"):
    trainer.step(_batch(CFG))
  trainer.close()
  policy = mt.rl.PolicyLoss(kl_coef=0.1)
  for trainer in (mt.ResidentTrainer(_model(CFG), optax.sgd(0.1), loss=policy),
                  mt.StreamingTrainer(_model(CFG), optax.sgd(0.1), loss=policy)):
    no_adv = {k: v for k, v in _batch(CFG).items() if k != "advantages"}
    with pytest.raises(ValueError, match="advantages"):
      trainer.step(no_adv)
    with pytest.raises(ValueError, match="ref_logprobs"):
      trainer.step(_batch(CFG))
    bad = {**_batch(CFG), "ref_logprobs": np.full((4, 12), np.nan, np.float32)}
    with pytest.raises(ValueError, match="ref_logprobs.*NaN"):
      trainer.step(bad)
    trainer.close()


def test_a_lora_policy_scores_its_frozen_base_as_the_reference():
  """logprobs(adapters=False) is the base model's, in both trainers, and stays so
  while the adapters train."""
  lc = lora.LoraConfig(rank=4, alpha=8)
  batch = _batch(CFG)
  base = mt.ResidentTrainer(_model(CFG), optax.sgd(0.0)).logprobs(batch)
  policy = mt.rl.PolicyLoss()
  ref = mt.ResidentTrainer(_model(CFG, lc), optax.adam(1e-2), loss=policy,
                           trainable=nnx.LoRAParam)
  with mt.StreamingTrainer(_model(CFG, lc), optax.adam(1e-2), mt.EngineConfig(),
                           loss=policy, trainable=nnx.LoRAParam) as eng:
    for _ in range(2):
      ref.step(batch)
      eng.step(batch)
    for trainer in (ref, eng):
      np.testing.assert_allclose(trainer.logprobs(batch, adapters=False), base, atol=1e-5)
      assert np.abs(trainer.logprobs(batch) - base).max() > 1e-3  # the adapters moved
    np.testing.assert_allclose(eng.logprobs(batch), ref.logprobs(batch), atol=1e-5)


def test_masked_tokens_cannot_overflow_the_loss():
  """Log-probs far out on masked tokens (pads, prompts) change nothing: the log-ratio
  of a masked token is never exponentiated."""
  policy = mt.rl.PolicyLoss(kl_coef=0.1)
  ref = mt.ResidentTrainer(_model(CFG), optax.adam(1e-2), loss=policy)
  sane = _with_policies(_batch(CFG), ref.logprobs(_batch(CFG)))
  wild = {k: v.copy() for k, v in sane.items()}
  off = sane["loss_mask"] == 0
  wild["old_logprobs"][off], wild["ref_logprobs"][off] = -1e4, 1e4
  want = ref.evaluate(sane)
  assert np.isfinite(want["loss"]) and ref.evaluate(wild) == want
  with mt.StreamingTrainer(_model(CFG), optax.adam(1e-2), mt.EngineConfig(grad_accum=2),
                           loss=policy) as a, \
       mt.StreamingTrainer(_model(CFG), optax.adam(1e-2), mt.EngineConfig(grad_accum=2),
                           loss=policy) as b:
    got, base = a.step(wild), b.step(sane)
    assert "skipped" not in got and got["loss"] == base["loss"]
    assert float(got["grad_norm"]) == float(base["grad_norm"])
