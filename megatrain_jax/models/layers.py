"""The layers a decoder block is made of: RMS norm, rotary embeddings, grouped-query
attention (full or sliding-window) and the SwiGLU feed-forward. Pure functions of
parameter trees; `models.llama` assembles them into blocks."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.models import blockwise, rope
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.lora import Adapters
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


def _dense(p, x, delta=None):
  y = x @ p["kernel"]
  if "bias" in p:
    y = y + p["bias"]
  if "lora_a" in p:  # a low-rank adapter (`models.lora`): its addition, made beside
    if delta is None:
      raise ValueError("A projection has LoRA adapters but its model's config has "
                       "lora=None: build the model with the config mt.lora.apply made.")
    y = y + delta
  return y


def _adapted(adapters: Adapters | None, ps: dict, x) -> dict:
  """The adapter additions of projections sharing the input x ({} without adapters)."""
  return {} if adapters is None else adapters.deltas(ps, x)


ATTENTION_KERNELS = ("xla", "cudnn", "blockwise")
_FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
# attention_block="auto" (the default) off a GPU: the blockwise kernel, in blocks of
# AUTO_BLOCK tokens, from AUTO_BLOCKWISE_FROM tokens a sequence on, where it is no
# slower than the dense one on a 2-core CPU (docs/engine.md, "Attention: dense or
# blockwise"); the dense kernel below that, where its T x T scores are small.
AUTO_BLOCK = 512
AUTO_BLOCKWISE_FROM = 2048


def attention_kernel(cfg: LlamaConfig, dtype, segments: bool, seq_len: int,
                     platform: str | None = None) -> str:
  """Which kernel computes attention (one of `ATTENTION_KERNELS`).

  `cfg.attention_block=None`: "xla", `dense_attention` (XLA's matmuls), which forms
  the [T, T] scores. An int, or "auto": "cudnn", the fused cuDNN kernel, on an NVIDIA
  GPU in bf16/fp16 with a head width of at most 128 (a multiple of 8) and no segment
  ids (its API takes no segment ids); else "blockwise" (`models.blockwise`), which
  runs anywhere, in any dtype, with segment ids; but "auto" below
  `AUTO_BLOCKWISE_FROM` tokens is "xla".

  Args:
    cfg: the model.
    dtype: the dtype attention computes in.
    segments: whether the batch carries segment ids.
    seq_len: tokens a sequence.
    platform: the JAX platform; None: this process's ("rocm" for an AMD GPU).

  Returns:
    The kernel's name.
  """
  if cfg.attention_block is None:
    return "xla"
  platform = platform or _platform()
  hd = cfg.head_dim
  if (platform in ("gpu", "cuda") and jnp.dtype(dtype) in map(jnp.dtype, _FUSED_DTYPES)
      and hd <= 128 and hd % 8 == 0 and not segments):
    return "cudnn"
  if cfg.attention_block == "auto" and seq_len < AUTO_BLOCKWISE_FROM:
    return "xla"
  return "blockwise"


def attention_block(cfg: LlamaConfig, seq_len: int) -> int:
  """The blockwise kernel's block at this length.

  Args:
    cfg: the model (`attention_block` an int, or "auto").
    seq_len: tokens a sequence.

  Returns:
    `cfg.attention_block`, or `AUTO_BLOCK` for "auto"; never more than `seq_len`.
  """
  block = AUTO_BLOCK if cfg.attention_block == "auto" else cfg.attention_block
  return min(block, seq_len)


def _platform() -> str:
  """This process's JAX platform, with an AMD GPU as "rocm" (no cuDNN there)."""
  platform = jax.default_backend()
  if platform == "gpu":
    version = getattr(jax.devices()[0].client, "platform_version", "") or ""
    return "rocm" if "rocm" in version.lower() else "gpu"
  return platform


def attention(cfg: LlamaConfig, p: Params, x_BxTxD, positions_T, window: int | None = None,
              segment_ids=None, adapters: Adapters | None = None):
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
    adapters: how adapted projections compute (needed when `cfg.lora` is set).

  Returns:
    The attention output, [B, T, D].
  """
  b, t, _ = x_BxTxD.shape
  q, k, v = attention_qkv(cfg, p, x_BxTxD, positions_T, adapters)
  # Grouped-query attention: every kernel takes K/V with fewer heads than Q.
  kernel = attention_kernel(cfg, q.dtype, segment_ids is not None, t)
  if kernel == "cudnn":
    o = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0))
  elif kernel == "blockwise":
    block = attention_block(cfg, t)
    o = blockwise.blockwise_attention(q, k, v, segment_ids=segment_ids, window=window,
                                      block_q=block, block_k=block)
  else:
    o = dense_attention(q, k, v, segment_ids, window)
  return attention_out(p, o.reshape(b, t, cfg.n_heads * cfg.head_dim), adapters)


def attention_qkv(cfg: LlamaConfig, p: Params, x_BxTxD, positions_T,
                  adapters: Adapters | None = None):
  """Attention's queries, keys and values: projected, normed (`qk_norm`), rotated.

  Args:
    cfg: the model.
    p: the block's "attn" tree.
    x_BxTxD: the normalised activations.
    positions_T: the position of each token, [T] or [B, T].
    adapters: how adapted projections compute (needed when `cfg.lora` is set).

  Returns:
    (q [B, T, N, H], k [B, T, K, H], v [B, T, K, H]); q and k rotated.
  """
  b, t, _ = x_BxTxD.shape
  hd = cfg.head_dim
  d = _adapted(adapters, {"q_proj": p["q"], "k_proj": p["k"], "v_proj": p["v"]}, x_BxTxD)
  q = _dense(p["q"], x_BxTxD, d.get("q_proj")).reshape(b, t, cfg.n_heads, hd)
  k = _dense(p["k"], x_BxTxD, d.get("k_proj")).reshape(b, t, cfg.n_kv_heads, hd)
  v = _dense(p["v"], x_BxTxD, d.get("v_proj")).reshape(b, t, cfg.n_kv_heads, hd)
  if cfg.qk_norm:  # Qwen3: an RMS norm over each head, before the rotation
    q = rms_norm(q, p["q_norm"]["scale"], cfg.norm_eps)
    k = rms_norm(k, p["k_norm"]["scale"], cfg.norm_eps)
  q = rotary(q, positions_T, cfg.rope_theta, cfg.rope_scaling)
  k = rotary(k, positions_T, cfg.rope_theta, cfg.rope_scaling)
  return q, k, v


def attention_out(p: Params, o_BxTxF, adapters: Adapters | None = None):
  """Attention's output projection.

  Args:
    p: the block's "attn" tree.
    o_BxTxF: the heads' outputs side by side (F = N x H).
    adapters: how adapted projections compute.

  Returns:
    The attention output, [B, T, D].
  """
  return _dense(p["o"], o_BxTxF, _adapted(adapters, {"o_proj": p["o"]}, o_BxTxF).get("o_proj"))


def _visible(t: int, segment_ids, window: int | None):
  """Which key each query sees: causal, within the window, in its own segment."""
  pos = jnp.arange(t)
  mask = pos[:, None] >= pos[None, :]
  if window is not None:
    mask = mask & (pos[:, None] < pos[None, :] + window)
  mask = mask[None, None, None]  # [1, 1, 1, T, S] against [B, K, G, T, S]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
  return mask


def _scale(q):
  return jnp.float32(q.shape[-1] ** -0.5)


def _scores(q_BxTxKxGxH, k_BxSxKxH, segment_ids, window):
  logits = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                      preferred_element_type=jnp.float32) * _scale(q_BxTxKxGxH)
  mask = _visible(q_BxTxKxGxH.shape[1], segment_ids, window)
  logits = jnp.where(mask, logits, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))
  return jax.nn.softmax(logits, axis=-1)


def _grouped(q_BxTxNxH, n_kv: int):
  b, t, n, h = q_BxTxNxH.shape
  return q_BxTxNxH.reshape(b, t, n_kv, n // n_kv, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def dense_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids, window: int | None):
  """Causal grouped-query attention that forms the [T, S] scores, with a vjp that
  keeps the attention probabilities and nothing else of that size.

  Differentiating the softmax, the mask and the matmuls as written would keep the
  scores' exp, their normalised form, the boolean mask and an array of zeros (four
  [T, S] arrays per head); this keeps one. The backward is the textbook one:
  dV = P^T dO, dS = P * (dP - rowsum(dP * P)) with dP = dO V^T, and dQ, dK from dS.

  Args:
    q_BxTxNxH: rotated queries.
    k_BxSxKxH: rotated keys (K heads, N a multiple of K).
    v_BxSxKxH: values.
    segment_ids: int [B, T] (a query sees keys of its own segment) or None.
    window: a sliding window's width, or None.

  Returns:
    The attention output, [B, T, N, H], in the queries' dtype.
  """
  return _attention_fwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids, window)[0]


def _attention_fwd(q, k, v, segment_ids, window):
  probs = _scores(_grouped(q, k.shape[2]), k, segment_ids, window)
  probs = probs.astype(v.dtype)
  o = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(q.shape)
  return o.astype(q.dtype), (q, k, v, segment_ids, probs)


def _attention_bwd(window, res, g_BxTxNxH):
  q, k, v, segment_ids, probs = res
  n_kv = k.shape[2]
  qg, gg = _grouped(q, n_kv), _grouped(g_BxTxNxH.astype(v.dtype), n_kv)
  g_v = jnp.einsum("bkgts,btkgh->bskh", probs, gg)
  g_p = jnp.einsum("btkgh,bskh->bkgts", gg, v, preferred_element_type=jnp.float32)
  p32 = probs.astype(jnp.float32)
  g_s = (p32 * (g_p - jnp.sum(g_p * p32, axis=-1, keepdims=True))
         * _scale(q)).astype(q.dtype)
  g_q = jnp.einsum("bkgts,bskh->btkgh", g_s, k).reshape(q.shape)
  g_k = jnp.einsum("bkgts,btkgh->bskh", g_s, qg)
  g_seg = None if segment_ids is None else np.zeros(segment_ids.shape, jax.dtypes.float0)
  return g_q, g_k.astype(k.dtype), g_v.astype(v.dtype), g_seg


dense_attention.defvjp(_attention_fwd, _attention_bwd)


@jax.custom_jvp
def silu(x):
  """x * sigmoid(x), as `jax.nn.silu`, whose derivative is one array: differentiating
  the product as written keeps x, sigmoid(x) and 1 - sigmoid(x) for the backward.

  Args:
    x: any array.

  Returns:
    silu(x).
  """
  return x * jax.nn.sigmoid(x)


@silu.defjvp
def _silu_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  s = jax.nn.sigmoid(x)
  return x * s, t * (s * (1 + x * (1 - s)))


def mlp(p: Params, x_BxTxD, adapters: Adapters | None = None):
  """The SwiGLU feed-forward: down(silu(gate(x)) * up(x)).

  Args:
    p: the block's "mlp" tree, {gate, up, down}.
    x_BxTxD: the normalised activations.
    adapters: how adapted projections compute (needed when any is adapted).

  Returns:
    The output, [B, T, D].
  """
  d = _adapted(adapters, {"gate_proj": p["gate"], "up_proj": p["up"]}, x_BxTxD)
  h = silu(_dense(p["gate"], x_BxTxD, d.get("gate_proj"))) * _dense(p["up"], x_BxTxD,
                                                                   d.get("up_proj"))
  return _dense(p["down"], h, _adapted(adapters, {"down_proj": p["down"]}, h).get("down_proj"))


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

