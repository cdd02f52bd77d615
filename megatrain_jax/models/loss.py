"""Masked next-token cross-entropy, computed a chunk of tokens at a time.

`labels` already hold the next token of each position (the data pipeline shifts
them), so the loss is sum(mask * ce) / sum(mask) over the whole batch. The head's
[D, V] matmul runs on `chunk_tokens` tokens at a time under `jax.checkpoint` inside
a scan, so at most one chunk's fp32 logits [chunk, V] are alive, in the forward
and in the backward, however large B x T x V is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megatrain_jax.models import llama, moe
from megatrain_jax.models import lora as lora_lib
from megatrain_jax.models.config import LlamaConfig

# Budget for one chunk of fp32 logits.
DEFAULT_LOGITS_CHUNK_BYTES = 256 * 2**20


def default_chunk_tokens(vocab_size: int, n_tokens: int,
                         chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES) -> int:
  """Tokens per loss chunk: as many as fit fp32 logits in `chunk_bytes`.

  Args:
    vocab_size: the vocabulary size V.
    n_tokens: tokens in the batch; a chunk holds no more.
    chunk_bytes: budget for one chunk's [chunk, V] fp32 logits.

  Returns:
    The chunk size, at least 1.
  """
  return max(1, min(n_tokens, chunk_bytes // (4 * vocab_size)))


def cross_entropy_sum(h_NxD, w_DxV, labels_N, mask_N, chunk_tokens: int):
  """Returns sum(mask * ce) over N tokens, `chunk_tokens` tokens at a time.

  Args:
    h_NxD: the final-normed activations.
    w_DxV: the LM head kernel (cast to h's dtype).
    labels_N: the target token of each row.
    mask_N: the loss weight of each row.
    chunk_tokens: rows per chunk; the rows are zero-padded to whole chunks.
  """
  n, d = h_NxD.shape
  chunk = max(1, min(int(chunk_tokens), n))
  n_chunks = -(-n // chunk)
  pad = n_chunks * chunk - n
  if pad:
    h_NxD = jnp.pad(h_NxD, ((0, pad), (0, 0)))
    labels_N = jnp.pad(labels_N, (0, pad))
    mask_N = jnp.pad(mask_N, (0, pad))
  w = w_DxV.astype(h_NxD.dtype)

  @jax.checkpoint
  def chunk_sum(h_CxD, labels_C, mask_C):
    logits_CxV = jnp.dot(h_CxD, w, preferred_element_type=jnp.float32)
    lse_C = jax.nn.logsumexp(logits_CxV, axis=-1)
    label_logit_C = jnp.take_along_axis(logits_CxV, labels_C[:, None], axis=-1)[:, 0]
    return jnp.sum(mask_C * (lse_C - label_logit_C))

  if n_chunks == 1:
    return chunk_sum(h_NxD, labels_N, mask_N)

  def body(total, xs):
    return total + chunk_sum(*xs), None

  total, _ = jax.lax.scan(
      body, jnp.zeros((), jnp.float32),
      (h_NxD.reshape(n_chunks, chunk, d), labels_N.reshape(n_chunks, chunk),
       mask_N.reshape(n_chunks, chunk)))
  return total


def head_loss_sum(cfg: LlamaConfig, head_p, embed_p, x_BxTxD, labels_BxT,
                  loss_mask_BxT, chunk_tokens: int | None = None):
  """Final norm + LM head + masked CE, summed (not yet divided by sum(mask)).

  Args:
    cfg: the model.
    head_p: the head's tree.
    embed_p: the embed tree; needed only with tied embeddings.
    x_BxTxD: the last block's output.
    labels_BxT: the target tokens.
    loss_mask_BxT: the loss weights.
    chunk_tokens: tokens per loss chunk; None uses `default_chunk_tokens`.
  """
  b, t, d = x_BxTxD.shape
  h = llama.head_norm(cfg, head_p, x_BxTxD).reshape(b * t, d)
  w = llama.head_kernel(cfg, head_p, embed_p)
  if chunk_tokens is None:
    chunk_tokens = default_chunk_tokens(cfg.vocab_size, b * t)
  return cross_entropy_sum(h, w, labels_BxT.reshape(-1),
                           loss_mask_BxT.reshape(-1).astype(jnp.float32),
                           chunk_tokens)


def model_loss(cfg: LlamaConfig, params, batch, compute_dtype=jnp.float32,
               chunk_tokens: int | None = None, remat: bool = False, dropout_keys=None,
               aux: bool = True):
  """Mean masked CE of the whole model on a batch (the resident path).

  Args:
    cfg: the model.
    params: the whole model's tree.
    batch: {"input_ids", "labels", "loss_mask"}, and optionally "positions" and
      "segment_ids" (packed documents).
    compute_dtype: the dtype the embedding and blocks compute in.
    chunk_tokens: tokens per loss chunk; None uses `default_chunk_tokens`.
    remat: whether to recompute each block in the backward (`jax.checkpoint`).
    dropout_keys: LoRA dropout's per-sequence keys (`lora.sequence_keys`), or None.
    aux: add the MoE layers' load-balancing loss (an evaluation leaves it out).

  Returns:
    sum(mask * ce) / max(sum(mask), 1), plus (with `aux`) `router_aux_loss_coef`
    times the load-balancing loss of the MoE layers (`models.moe.aux_loss`).
  """
  pos, seg = batch.get("positions"), batch.get("segment_ids")
  block = lambda p, x, keys, window: llama.block_apply_stats(cfg, p, x, pos, window, seg, keys)
  if remat:
    block = jax.checkpoint(block, static_argnums=(3,))
  x = llama.embed_apply(params["embed"], batch["input_ids"], compute_dtype)
  stats = []
  for i, p in enumerate(params["blocks"]):
    x, st = block(p, x, lora_lib.layer_keys(dropout_keys, i), cfg.layer_window(i))
    if st is not None:
      stats.append(st)
  total = head_loss_sum(cfg, params["head"], params["embed"], x, batch["labels"],
                        batch["loss_mask"], chunk_tokens)
  loss = total / jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
  if aux and stats and cfg.router_aux_loss_coef:
    rows = len(stats) * batch["input_ids"].size
    loss = loss + cfg.router_aux_loss_coef * moe.aux_loss(cfg, moe.total_stats(stats), rows)
  return loss
