import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax.models import layers, llama
from conftest import TINY


def _model(cfg=TINY, seed=0):
  return mt.Llama(cfg, rngs=nnx.Rngs(seed))


def test_output_shape_and_dtype():
  ids = jnp.zeros((3, 10), jnp.int32)
  logits = _model()(ids)
  assert logits.shape == (3, 10, TINY.vocab_size)
  assert logits.dtype == jnp.float32


def test_param_count_matches_tree():
  for cfg in (TINY, TINY.replace(tie_embeddings=True, qkv_bias=True)):
    tree = _model(cfg).param_tree()
    n = sum(x.size for x in jax.tree.leaves(tree))
    assert n == cfg.param_count()
  assert "lm_head" not in _model(TINY.replace(tie_embeddings=True)).param_tree()["head"]


def test_causal():
  model = _model()
  rng = np.random.default_rng(0)
  ids = rng.integers(0, TINY.vocab_size, (2, 12)).astype(np.int32)
  changed = ids.copy()
  changed[:, 7:] = (changed[:, 7:] + 5) % TINY.vocab_size
  a, b = np.asarray(model(ids)), np.asarray(model(changed))
  np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
  assert np.abs(a[:, 7:] - b[:, 7:]).max() > 1e-3


def _mha_reference(cfg, p, x, positions):
  """Plain multi-head attention written out: one K/V head per query head."""
  b, t, _ = x.shape
  hd = cfg.head_dim
  q = (x @ p["q"]["kernel"]).reshape(b, t, cfg.n_heads, hd)
  k = (x @ p["k"]["kernel"]).reshape(b, t, cfg.n_heads, hd)
  v = (x @ p["v"]["kernel"]).reshape(b, t, cfg.n_heads, hd)
  q, k = layers.rotary(q, positions, cfg.rope_theta), layers.rotary(k, positions, cfg.rope_theta)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
  return o.reshape(b, t, -1) @ p["o"]["kernel"]


def test_gqa_with_all_kv_heads_is_multi_head_attention():
  cfg = TINY.replace(n_kv_heads=TINY.n_heads)
  p = llama.init_block(cfg, jax.random.key(1))["attn"]
  x = jax.random.normal(jax.random.key(2), (2, 9, cfg.d_model))
  pos = jnp.arange(9)
  np.testing.assert_allclose(layers.attention(cfg, p, x, pos),
                             _mha_reference(cfg, p, x, pos), atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
  cfg = TINY  # 4 query heads, 2 kv heads
  p = llama.init_block(cfg, jax.random.key(1))["attn"]
  x = jax.random.normal(jax.random.key(2), (2, 9, cfg.d_model))
  rep = cfg.n_heads // cfg.n_kv_heads
  hd = cfg.head_dim

  def repeat(kernel):
    w = kernel.reshape(cfg.d_model, cfg.n_kv_heads, hd)
    return jnp.repeat(w, rep, axis=1).reshape(cfg.d_model, cfg.n_heads * hd)

  mha_p = dict(p, k={"kernel": repeat(p["k"]["kernel"])}, v={"kernel": repeat(p["v"]["kernel"])})
  mha_cfg = cfg.replace(n_kv_heads=cfg.n_heads)
  np.testing.assert_allclose(layers.attention(cfg, p, x, jnp.arange(9)),
                             _mha_reference(mha_cfg, mha_p, x, jnp.arange(9)), atol=1e-5)


def test_qkv_bias_is_used():
  cfg = TINY.replace(qkv_bias=True)
  model = _model(cfg)
  ids = jnp.arange(8, dtype=jnp.int32)[None]
  before = np.asarray(model(ids))
  tree = model.param_tree()
  tree["blocks"][0]["attn"]["v"]["bias"] = jnp.ones_like(tree["blocks"][0]["attn"]["v"]["bias"])
  model.load_param_tree(tree)
  assert np.abs(np.asarray(model(ids)) - before).max() > 1e-4


def test_tied_head_uses_embedding():
  cfg = TINY.replace(tie_embeddings=True)
  tree = _model(cfg).param_tree()
  x = jax.random.normal(jax.random.key(0), (1, 4, cfg.d_model))
  logits = llama.logits_apply(cfg, tree["head"], tree["embed"], x)
  h = llama.head_norm(cfg, tree["head"], x)
  np.testing.assert_allclose(logits, h @ tree["embed"]["embedding"].T, atol=1e-5)


def test_bf16_compute_close_to_fp32():
  model = _model()
  ids = jnp.arange(16, dtype=jnp.int32)[None] % TINY.vocab_size
  f32 = np.asarray(model(ids))
  bf16 = np.asarray(llama.forward(TINY, model.param_tree(), ids, jnp.bfloat16))
  assert bf16.dtype == np.float32
  np.testing.assert_allclose(bf16, f32, atol=0.05)


def test_init_is_per_unit_and_seeded():
  a, b = _model(seed=3).param_tree(), _model(seed=3).param_tree()
  jax.tree.map(np.testing.assert_array_equal, a, b)
  base = nnx.Rngs(3).params()
  np.testing.assert_array_equal(
      a["blocks"][1]["mlp"]["up"]["kernel"],
      jax.jit(llama.init_block, static_argnums=0)(
          TINY, llama.unit_key(base, "block", 1))["mlp"]["up"]["kernel"])


@pytest.mark.parametrize("changes, field", [
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(d_model=30, n_heads=4), "n_heads"),
    (dict(d_model=12, n_heads=4, n_kv_heads=2), "odd"),
    (dict(n_layers=0), "n_layers"),
    (dict(d_ff=-1), "d_ff"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(attn_head_dim=0), "attn_head_dim"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=4, layer_types=("full_attention",)), "layer_types"),
    (dict(sliding_window=4, layer_types=("local",) * TINY.n_layers), "layer_types"),
    (dict(layer_types=("sliding_attention",) * TINY.n_layers), "sliding_window is None"),
])
def test_bad_config_names_the_field(changes, field):
  with pytest.raises(ValueError, match=field):
    TINY.replace(**changes)


def test_a_sliding_window_sees_exactly_its_width():
  # Logits at position t depend on ids[t - W + 1 .. t] alone when every layer slides
  # (n_layers = 1 here: one layer's receptive field is its window).
  cfg = TINY.replace(n_layers=1, sliding_window=3)
  model = mt.Llama(cfg, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(0), (1, 12), 0, cfg.vocab_size)
  changed = ids.at[0, 4].set((ids[0, 4] + 1) % cfg.vocab_size)
  moved = np.abs(np.asarray(model(ids) - model(changed))).max(axis=-1)[0]
  assert np.all(moved[:4] == 0) and np.all(moved[4:7] > 0) and np.all(moved[7:] == 0), moved


def test_unknown_preset():
  with pytest.raises(ValueError, match="Unknown model size"):
    mt.preset("huge")


def test_chunked_feed_forward_equals_whole():
  cfg = TINY.replace(mlp_chunk=5)  # not dividing B * T = 26
  p = _model(cfg).param_tree()["blocks"][1]
  x = jax.random.normal(jax.random.key(1), (2, 13, cfg.d_model))
  ct = jax.random.normal(jax.random.key(2), x.shape)
  def value_and_grads(c):
    @jax.jit
    def f(p, x):
      out, vjp = jax.vjp(lambda p, x: llama.block_apply(c, p, x), p, x)
      return out, vjp(ct)
    return f(p, x)
  got, want = value_and_grads(cfg), value_and_grads(TINY)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.abs(np.asarray(g) - np.asarray(w)).max() <= 1e-5 * np.abs(np.asarray(w)).max()
  # The chunks run one at a time: a scan over ceil(26 / chunk) of them.
  hlo = jax.jit(lambda p, x: llama.block_apply(cfg, p, x)).lower(p, x).as_text()
  assert "while" in hlo
