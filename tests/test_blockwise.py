"""Blockwise and dense attention against `jax.nn.dot_product_attention`, values and
gradients (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax.models.blockwise import blockwise_attention
from megatrain_jax.models.layers import dense_attention


def _reference(q, k, v, segment_ids=None, window=None):
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True,
      local_window_size=None if window is None else (window - 1, 0))


def _inputs(b, t, h, g, d, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, h, d))
  k = jax.random.normal(ks[1], (b, t, g, d))
  v = jax.random.normal(ks[2], (b, t, g, d))
  do = jax.random.normal(ks[3], (b, t, h, d))
  return q, k, v, do


def _close(got, want, rel=1e-5):
  got, want = np.asarray(got), np.asarray(want)
  assert np.abs(got - want).max() <= rel * np.abs(want).max(), np.abs(got - want).max()


def _segments(b, t, seed=0):
  rng = np.random.default_rng(seed)
  out = np.zeros((b, t), np.int32)
  for row in out:  # 2-4 documents of random lengths, then padding (segment 0 too)
    cuts = np.sort(rng.choice(np.arange(1, t), size=rng.integers(1, 4), replace=False))
    for s, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, t])):
      row[lo:hi] = s + 1
  return jnp.asarray(out)


@pytest.mark.parametrize("name, shape, blocks, window, segments", [
    ("causal_mha", (2, 32, 4, 4, 8), (8, 8), None, False),
    ("gqa", (2, 32, 8, 2, 8), (8, 16), None, False),
    ("t_not_a_multiple", (1, 37, 4, 2, 16), (8, 16), None, False),
    ("single_block", (2, 19, 4, 2, 8), (64, 64), None, False),
    ("sliding_window", (2, 40, 4, 2, 8), (8, 8), 11, False),
    ("segments", (2, 45, 6, 3, 8), (16, 8), None, True),
    ("segments_window", (2, 33, 4, 1, 8), (8, 8), 6, True),
])
def test_equals_dot_product_attention(name, shape, blocks, window, segments):
  b, t, h, g, d = shape
  q, k, v, do = _inputs(b, t, h, g, d)
  seg = _segments(b, t) if segments else None
  f = lambda q, k, v: blockwise_attention(q, k, v, segment_ids=seg, window=window,
                                          block_q=blocks[0], block_k=blocks[1])
  ref = lambda q, k, v: _reference(q, k, v, seg, window)
  out, vjp = jax.vjp(f, q, k, v)
  want, ref_vjp = jax.vjp(ref, q, k, v)
  _close(out, want)
  for got_g, want_g in zip(vjp(do), ref_vjp(do)):
    _close(got_g, want_g)


@pytest.mark.parametrize("shape, window, segments", [
    ((2, 32, 4, 4, 8), None, False), ((2, 32, 8, 2, 8), None, False),
    ((2, 40, 4, 2, 8), 11, False), ((2, 45, 6, 3, 8), None, True),
    ((2, 33, 4, 1, 8), 6, True),
])
def test_dense_attention_and_its_vjp_equal_dot_product_attention(shape, window, segments):
  b, t, h, g, d = shape
  q, k, v, do = _inputs(b, t, h, g, d, seed=1)
  seg = _segments(b, t, seed=1) if segments else None
  out, vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, seg, window), q, k, v)
  want, ref_vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, seg, window), q, k, v)
  _close(out, want)
  for got_g, want_g in zip(vjp(do), ref_vjp(do)):
    _close(got_g, want_g)


def test_skips_the_blocks_a_query_cannot_see():
  # The jitted forward of a long sequence never forms a [T, T] array: its temporary
  # memory is far below one T x T fp32 score matrix per head.
  q, k, v, _ = _inputs(1, 2048, 2, 1, 16)
  f = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, block_q=128, block_k=128))
  temp = f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
  assert temp < 2048 * 2048 * 4 / 8, temp


def test_bad_shapes_are_named():
  q, k, v, _ = _inputs(1, 8, 4, 3, 8)
  with pytest.raises(ValueError, match="G dividing"):
    blockwise_attention(q, k, v)


@pytest.mark.parametrize("block, dtype, segments, platform, seq_len, kernel", [
    (None, jnp.bfloat16, False, "gpu", 8192, "xla"),
    (512, jnp.bfloat16, False, "gpu", 64, "cudnn"),
    (512, jnp.float32, False, "gpu", 64, "blockwise"),   # cuDNN attention is bf16/fp16 only
    (512, jnp.bfloat16, True, "gpu", 64, "blockwise"),   # no segment ids in its API
    (512, jnp.bfloat16, False, "rocm", 64, "blockwise"),  # no cuDNN on an AMD GPU
    (512, jnp.bfloat16, False, "cpu", 64, "blockwise"),
    ("auto", jnp.bfloat16, False, "gpu", 64, "cudnn"),
    ("auto", jnp.float32, False, "cpu", 2047, "xla"),    # below the crossover
    ("auto", jnp.float32, False, "cpu", 2048, "blockwise"),
    ("auto", jnp.bfloat16, True, "gpu", 16384, "blockwise"),
])
def test_the_kernel_follows_its_limits(block, dtype, segments, platform, seq_len, kernel):
  from megatrain_jax.models import layers
  from conftest import TINY
  cfg = TINY.replace(attention_block=block)
  assert layers.attention_kernel(cfg, dtype, segments, seq_len, platform) == kernel
  wide = cfg.replace(attn_head_dim=192)
  assert layers.attention_kernel(wide, dtype, segments, seq_len, platform) in (
      "xla", "blockwise")
