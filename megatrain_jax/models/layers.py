"""The layers a decoder block is made of: RMS norm, rotary embeddings, grouped-query
attention (full or sliding-window) and the SwiGLU feed-forward. Pure functions of
parameter trees; `models.llama` assembles them into blocks."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from megatrain_jax.models import blockwise, rope
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.rope import RopeScaling

Params = dict[str, Any]


def rms_norm(x_BxTxD, scale_D, eps):
  """RMS normalisation over the last axis, computed in fp32.

  Args:
    x_BxTxD: the activations.
    scale_D: the per-feature scale.
    eps: added to the mean square.

  Returns:
    The normalised, scaled activations, in x's dtype.
  """
  x32 = x_BxTxD.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale_D.astype(jnp.float32)).astype(x_BxTxD.dtype)


@functools.lru_cache(maxsize=64)
def _frequencies(head_dim: int, theta: float, scaling: RopeScaling | None):
  return rope.frequencies(head_dim, theta, scaling)


def rotary(x_BxTxHxK, positions_T, theta, scaling: RopeScaling | None = None):
  """Rotary embedding, half-split layout (as in Hugging Face Llama).

  Args:
    x_BxTxHxK: queries or keys, per head.
    positions_T: the position of each token: [T], or [B, T] (packed documents).
    theta: the rotary base (`rope_theta`).
    scaling: the rotary scaling (`models.rope`), or None.

  Returns:
    `x` rotated, in its dtype (computed in fp32).
  """
  k = x_BxTxHxK.shape[-1]
  inv_freq, attention_scale = _frequencies(k, float(theta), scaling)
  angles = positions_T.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  if angles.ndim == 2:  # [T, K/2]: the same positions in every row
    angles = angles[None]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  if attention_scale != 1.0:  # yarn scales cos and sin
    cos, sin = cos * attention_scale, sin * attention_scale
  x32 = x_BxTxHxK.astype(jnp.float32)
  x1, x2 = x32[..., : k // 2], x32[..., k // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxK.dtype)


def _dense(p, x):
  y = x @ p["kernel"]
  if "bias" in p:
    y = y + p["bias"]
  return y


ATTENTION_KERNELS = ("xla", "cudnn", "blockwise")
_FUSED_DTYPES = (jnp.bfloat16, jnp.float16)


def attention_kernel(cfg: LlamaConfig, dtype, segments: bool,
                     platform: str | None = None) -> str:
  """Which kernel computes attention (one of `ATTENTION_KERNELS`).

  Without `cfg.attention_block`: "xla", `jax.nn.dot_product_attention`'s XLA path,
  which forms the [T, T] scores. With it: "cudnn", the fused cuDNN kernel, on a GPU
  in bf16/fp16 with a head width of at most 128 (a multiple of 8) and no segment
  ids (its API takes no segment ids); else "blockwise" (`models.blockwise`), which
  runs anywhere, in any dtype, with segment ids.

  Args:
    cfg: the model.
    dtype: the dtype attention computes in.
    segments: whether the batch carries segment ids.
    platform: the JAX platform; None: the default backend's.

  Returns:
    The kernel's name.
  """
  if not cfg.attention_block:
    return "xla"
  platform = platform or jax.default_backend()
  hd = cfg.head_dim
  if (platform in ("gpu", "cuda") and jnp.dtype(dtype) in map(jnp.dtype, _FUSED_DTYPES)
      and hd <= 128 and hd % 8 == 0 and not segments):
    return "cudnn"
  return "blockwise"


def attention(cfg: LlamaConfig, p: Params, x_BxTxD, positions_T, window: int | None = None,
              segment_ids=None):
  """Causal grouped-query self-attention with rotary embeddings.

  Args:
    cfg: the model.
    p: the block's "attn" tree, {q, k, v, o} (and q_norm, k_norm with `qk_norm`).
    x_BxTxD: the normalised activations.
    positions_T: the position of each token, [T] or [B, T].
    window: a sliding window's width (each token sees itself and the window - 1
      tokens before it), or None for full causal attention.
    segment_ids: int [B, T]: a token attends only to its own segment (packed
      documents); None: one segment.

  Returns:
    The attention output, [B, T, D].
  """
  b, t, _ = x_BxTxD.shape
  hd = cfg.head_dim
  q = _dense(p["q"], x_BxTxD).reshape(b, t, cfg.n_heads, hd)
  k = _dense(p["k"], x_BxTxD).reshape(b, t, cfg.n_kv_heads, hd)
  v = _dense(p["v"], x_BxTxD).reshape(b, t, cfg.n_kv_heads, hd)
  if cfg.qk_norm:  # Qwen3: an RMS norm over each head, before the rotation
    q = rms_norm(q, p["q_norm"]["scale"], cfg.norm_eps)
    k = rms_norm(k, p["k_norm"]["scale"], cfg.norm_eps)
  q = rotary(q, positions_T, cfg.rope_theta, cfg.rope_scaling)
  k = rotary(k, positions_T, cfg.rope_theta, cfg.rope_scaling)
  # Grouped-query attention: every kernel takes K/V with fewer heads than Q.
  kernel = attention_kernel(cfg, q.dtype, segment_ids is not None)
  if kernel == "cudnn":
    o = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0))
  elif kernel == "blockwise":
    o = blockwise.blockwise_attention(q, k, v, segment_ids=segment_ids, window=window,
                                      block_q=cfg.attention_block,
                                      block_k=cfg.attention_block)
  else:
    mask = (None if segment_ids is None else
            (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None])
    o = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0))
  return _dense(p["o"], o.reshape(b, t, cfg.n_heads * hd))


def mlp(p: Params, x_BxTxD):
  """The SwiGLU feed-forward: down(silu(gate(x)) * up(x)).

  Args:
    p: the block's "mlp" tree, {gate, up, down}.
    x_BxTxD: the normalised activations.

  Returns:
    The output, [B, T, D].
  """
  return _dense(p["down"], jax.nn.silu(_dense(p["gate"], x_BxTxD))
                * _dense(p["up"], x_BxTxD))


def over_token_chunks(fn, x_BxTxD, chunk: int):
  """`fn(x)` for a function that treats each token alone (norms, the feed-forward),
  run `chunk` tokens (over batch and sequence together) at a time. Each chunk is
  recomputed in the backward (`jax.checkpoint`), so one chunk's intermediates
  exist at a time, in the forward and in the backward.

  Args:
    fn: maps [1, C, D] to [1, C, D'], token by token.
    x_BxTxD: the input.
    chunk: tokens per chunk.

  Returns:
    fn(x), [B, T, D'].
  """
  b, t, d = x_BxTxD.shape
  n = b * t
  if n <= chunk:
    return fn(x_BxTxD)
  k = -(-n // chunk)
  flat = jnp.pad(x_BxTxD.reshape(n, d), ((0, k * chunk - n), (0, 0)))
  out = jax.lax.map(jax.checkpoint(lambda c_CxD: fn(c_CxD[None])[0]),
                    flat.reshape(k, chunk, d))
  return out.reshape(k * chunk, -1)[:n].reshape(b, t, -1)

