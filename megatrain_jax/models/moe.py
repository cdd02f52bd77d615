"""Mixture-of-experts feed-forward: a top-k softmax router over SwiGLU experts.

One MoE layer's "mlp" tree:

  {"router": {"kernel": D x E},
   "experts": {"gate": {"kernel": E x D x F}, "up": {...: E x D x F},
               "down": {"kernel": E x F x D}},
   ["shared": {gate, up, down} (a dense SwiGLU), "shared_gate": {"kernel": D x 1}]}

The experts run as grouped matmuls (`jax.lax.ragged_dot`): the token copies are
sorted by their expert, so each expert multiplies only the rows routed to it. A
dense dispatch (every expert on every token, masked) would cost E / k times the
flops and E times the activations; a Python loop over experts would trace E
matmuls per layer. The experts of a layer are three stacked arrays, so a streamed
layer moves them as part of its one contiguous buffer.

The load-balancing loss is the one `transformers` adds to its training loss
(`load_balancing_loss_func`, without an attention mask): over every MoE layer's
router rows together, E * sum_e (fraction of top-k picks for e) * (mean router
probability of e). It couples the layers only through two [E] sums, which is what
lets a streaming engine add it: each layer's forward returns its `RouterStats`,
and its backward takes the gradient of its probability sum (`aux_grad`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.layers import silu

Params = dict[str, Any]


class RouterStats(NamedTuple):
  """One MoE layer's router totals over its tokens (fp32 [E] each).

  Attributes:
    picks: how many times each expert was among a token's top k.
    probs: the sum of each expert's router probability.
  """

  picks: jax.Array
  probs: jax.Array


def init_moe(cfg: LlamaConfig, key: jax.Array, normal) -> Params:
  """A fresh MoE "mlp" tree.

  Args:
    cfg: the model.
    key: the PRNG key of the MoE part of the block.
    normal: (key, shape) -> an fp32 normal array (the model's initializer).

  Returns:
    The tree (see the module docstring).
  """
  d, e, f = cfg.d_model, cfg.n_experts, cfg.expert_d_ff
  kr, kg, ku, kd, ks, ksg = jax.random.split(key, 6)
  p = {"router": {"kernel": normal(kr, (d, e))},
       "experts": {"gate": {"kernel": normal(kg, (e, d, f))},
                   "up": {"kernel": normal(ku, (e, d, f))},
                   "down": {"kernel": normal(kd, (e, f, d))}}}
  if cfg.shared_expert_d_ff:
    s1, s2, s3 = jax.random.split(ks, 3)
    fs = cfg.shared_expert_d_ff
    p["shared"] = {"gate": {"kernel": normal(s1, (d, fs))},
                   "up": {"kernel": normal(s2, (d, fs))},
                   "down": {"kernel": normal(s3, (fs, d))}}
    p["shared_gate"] = {"kernel": normal(ksg, (d, 1))}
  return p


def moe_apply(cfg: LlamaConfig, p: Params, x_BxTxD) -> tuple[jax.Array, RouterStats]:
  """The MoE feed-forward of one layer.

  Args:
    cfg: the model.
    p: the layer's "mlp" tree.
    x_BxTxD: the normalised activations.

  Returns:
    (the output [B, T, D], the layer's router stats).
  """
  b, t, d = x_BxTxD.shape
  k, e = cfg.n_experts_per_tok, cfg.n_experts
  x_NxD = x_BxTxD.reshape(b * t, d)
  logits = x_NxD @ p["router"]["kernel"]
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_w, top_e = jax.lax.top_k(probs, k)  # [N, k]
  if cfg.norm_topk_prob:
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
  top_w = top_w.astype(x_BxTxD.dtype)
  # Token copies sorted by expert: each expert's rows are contiguous.
  flat_e = top_e.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  token = order // k
  sizes = jnp.bincount(flat_e, length=e).astype(jnp.int32)
  rows = x_NxD[token]
  ex = p["experts"]
  h = (silu(jax.lax.ragged_dot(rows, ex["gate"]["kernel"], sizes))
       * jax.lax.ragged_dot(rows, ex["up"]["kernel"], sizes))
  out = jax.lax.ragged_dot(h, ex["down"]["kernel"], sizes)
  out = out * top_w.reshape(-1)[order][:, None]
  y = jnp.zeros_like(x_NxD).at[token].add(out)
  if "shared" in p:
    sh = p["shared"]
    shared = (silu(x_NxD @ sh["gate"]["kernel"]) * (x_NxD @ sh["up"]["kernel"])
              ) @ sh["down"]["kernel"]
    y = y + jax.nn.sigmoid(x_NxD @ p["shared_gate"]["kernel"]) * shared
  stats = RouterStats(jax.lax.stop_gradient(sizes.astype(jnp.float32)),
                      jnp.sum(probs, axis=0))
  return y.reshape(b, t, d), stats


def total_stats(stats: list[RouterStats]) -> RouterStats:
  """The sum of several layers' (or micro-batches') router stats.

  Args:
    stats: the parts.

  Returns:
    Their elementwise sum.
  """
  return RouterStats(sum(s.picks for s in stats), sum(s.probs for s in stats))


def aux_loss(cfg: LlamaConfig, stats: RouterStats, rows: int) -> jax.Array:
  """The load-balancing loss from the router stats of every MoE layer.

  Args:
    cfg: the model.
    stats: the stats summed over every MoE layer.
    rows: router rows behind them (MoE layers x tokens).

  Returns:
    E * sum_e (picks_e / rows) * (probs_e / rows), fp32.
  """
  return cfg.n_experts * jnp.sum((stats.picks / rows) * (stats.probs / rows))


def aux_grad(cfg: LlamaConfig, picks: jax.Array, rows: int) -> jax.Array:
  """The gradient of `router_aux_loss_coef * aux_loss` with respect to any one MoE
  layer's probability sum (the picks carry no gradient).

  Args:
    cfg: the model.
    picks: the picks summed over every MoE layer.
    rows: router rows behind them.

  Returns:
    fp32 [E].
  """
  return cfg.router_aux_loss_coef * cfg.n_experts * picks / (rows * rows)
