"""Decoder blocks over new tokens with a key/value cache: the prefill of a prompt and
one-token decode steps, for generation (`megatrain_jax.generation`).

Each layer's cache is a `KVCache`: k and v [B, C, K, H] in the compute dtype, C the
capacity, K the key/value heads. A token's slot is its position: row b's token at
position p has its key and value in slot p of row b, so rows of different lengths
need no shared offset. A call writes its new tokens' keys and values at their
positions, then each new token attends to the slots of its row that are valid
(below the row's length), not after it (causal) and, in a sliding-window layer,
within the window. Slots at or past a row's length may hold anything (a prompt's
right padding writes there); they are masked, and overwritten as the row grows.

The block is `models.llama.block_apply`'s, made of the same pieces (`models.layers`:
norm, projections with their LoRA adapters, rotary, the feed-forward;
`models.moe` for a mixture-of-experts layer); only the attention over the cache is
its own. Parameters are cast to the activations' dtype, as in `block_apply`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from megatrain_jax.models import layers, llama, moe
from megatrain_jax.models import lora as lora_lib
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.layers import rms_norm

Params = dict[str, Any]


class KVCache(NamedTuple):
  """One layer's keys and values, slot = position.

  Attributes:
    k: the rotated keys, [B, C, K, H].
    v: the values, [B, C, K, H].
  """

  k: jax.Array
  v: jax.Array


def placement(cfg: LlamaConfig, dtype, batch: int, capacity: int, budget_bytes: int
              ) -> tuple[bool, str]:
  """Where generation keeps the weights and the KV cache on a device of
  `budget_bytes`: the weights resident when they fit beside the whole cache, or beside
  two layers' cache (the cache then waits in host memory, like activations);
  otherwise streamed a layer at a time, the cache on the device when it fits beside
  two layers' weights, else in host memory.

  Args:
    cfg: the model.
    dtype: the compute dtype.
    batch: rows decoded together.
    capacity: cache slots per row (the longest prompt plus the new tokens).
    budget_bytes: the device memory generation may use.

  Returns:
    (streamed, kv_cache): whether the weights stream, and "device" or "host".
  """
  item = jnp.dtype(dtype).itemsize
  weights = cfg.param_count() * item
  layer = max(cfg.block_param_count(i) for i in range(cfg.n_layers)) * item
  layer_cache = 2 * batch * capacity * cfg.n_kv_heads * cfg.head_dim * item
  cache = cfg.n_layers * layer_cache
  if weights + cache <= budget_bytes:
    return False, "device"
  if weights + 2 * layer_cache <= budget_bytes:
    return False, "host"
  return True, "device" if cache + 2 * layer <= budget_bytes else "host"


def empty_cache(cfg: LlamaConfig, batch: int, capacity: int, dtype) -> KVCache:
  """A zero cache for one layer.

  Args:
    cfg: the model.
    batch: rows B.
    capacity: slots C (the longest prompt plus the tokens to generate).
    dtype: the compute dtype.

  Returns:
    The cache, on the default device.
  """
  shape = (batch, capacity, cfg.n_kv_heads, cfg.head_dim)
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def write(cache: KVCache, k_BxSxKxH, v_BxSxKxH, positions_BxS) -> KVCache:
  """The cache with new keys and values in their rows' slots.

  Args:
    cache: the layer's cache.
    k_BxSxKxH: the new tokens' rotated keys.
    v_BxSxKxH: their values.
    positions_BxS: their positions (= slots); a slot past the capacity is dropped.

  Returns:
    The updated cache.
  """
  rows = jnp.arange(positions_BxS.shape[0])[:, None]
  put = lambda c, new: c.at[rows, positions_BxS].set(new.astype(c.dtype), mode="drop")
  return KVCache(put(cache.k, k_BxSxKxH), put(cache.v, v_BxSxKxH))


def visible(positions_BxS, lengths_B, capacity: int, window: int | None):
  """Which slots each new token sees.

  Args:
    positions_BxS: the new tokens' positions.
    lengths_B: each row's valid slots (after this call's writes).
    capacity: slots C.
    window: the layer's sliding window, or None.

  Returns:
    bool [B, S, C]: slot below the row's length, not after the token and, with a
    window W, fewer than W positions before it.
  """
  slot = jnp.arange(capacity)[None, None, :]
  q = positions_BxS[:, :, None]
  mask = (slot <= q) & (slot < lengths_B[:, None, None])
  if window is not None:
    mask = mask & (q < slot + window)
  return mask


def cached_attention(q_BxSxNxH, cache: KVCache, positions_BxS, lengths_B,
                     window: int | None):
  """Grouped-query attention of new tokens over a layer's cache, with the numerics of
  `layers.dense_attention` (fp32 scores and softmax, probabilities in v's dtype).

  Args:
    q_BxSxNxH: the new tokens' rotated queries.
    cache: the layer's cache, the new tokens already written.
    positions_BxS: the new tokens' positions.
    lengths_B: each row's valid slots.
    window: the layer's sliding window, or None.

  Returns:
    The attention output, [B, S, N, H], in q's dtype.
  """
  b, s, n, h = q_BxSxNxH.shape
  k_BxCxKxH, v_BxCxKxH = cache
  n_kv = k_BxCxKxH.shape[2]
  q = q_BxSxNxH.reshape(b, s, n_kv, n // n_kv, h)
  scores = jnp.einsum("bskgh,bckh->bkgsc", q, k_BxCxKxH,
                      preferred_element_type=jnp.float32) * jnp.float32(h ** -0.5)
  mask = visible(positions_BxS, lengths_B, k_BxCxKxH.shape[1], window)[:, None, None]
  scores = jnp.where(mask, scores, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxCxKxH.dtype)
  o = jnp.einsum("bkgsc,bckh->bskgh", probs, v_BxCxKxH)
  return o.reshape(b, s, n, h).astype(q_BxSxNxH.dtype)


def block_decode(cfg: LlamaConfig, p: Params, x_BxSxD, positions_BxS, cache: KVCache,
                 lengths_B, window: int | None = None) -> tuple[jax.Array, KVCache]:
  """One decoder block over new tokens, with its layer's cache; computes in x's dtype.

  Args:
    cfg: the model.
    p: the block's tree (an MoE block when its "mlp" has "experts").
    x_BxSxD: the new tokens' input to the block.
    positions_BxS: their positions, per row.
    cache: the layer's cache.
    lengths_B: each row's valid slots once the new tokens are written.
    window: the layer's attention window (`cfg.layer_window(i)`; None: full).

  Returns:
    (the block's output [B, S, D], the cache with the new tokens' keys and values).
  """
  dtype = x_BxSxD.dtype
  p = jax.tree.map(lambda a: a if a.dtype == dtype else a.astype(dtype), p)
  b, s, _ = x_BxSxD.shape
  ad = None if cfg.lora is None else lora_lib.Adapters(cfg.lora.scale)  # no dropout
  q, k, v = layers.attention_qkv(
      cfg, p["attn"], rms_norm(x_BxSxD, p["attn_norm"]["scale"], cfg.norm_eps),
      positions_BxS, ad)
  cache = write(cache, k, v, positions_BxS)
  o = cached_attention(q, cache, positions_BxS, lengths_B, window)
  h = x_BxSxD + layers.attention_out(p["attn"], o.reshape(b, s, -1), ad)
  if "experts" in p["mlp"]:
    return h + moe.moe_apply(cfg, p["mlp"], rms_norm(h, p["mlp_norm"]["scale"],
                                                     cfg.norm_eps))[0], cache
  ff = lambda y: y + layers.mlp(p["mlp"], rms_norm(y, p["mlp_norm"]["scale"],
                                                   cfg.norm_eps), ad)
  if cfg.mlp_chunk:
    return layers.over_token_chunks(ff, h, cfg.mlp_chunk), cache
  return ff(h), cache


def model_decode(cfg: LlamaConfig, params: Params, ids_BxS, positions_BxS,
                 caches: list[KVCache], lengths_B, compute_dtype=jnp.float32
                 ) -> tuple[jax.Array, list[KVCache]]:
  """Every block over new tokens with the caches: the last block's output.

  `llama.logits_apply(cfg, params["head"], params["embed"], x)` gives the logits.

  Args:
    cfg: the model.
    params: the whole model's tree.
    ids_BxS: the new tokens.
    positions_BxS: their positions.
    caches: one `KVCache` per layer.
    lengths_B: each row's valid slots once the new tokens are written.
    compute_dtype: the dtype the embedding and blocks compute in.

  Returns:
    (the last block's output [B, S, D], the updated caches).
  """
  x = llama.embed_apply(params["embed"], ids_BxS, compute_dtype)
  out = []
  for i, (p, cache) in enumerate(zip(params["blocks"], caches, strict=True)):
    x, cache = block_decode(cfg, p, x, positions_BxS, cache, lengths_B,
                            cfg.layer_window(i))
    out.append(cache)
  return x, out


def last_logits(cfg: LlamaConfig, head_p: Params, embed_p: Params | None, x_BxSxD,
                index_B) -> jax.Array:
  """The fp32 logits of one token of each row (the one that predicts the next).

  Args:
    cfg: the model.
    head_p: the head's tree.
    embed_p: the embed tree; needed only with tied embeddings.
    x_BxSxD: the last block's output.
    index_B: which of the S tokens, per row.

  Returns:
    The logits, [B, V].
  """
  x_Bx1xD = jnp.take_along_axis(x_BxSxD, index_B[:, None, None], axis=1)
  return llama.logits_apply(cfg, head_p, embed_p, x_Bx1xD)[:, 0]
