"""XLA's scratch inside one layer's backward template, estimated from the kernels
that run. The ledger (`memory.step_plan`) counts the buffers the engine holds
between calls; this is what one call adds on top, and `memory.device_bytes` counts
both, so the budget check sees attention's [T, T] scores when they exist.
"""

from __future__ import annotations

import jax.numpy as jnp

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.models import layers
from megatrain_jax.models.config import LlamaConfig


def workspace_bytes(cfg: LlamaConfig, ec: EngineConfig, batch_size: int, seq_len: int,
                    platform: str | None = None) -> int:
  """XLA's scratch inside one layer's backward template (estimated), following the
  kernels that run (`models.layers.attention_kernel`): the values the vjp keeps and
  their cotangents, in the compute dtype: the attention norm's output, q, k, v and
  the attention output for every token, and the feed-forward's norm output and
  three d_ff-wide intermediates for every token, or for one chunk of
  `cfg.mlp_chunk` tokens (an MoE layer: its k routed copies of each token with
  their expert intermediates, router probabilities and shared expert). Attention
  adds, by kernel: "xla" the [T, T] probabilities and their gradient in fp32;
  "blockwise" fp32 gradients of q, k and v and one block pair's scores; "cudnn"
  each row's softmax statistics.

  Args:
    cfg: the model.
    ec: the engine config (compute dtype, grad_accum).
    batch_size: sequences per step; a micro-batch is batch_size // grad_accum.
    seq_len: tokens per sequence.
    platform: the JAX platform the kernels are chosen for (None: this process's).

  Returns:
    The estimate, in bytes.
  """
  cd = jnp.dtype(ec.compute_dtype).itemsize
  b = batch_size // ec.grad_accum
  tokens = b * seq_len
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  mlp_tokens = min(tokens, cfg.mlp_chunk or tokens)
  mlp = (cfg.d_model + 3 * cfg.d_ff) * mlp_tokens
  if cfg.n_experts:  # k routed copies of each token: rows, 3 expert intermediates, out
    moe = (cfg.n_experts_per_tok * (2 * cfg.d_model + 3 * cfg.expert_d_ff) + cfg.n_experts
           + 3 * (cfg.shared_expert_d_ff or 0) + cfg.d_model) * tokens
    mlp = max(moe, mlp if not all(map(cfg.layer_is_moe, range(cfg.n_layers))) else 0)
  out = 2 * (tokens * (cfg.d_model + 2 * q + 2 * kv) + mlp) * cd
  kernel = layers.attention_kernel(cfg, ec.compute_dtype, False, seq_len, platform)
  if kernel == "xla":
    out += 2 * b * cfg.n_heads * seq_len * seq_len * 4
  elif kernel == "blockwise":
    block = layers.attention_block(cfg, seq_len)
    out += tokens * (q + 2 * kv) * 4 + 4 * b * cfg.n_heads * block * block * 4
  else:
    out += b * cfg.n_heads * seq_len * 4
  return out
