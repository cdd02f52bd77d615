import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import data as data_lib
from conftest import TINY, random_batch


def test_loss_decreases_on_stdlib_text(stdlib_windows):
  cfg = TINY.replace(vocab_size=260, max_seq_len=64)
  trainer = mt.ResidentTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), optax.adam(3e-3))
  ds = data_lib.PackedDataset(stdlib_windows, 8, 0)
  losses = [trainer.step(ds.next_batch())["loss"] for _ in range(40)]
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
  assert trainer.step_count == 40


def test_model_is_not_modified_and_params_are_numpy():
  model = mt.Llama(TINY, rngs=nnx.Rngs(0))
  before = model.param_tree()["blocks"][0]["mlp"]["up"]["kernel"].copy()
  trainer = mt.ResidentTrainer(model, optax.sgd(0.1))
  trainer.step(random_batch(TINY))
  np.testing.assert_array_equal(model.param_tree()["blocks"][0]["mlp"]["up"]["kernel"], before)
  p = trainer.params()
  assert isinstance(p["blocks"][0]["mlp"]["up"]["kernel"], np.ndarray)
  assert np.abs(p["blocks"][0]["mlp"]["up"]["kernel"] - before).max() > 0


def test_sgd_step_is_params_minus_lr_grad():
  model = mt.Llama(TINY, rngs=nnx.Rngs(0))
  trainer = mt.ResidentTrainer(model, optax.sgd(0.5))
  batch = random_batch(TINY)
  _, grads = trainer.loss_and_grads(batch)
  before = trainer.params()
  trainer.step(batch)
  after = trainer.params()
  np.testing.assert_allclose(after["head"]["lm_head"]["kernel"],
                             before["head"]["lm_head"]["kernel"]
                             - 0.5 * grads["head"]["lm_head"]["kernel"], atol=1e-6)


def test_remat_matches_plain():
  batch = random_batch(TINY)
  a = mt.ResidentTrainer(mt.Llama(TINY, rngs=nnx.Rngs(0)), optax.adam(1e-3))
  b = mt.ResidentTrainer(mt.Llama(TINY, rngs=nnx.Rngs(0)), optax.adam(1e-3), remat=True)
  for _ in range(2):
    np.testing.assert_allclose(a.step(batch)["loss"], b.step(batch)["loss"], rtol=1e-6)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: {k: v for k, v in b.items() if k != "labels"}, "missing"),
    (lambda b: dict(b, input_ids=np.zeros((2, 40), np.int32),
                    labels=np.zeros((2, 40), np.int32), loss_mask=np.ones((2, 40))), "max_seq_len"),
    (lambda b: dict(b, loss_mask=np.ones((2, 3))), "shape"),
    (lambda b: dict(b, input_ids=b["input_ids"] + 1000), "vocabulary"),
    (lambda b: dict(b, labels=b["labels"].astype(np.float32)), "integer"),
])
def test_bad_batch_is_refused(mutate, message):
  trainer = mt.ResidentTrainer(mt.Llama(TINY, rngs=nnx.Rngs(0)), optax.sgd(0.1))
  with pytest.raises(ValueError, match=message):
    trainer.step(mutate(random_batch(TINY)))
