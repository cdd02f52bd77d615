"""The head's losses (masked next-token cross-entropy, or a policy-gradient loss) and
label log-probabilities, computed a chunk of tokens at a time.

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
from megatrain_jax.models.policy import POLICY_KEYS, PolicyLoss

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


def _chunks(n: int, chunk_tokens: int) -> tuple[int, int]:
  """(rows per chunk, chunks) for n rows."""
  chunk = max(1, min(int(chunk_tokens), n))
  return chunk, -(-n // chunk)


def _scan_sum(fn, rows, chunk_tokens: int):
  """Sums `fn(chunk_rows)` (a pytree of scalars) over chunks of the rows (a pytree of
  [N, ...] arrays), zero-padded to whole chunks (a padded row must add zero: its
  mask is 0)."""
  n = jax.tree.leaves(rows)[0].shape[0]
  chunk, n_chunks = _chunks(n, chunk_tokens)
  pad = n_chunks * chunk - n
  if pad:
    rows = jax.tree.map(lambda v: jnp.pad(v, ((0, pad),) + ((0, 0),) * (v.ndim - 1)), rows)
  if n_chunks == 1:
    return fn(rows)
  shaped = jax.tree.map(lambda v: v.reshape(n_chunks, chunk, *v.shape[1:]), rows)
  zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                      jax.eval_shape(fn, jax.tree.map(lambda v: v[0], shaped)))
  total, _ = jax.lax.scan(lambda acc, xs: (jax.tree.map(jnp.add, acc, fn(xs)), None),
                          zero, shaped)
  return total


def cross_entropy_sum(h_NxD, w_DxV, labels_N, mask_N, chunk_tokens: int):
  """Returns sum(mask * ce) over N tokens, `chunk_tokens` tokens at a time.

  Args:
    h_NxD: the final-normed activations.
    w_DxV: the LM head kernel (cast to h's dtype).
    labels_N: the target token of each row.
    mask_N: the loss weight of each row.
    chunk_tokens: rows per chunk; the rows are zero-padded to whole chunks.
  """
  w = w_DxV.astype(h_NxD.dtype)

  @jax.checkpoint
  def chunk_sum(r):
    logits_CxV = jnp.dot(r["h"], w, preferred_element_type=jnp.float32)
    lse_C = jax.nn.logsumexp(logits_CxV, axis=-1)
    label_logit_C = jnp.take_along_axis(logits_CxV, r["labels"][:, None], axis=-1)[:, 0]
    return jnp.sum(r["mask"] * (lse_C - label_logit_C))

  return _scan_sum(chunk_sum, {"h": h_NxD, "labels": labels_N, "mask": mask_N},
                   chunk_tokens)


def policy_loss_sum(h_NxD, w_DxV, labels_N, mask_N, weight_N, rows: dict[str, jax.Array],
                    chunk_tokens: int, policy: PolicyLoss):
  """sum(weight * policy loss) and sum(mask * metric) over N tokens, chunked as
  `cross_entropy_sum`.

  Args:
    h_NxD: the final-normed activations.
    w_DxV: the LM head kernel.
    labels_N: the sampled tokens.
    mask_N: 1 on the tokens the metrics average over.
    weight_N: each token's weight in the loss (`PolicyLoss.weights`).
    rows: the loss's per-token inputs (`policy.POLICY_KEYS`), each [N].
    chunk_tokens: rows per chunk.
    policy: the loss.

  Returns:
    (the loss sum, {metric name: its masked sum}).
  """
  w = w_DxV.astype(h_NxD.dtype)

  @jax.checkpoint
  def chunk_sums(r):
    logits_CxV = jnp.dot(r["h"], w, preferred_element_type=jnp.float32)
    loss_C, metrics = policy.token_terms(logits_CxV, r["labels"], r["mask"], r["rows"])
    return jnp.sum(r["weight"] * loss_C), {k: jnp.sum(r["mask"] * v)
                                           for k, v in metrics.items()}

  return _scan_sum(chunk_sums, {"h": h_NxD, "labels": labels_N, "mask": mask_N,
                                "weight": weight_N, "rows": rows}, chunk_tokens)


def label_logprobs(h_NxD, w_DxV, labels_N, chunk_tokens: int) -> jax.Array:
  """Each row's log-probability of its label, `chunk_tokens` rows at a time.

  Args:
    h_NxD: the final-normed activations.
    w_DxV: the LM head kernel.
    labels_N: the tokens.
    chunk_tokens: rows per chunk.

  Returns:
    float32 [N].
  """
  n, d = h_NxD.shape
  chunk, n_chunks = _chunks(n, chunk_tokens)
  pad = n_chunks * chunk - n
  w = w_DxV.astype(h_NxD.dtype)

  def chunk_logprobs(h_CxD, labels_C):
    logits_CxV = jnp.dot(h_CxD, w, preferred_element_type=jnp.float32)
    label_logit_C = jnp.take_along_axis(logits_CxV, labels_C[:, None], axis=-1)[:, 0]
    return label_logit_C - jax.nn.logsumexp(logits_CxV, axis=-1)

  h = jnp.pad(h_NxD, ((0, pad), (0, 0))).reshape(n_chunks, chunk, d)
  labels = jnp.pad(labels_N, (0, pad)).reshape(n_chunks, chunk)
  return jax.lax.map(lambda xs: chunk_logprobs(*xs), (h, labels)).reshape(-1)[:n]


def _head_rows(cfg: LlamaConfig, head_p, embed_p, x_BxTxD):
  """The final-normed rows [B*T, D] and the head's kernel."""
  b, t, d = x_BxTxD.shape
  h = llama.head_norm(cfg, head_p, x_BxTxD).reshape(b * t, d)
  return h, llama.head_kernel(cfg, head_p, embed_p)


def head_loss_sum(cfg: LlamaConfig, head_p, embed_p, x_BxTxD, labels_BxT,
                  loss_mask_BxT, chunk_tokens: int | None = None,
                  policy: PolicyLoss | None = None, rows: dict | None = None):
  """Final norm + LM head + the loss, summed (not yet divided by its normalizer).

  Args:
    cfg: the model.
    head_p: the head's tree.
    embed_p: the embed tree; needed only with tied embeddings.
    x_BxTxD: the last block's output.
    labels_BxT: the target tokens.
    loss_mask_BxT: the loss weights.
    chunk_tokens: tokens per loss chunk; None uses `default_chunk_tokens`.
    policy: a policy-gradient loss, or None for masked cross-entropy.
    rows: the policy loss's inputs (`policy.POLICY_KEYS` present in the batch), [B, T].

  Returns:
    (the loss sum, {metric name: its masked sum}; {} for cross-entropy).
  """
  b, t, _ = x_BxTxD.shape
  h, w = _head_rows(cfg, head_p, embed_p, x_BxTxD)
  if chunk_tokens is None:
    chunk_tokens = default_chunk_tokens(cfg.vocab_size, b * t)
  mask = loss_mask_BxT.astype(jnp.float32)
  if policy is None:
    return cross_entropy_sum(h, w, labels_BxT.reshape(-1), mask.reshape(-1), chunk_tokens), {}
  return policy_loss_sum(h, w, labels_BxT.reshape(-1), mask.reshape(-1),
                         policy.weights(mask).reshape(-1),
                         {k: v.reshape(-1) for k, v in (rows or {}).items()},
                         chunk_tokens, policy)


def head_logprobs(cfg: LlamaConfig, head_p, embed_p, x_BxTxD, labels_BxT,
                  chunk_tokens: int | None = None) -> jax.Array:
  """Final norm + LM head + each label's log-probability.

  Args:
    cfg: the model.
    head_p: the head's tree.
    embed_p: the embed tree; needed only with tied embeddings.
    x_BxTxD: the last block's output.
    labels_BxT: the tokens.
    chunk_tokens: tokens per chunk of logits; None uses `default_chunk_tokens`.

  Returns:
    float32 [B, T].
  """
  b, t, _ = x_BxTxD.shape
  h, w = _head_rows(cfg, head_p, embed_p, x_BxTxD)
  if chunk_tokens is None:
    chunk_tokens = default_chunk_tokens(cfg.vocab_size, b * t)
  return label_logprobs(h, w, labels_BxT.reshape(-1), chunk_tokens).reshape(b, t)


def _trunk(cfg: LlamaConfig, params, batch, compute_dtype, remat: bool, dropout_keys):
  """The embedding and every block: (the last block's output, MoE router stats)."""
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
  return x, stats


def model_loss_and_metrics(cfg: LlamaConfig, params, batch, compute_dtype=jnp.float32,
                           chunk_tokens: int | None = None, remat: bool = False,
                           dropout_keys=None, aux: bool = True,
                           policy: PolicyLoss | None = None):
  """The whole model's loss on a batch (the resident path), and the loss's metrics.

  Args:
    cfg: the model.
    params: the whole model's tree.
    batch: {"input_ids", "labels", "loss_mask"}, optionally "positions" and
      "segment_ids" (packed documents), and a policy loss's keys.
    compute_dtype: the dtype the embedding and blocks compute in.
    chunk_tokens: tokens per loss chunk; None uses `default_chunk_tokens`.
    remat: whether to recompute each block in the backward (`jax.checkpoint`).
    dropout_keys: LoRA dropout's per-sequence keys (`lora.sequence_keys`), or None.
    aux: add the MoE layers' load-balancing loss (an evaluation leaves it out).
    policy: a policy-gradient loss (`models.policy`), or None for cross-entropy.

  Returns:
    (loss, {metric: its mean over the masked tokens}). Cross-entropy's loss is
    sum(mask * ce) / max(sum(mask), 1); a policy loss's is its weighted sum over
    `policy.normalizer`; plus (with `aux`) `router_aux_loss_coef` times the
    load-balancing loss of the MoE layers (`models.moe.aux_loss`).
  """
  x, stats = _trunk(cfg, params, batch, compute_dtype, remat, dropout_keys)
  mask = batch["loss_mask"]
  rows = None if policy is None else {k: batch[k] for k in POLICY_KEYS if k in batch}
  total, sums = head_loss_sum(cfg, params["head"], params["embed"], x, batch["labels"],
                              mask, chunk_tokens, policy, rows)
  norm = jnp.sum(mask) if policy is None else policy.normalizer(mask)
  loss = total / jnp.maximum(norm, 1.0)
  if aux and stats and cfg.router_aux_loss_coef:
    n = len(stats) * batch["input_ids"].size
    loss = loss + cfg.router_aux_loss_coef * moe.aux_loss(cfg, moe.total_stats(stats), n)
  tokens = jnp.maximum(jnp.sum(mask), 1.0)
  return loss, {k: v / tokens for k, v in sums.items()}


def model_loss(cfg: LlamaConfig, params, batch, compute_dtype=jnp.float32,
               chunk_tokens: int | None = None, remat: bool = False, dropout_keys=None,
               aux: bool = True):
  """Mean masked CE of the whole model on a batch (`model_loss_and_metrics`'s loss).

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
  return model_loss_and_metrics(cfg, params, batch, compute_dtype, chunk_tokens, remat,
                                dropout_keys, aux)[0]


def model_logprobs(cfg: LlamaConfig, params, batch, compute_dtype=jnp.float32,
                   chunk_tokens: int | None = None) -> jax.Array:
  """Each label's log-probability under the whole model (the resident path).

  Args:
    cfg: the model.
    params: the whole model's tree.
    batch: {"input_ids", "labels"}, and optionally "positions" and "segment_ids".
    compute_dtype: the dtype the embedding and blocks compute in.
    chunk_tokens: tokens per chunk of logits; None uses `default_chunk_tokens`.

  Returns:
    float32 [B, T].
  """
  x, _ = _trunk(cfg, params, batch, compute_dtype, False, None)
  return head_logprobs(cfg, params["head"], params["embed"], x, batch["labels"],
                       chunk_tokens)
