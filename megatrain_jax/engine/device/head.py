"""The head's functions a streaming step jits: the loss and its gradient, the last
layer fused with the head, the loss alone, and label log-probabilities.

The loss is masked cross-entropy or a policy-gradient loss (`models.policy`), whose
per-token inputs ("advantages", ...) come as `rows`, a dict of [B, T] arrays ({} for
cross-entropy). Each returns the loss's sum (divided by the step's normalizer
outside: the vjp is seeded with `scale`) and the masked sums of the loss's metrics.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.loss import head_logprobs, head_loss_sum
from megatrain_jax.models.policy import PolicyLoss


def sum_squares(x: jax.Array) -> jax.Array:
  """A gradient's fp32 sum of squares, computed where it lives: the step's norm sums
  them; the gradient is finite when its sum is (as `ResidentTrainer` checks its norm).

  Args:
    x: an array.

  Returns:
    A scalar fp32 array.
  """
  return jnp.sum(jnp.square(x.astype(jnp.float32)))


class HeadFunctions(NamedTuple):
  """The head's functions, not yet jitted (flat arguments are compute-dtype units).

  Attributes:
    fwd_bwd: (flat_h, flat_e | None, x, labels, mask, scale, rows) -> (loss_sum, g_x,
      g_h, g_e, finite, metric_sums).
    tail: (flat_b, flat_h, flat_e | None, x, labels, mask, scale, rows, positions,
      segment_ids, dropout_keys, spec, window) -> (loss_sum, g_x, g_h, g_e, finite_h,
      g_flat, finite, metric_sums): the last layer and the head in one vjp.
    loss: (flat_h, flat_e | None, x, labels, mask, rows) -> (loss_sum, metric_sums).
    logprobs: (flat_h, flat_e | None, x, labels) -> float32 [B, T].
  """

  fwd_bwd: Callable
  tail: Callable
  loss: Callable
  logprobs: Callable


def head_functions(cfg: LlamaConfig, embed: FlatSpec, head: FlatSpec,
                   chunk: int | None, policy: PolicyLoss | None) -> HeadFunctions:
  """The head's functions for a model and a loss.

  Args:
    cfg: the model.
    embed: the embedding's flat layout (read with tied embeddings).
    head: the head's flat layout.
    chunk: tokens per chunk of logits (None: the loss's default).
    policy: a policy-gradient loss, or None for cross-entropy.

  Returns:
    The `HeadFunctions`.
  """
  tied = cfg.tie_embeddings

  def loss(ph, pe, x, labels, mask, rows):  # from the unit trees
    return head_loss_sum(cfg, ph, pe if tied else None, x, labels, mask, chunk, policy, rows)

  # Each unit is differentiated in the elements that train only
  # (`FlatSpec.unflatten_split`).
  trained = lambda spec, flat: None if flat is None else flat[:spec.train_size]
  tree = lambda spec, ft, flat: None if flat is None else spec.unflatten_split(
      ft, flat[spec.train_size:])
  whole = lambda spec, flat: None if flat is None else spec.unflatten(flat)

  def fwd_bwd(flat_h, flat_e, x, labels, mask, scale, rows):
    f = lambda th, te, x: loss(tree(head, th, flat_h), tree(embed, te, flat_e), x,
                               labels, mask, rows)
    loss_sum, vjp, sums = jax.vjp(f, trained(head, flat_h), trained(embed, flat_e), x,
                                  has_aux=True)
    g_h, g_e, g_x = vjp(scale)
    return loss_sum, g_x, g_h, g_e, sum_squares(g_h), sums

  def tail(flat_b, flat_h, flat_e, x, labels, mask, scale, rows, pos, seg, keys, spec,
           window):
    # The last layer and the head in one vjp: the layer's forward runs once, and
    # its residuals live only inside this call.
    def f(tb, th, te, x):
      y, _ = llama.block_apply_stats(cfg, tree(spec, tb, flat_b), x, pos, window, seg, keys)
      return loss(tree(head, th, flat_h), tree(embed, te, flat_e), y, labels, mask, rows)
    loss_sum, vjp, sums = jax.vjp(f, trained(spec, flat_b), trained(head, flat_h),
                                  trained(embed, flat_e), x, has_aux=True)
    g_b, g_h, g_e, g_x = vjp(scale)
    return loss_sum, g_x, g_h, g_e, sum_squares(g_h), g_b, sum_squares(g_b), sums

  def loss_only(flat_h, flat_e, x, labels, mask, rows):
    return loss(whole(head, flat_h), whole(embed, flat_e), x, labels, mask, rows)

  def logprobs(flat_h, flat_e, x, labels):
    return head_logprobs(cfg, whole(head, flat_h), whole(embed, flat_e) if tied else None,
                         x, labels, chunk)

  return HeadFunctions(fwd_bwd, tail, loss_only, logprobs)

