"""Causal attention in blocks: never the T x T score matrix, at any sequence length.

`blockwise_attention` walks the queries a block at a time; for each query block it
walks only the key/value blocks that block can see (causal, and within a sliding
window) with an online softmax: a running max, a running sum and a running output,
all in fp32. It keeps the output and each row's log-sum-exp; the backward (a custom
VJP) walks the same blocks again and recomputes each block's probabilities from
them, so the memory of both passes grows with T, not T^2 (the flash-attention
recurrence).

Grouped-query attention is native (each key/value head serves n_heads / n_kv_heads
query heads, with no copy), and `segment_ids` keep packed documents apart: a token
sees only the earlier tokens of its own segment. Rows with nothing to attend to
(padding, in no segment a key shares) get zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

_NEG = -1e30  # a masked score: exp(_NEG - max) is 0 in fp32, and never NaN


def _blocks(t: int, block: int) -> tuple[int, int]:
  """(block size, number of blocks) for t tokens: a block no longer than t."""
  block = max(1, min(block, t))
  return block, -(-t // block)


def _visible(i, bq, bk, n_k, window):
  """The key blocks query block i sees: [lo, hi)."""
  hi = jnp.minimum((i + 1) * bq + bk - 1, n_k * bk) // bk
  if window is None:
    return jnp.int32(0), hi
  return jnp.maximum(i * bq - window + 1, 0) // bk, hi


def _mask(q_pos, k_pos, t, window, q_seg, k_seg):
  """[bq, bk] (or [B, 1, 1, bq, bk] with segments): which scores count."""
  m = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < t)
  if window is not None:
    m &= k_pos[None, :] > q_pos[:, None] - window
  if q_seg is None:
    return m
  same = q_seg[:, :, None] == k_seg[:, None, :]  # [B, bq, bk]
  return (m[None] & same)[:, None, None]


def _scores(qi, q_pos, q_seg, kp, vp, seg, j, bk, t, window, scale):
  """Key/value block j against a query block: (scaled scores, which count, k_j, v_j),
  the blocks in fp32."""
  kj = jax.lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1).astype(jnp.float32)
  vj = jax.lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1).astype(jnp.float32)
  k_seg = None if seg is None else jax.lax.dynamic_slice_in_dim(seg, j * bk, bk, axis=1)
  s = jnp.einsum("bqgrd,bkgd->bgrqk", qi, kj) * scale
  return s, _mask(q_pos, j * bk + jnp.arange(bk), t, window, q_seg, k_seg), kj, vj


def _pad(x, n, axis=1):
  extra = n - x.shape[axis]
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def _layout(q, k, v, segment_ids, block_q, block_k):
  b, t, h, d = q.shape
  g = k.shape[2]
  bq, n_q = _blocks(t, block_q)
  bk, n_k = _blocks(t, block_k)
  tq, tk = n_q * bq, n_k * bk
  qg = _pad(q, tq).reshape(b, tq, g, h // g, d)
  seg = None if segment_ids is None else _pad(segment_ids.astype(jnp.int32), max(tq, tk))
  return qg, _pad(k, tk), _pad(v, tk), seg, (b, t, h, d, g, bq, n_q, bk, n_k)


def _forward(q, k, v, segment_ids, window, block_q, block_k):
  qg, kp, vp, seg, (b, t, h, d, g, bq, n_q, bk, n_k) = _layout(
      q, k, v, segment_ids, block_q, block_k)
  r, scale = h // g, 1.0 / math.sqrt(d)

  def q_block(i):
    qi = jax.lax.dynamic_slice_in_dim(qg, i * bq, bq, axis=1).astype(jnp.float32)
    q_pos = i * bq + jnp.arange(bq)
    q_seg = None if seg is None else jax.lax.dynamic_slice_in_dim(seg, i * bq, bq, axis=1)

    def k_block(j, carry):
      m, l, acc = carry
      s, mask, _, vj = _scores(qi, q_pos, q_seg, kp, vp, seg, j, bk, t, window, scale)
      s = jnp.where(mask, s, _NEG)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      p = jnp.where(s <= _NEG, 0.0, p)
      corr = jnp.exp(m - m_new)
      return (m_new, l * corr + p.sum(-1),
              acc * corr[..., None] + jnp.einsum("bgrqk,bkgd->bgrqd", p, vj))

    init = (jnp.full((b, g, r, bq), _NEG, jnp.float32), jnp.zeros((b, g, r, bq), jnp.float32),
            jnp.zeros((b, g, r, bq, d), jnp.float32))
    lo, hi = _visible(i, bq, bk, n_k, window)
    m, l, acc = jax.lax.fori_loop(lo, hi, k_block, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
    return out, lse  # [b, g, r, bq, d], [b, g, r, bq]

  outs, lses = jax.lax.map(q_block, jnp.arange(n_q))
  # [n_q, b, g, r, bq, d] -> [b, n_q * bq, g * r, d]
  o = outs.transpose(1, 0, 4, 2, 3, 5).reshape(b, n_q * bq, h, d)[:, :t]
  lse = lses.transpose(1, 2, 3, 0, 4).reshape(b, g, r, n_q * bq)
  return o.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, segment_ids, window, block_q, block_k):
  return _forward(q, k, v, segment_ids, window, block_q, block_k)[0]


def _attention_fwd(q, k, v, segment_ids, window, block_q, block_k):
  o, lse = _forward(q, k, v, segment_ids, window, block_q, block_k)
  return o, (q, k, v, segment_ids, o, lse)


def _attention_bwd(window, block_q, block_k, res, do):
  q, k, v, segment_ids, o, lse = res
  qg, kp, vp, seg, (b, t, h, d, g, bq, n_q, bk, n_k) = _layout(
      q, k, v, segment_ids, block_q, block_k)
  r, scale = h // g, 1.0 / math.sqrt(d)
  dog = _pad(do, n_q * bq).reshape(b, n_q * bq, g, r, d).astype(jnp.float32)
  og = _pad(o, n_q * bq).reshape(b, n_q * bq, g, r, d).astype(jnp.float32)
  delta = jnp.einsum("btgrd,btgrd->bgrt", dog, og)  # rowsum(dO * O)

  def q_block(i, carry):
    dq, dk, dv = carry
    qi = jax.lax.dynamic_slice_in_dim(qg, i * bq, bq, axis=1).astype(jnp.float32)
    doi = jax.lax.dynamic_slice_in_dim(dog, i * bq, bq, axis=1)
    lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
    delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
    q_pos = i * bq + jnp.arange(bq)
    q_seg = None if seg is None else jax.lax.dynamic_slice_in_dim(seg, i * bq, bq, axis=1)

    def k_block(j, inner):
      dqi, dk, dv = inner
      s, mask, kj, vj = _scores(qi, q_pos, q_seg, kp, vp, seg, j, bk, t, window, scale)
      p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
      dp = jnp.einsum("bqgrd,bkgd->bgrqk", doi, vj)
      ds = p * (dp - delta_i[..., None])
      dqi = dqi + jnp.einsum("bgrqk,bkgd->bqgrd", ds, kj) * scale
      dk_j = jnp.einsum("bgrqk,bqgrd->bkgd", ds, qi) * scale
      dv_j = jnp.einsum("bgrqk,bqgrd->bkgd", p, doi)
      dk = jax.lax.dynamic_update_slice_in_dim(
          dk, jax.lax.dynamic_slice_in_dim(dk, j * bk, bk, axis=1) + dk_j, j * bk, axis=1)
      dv = jax.lax.dynamic_update_slice_in_dim(
          dv, jax.lax.dynamic_slice_in_dim(dv, j * bk, bk, axis=1) + dv_j, j * bk, axis=1)
      return dqi, dk, dv

    lo, hi = _visible(i, bq, bk, n_k, window)
    dqi, dk, dv = jax.lax.fori_loop(lo, hi, k_block, (jnp.zeros_like(qi), dk, dv))
    return jax.lax.dynamic_update_slice_in_dim(dq, dqi, i * bq, axis=1), dk, dv

  init = (jnp.zeros(qg.shape, jnp.float32), jnp.zeros(kp.shape, jnp.float32),
          jnp.zeros(vp.shape, jnp.float32))
  dq, dk, dv = jax.lax.fori_loop(0, n_q, q_block, init)
  dq = dq.reshape(b, n_q * bq, h, d)[:, :t].astype(q.dtype)
  return dq, dk[:, :t].astype(k.dtype), dv[:, :t].astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q, k, v, *, segment_ids=None, window: int | None = None,
                        block_q: int = 512, block_k: int = 512) -> jax.Array:
  """Causal grouped-query attention over blocks (see the module docstring).

  Args:
    q: queries [B, T, H, D] (rotary already applied).
    k: keys [B, T, G, D], G dividing H.
    v: values [B, T, G, D].
    segment_ids: int [B, T]: tokens attend only within their segment (None: one
      segment).
    window: a sliding window's width (each token sees itself and window - 1 tokens
      before it), or None.
    block_q: query rows per block (capped at T).
    block_k: key/value rows per block (capped at T).

  Returns:
    The attention output [B, T, H, D], in q's dtype, with scores scaled by 1/sqrt(D).

  Raises:
    ValueError: shapes that do not fit together, or a block size below 1.
  """
  b, t, h, d = q.shape
  if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d or h % k.shape[2]:
    raise ValueError(f"blockwise_attention: q {q.shape}, k {k.shape} and v {v.shape} do "
                     "not fit: k and v [B, T, G, D] with G dividing q's heads.")
  if block_q < 1 or block_k < 1:
    raise ValueError(f"blockwise_attention: block sizes must be >= 1, got {block_q}, "
                     f"{block_k}.")
  if segment_ids is not None and segment_ids.shape != (b, t):
    raise ValueError(f"blockwise_attention: segment_ids has shape {segment_ids.shape}, "
                     f"expected {(b, t)}.")
  return _attention(q, k, v, segment_ids, window, block_q, block_k)
