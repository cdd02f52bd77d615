import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megatrain_jax import optim


@pytest.mark.parametrize("lr", [1e-3, optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fused_adamw_is_optax_adamw_bit_for_bit(lr, wd):
  tx = optim.adamw(lr, b1=0.8, b2=0.95, eps=1e-7, weight_decay=wd)
  ref = optax.adamw(lr, b1=0.8, b2=0.95, eps=1e-7, weight_decay=wd)
  rng = np.random.default_rng(0)
  p = jnp.asarray(rng.standard_normal(1000), jnp.float32)
  p_ref, s_ref, s = p, ref.init(p), tx.init(p)
  fused = jax.jit(lambda p, g, s: optim.fused_adamw_update(tx.hyper, p, g, s))

  @jax.jit
  def stock(p, g, s):
    u, s = ref.update(g, s, p)
    return optax.apply_updates(p, u), s

  for _ in range(5):
    g = jnp.asarray(rng.standard_normal(1000), jnp.float32)
    p, s = fused(p, g, s)
    p_ref, s_ref = stock(p_ref, g, s_ref)
    np.testing.assert_array_equal(p, p_ref)
    jax.tree.map(np.testing.assert_array_equal, s, s_ref)


def test_adamw_is_an_optax_transform():
  tx = optim.adamw(1e-3)
  chained = optax.chain(optax.clip_by_global_norm(1.0), tx)
  params = {"w": jnp.ones(3)}
  updates, _ = chained.update({"w": jnp.ones(3)}, chained.init(params), params)
  assert updates["w"].shape == (3,)
