import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax.models import llama, loss
from conftest import TINY, random_batch


def _unchunked(cfg, params, batch):
  logits = llama.forward(cfg, params, batch["input_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
  return jnp.sum(ce * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 7, 32])
def test_chunked_loss_and_grads_equal_unchunked(tied, chunk):
  cfg = TINY.replace(tie_embeddings=tied)
  params = mt.Llama(cfg, rngs=nnx.Rngs(0)).param_tree()
  batch = {k: jnp.asarray(v) for k, v in random_batch(cfg, 2, 16, mask_fraction=0.3).items()}
  ref, ref_g = jax.jit(jax.value_and_grad(lambda p: _unchunked(cfg, p, batch)))(params)
  got, got_g = jax.jit(jax.value_and_grad(
      lambda p: loss.model_loss(cfg, p, batch, chunk_tokens=chunk)))(params)
  np.testing.assert_allclose(got, ref, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got_g, ref_g)


def test_mask_excludes_tokens():
  params = mt.Llama(TINY, rngs=nnx.Rngs(0)).param_tree()
  batch = random_batch(TINY, 1, 8)
  half = dict(batch, loss_mask=np.concatenate([np.ones((1, 4)), np.zeros((1, 4))], 1))
  changed = dict(half, labels=np.concatenate([half["labels"][:, :4],
                                              (half["labels"][:, 4:] + 1) % TINY.vocab_size], 1))
  a = loss.model_loss(TINY, params, half)
  b = loss.model_loss(TINY, params, changed)
  assert float(a) == float(b)


def test_default_chunk_bounds_logits_bytes():
  assert loss.default_chunk_tokens(128_000, 1 << 20) * 4 * 128_000 <= loss.DEFAULT_LOGITS_CHUNK_BYTES
  assert loss.default_chunk_tokens(260, 100) == 100
