"""The per-unit jitted functions ("templates") a streaming step calls.

Each distinct unit structure has one stateless template: the unit's flat
compute-dtype parameters and the activations are arguments, nothing is baked in,
so one compiled block serves every layer however deep the model. `compiles`
counts traces (one per signature).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from megatrain_jax.engine.flat import FlatSpec
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.loss import head_loss_sum


def all_finite(x: jax.Array) -> jax.Array:
  """Whether every element is finite, computed where `x` lives.

  Args:
    x: an array.

  Returns:
    A scalar bool array.
  """
  return jnp.all(jnp.isfinite(x))


class Templates:
  """The jitted templates of one model: embed, block and head, forward and backward.

  Attributes (each a jitted function; flat arguments are compute-dtype units):
    embed_fwd(flat_e, ids) -> x
    block_fwd(flat_b, x) -> x
    block_bwd(flat_b, x, g) -> (g_x, g_flat, finite): the layer's forward is
      recomputed inside; `finite` says whether g_flat is all finite.
    head(flat_h, flat_e | None, x, labels, mask, scale) -> (loss_sum, g_x, g_h, g_e,
      finite): final norm, LM head and chunked cross-entropy, value and gradient;
      the vjp is seeded with `scale` (1 / the batch's mask sum); g_e is the tied
      embedding's gradient from the head (None when untied).
    embed_bwd(ids, g_x, g_e_head) -> (g_flat_fp32, finite): the embedding's
      scatter-add, in fp32, plus the head's part when tied.
  """

  def __init__(self, cfg: LlamaConfig, embed: FlatSpec, block: FlatSpec | None,
               head: FlatSpec, compute_dtype: Any, loss_chunk_tokens: int | None = None):
    """Builds (does not yet compile) the templates.

    Args:
      cfg: the model.
      embed: the embedding's flat layout.
      block: a block's flat layout (None with no layers).
      head: the head's flat layout.
      compute_dtype: the dtype units and activations compute in.
      loss_chunk_tokens: tokens per chunk of logits (None: the loss's default).
    """
    self._counts: dict[str, int] = {}
    cd, tied, chunk = jnp.dtype(compute_dtype), cfg.tie_embeddings, loss_chunk_tokens

    def embed_fwd(flat, ids):
      return llama.embed_apply(embed.unflatten(flat), ids, cd)

    def block_fwd(flat, x):
      return llama.block_apply(cfg, block.unflatten(flat), x)

    def block_bwd(flat, x, g):
      _, vjp = jax.vjp(lambda f, x: llama.block_apply(cfg, block.unflatten(f), x), flat, x)
      g_flat, g_x = vjp(g)
      return g_x, g_flat, all_finite(g_flat)

    def head_fwd_bwd(flat_h, flat_e, x, labels, mask, scale):
      def f(fh, fe, x):
        return head_loss_sum(cfg, head.unflatten(fh), embed.unflatten(fe) if tied else None,
                             x, labels, mask, chunk)
      loss_sum, vjp = jax.vjp(f, flat_h, flat_e, x)
      g_h, g_e, g_x = vjp(scale)
      return loss_sum, g_x, g_h, g_e, all_finite(g_h)

    def embed_bwd(ids, g_x, g_e_head):
      v, d = cfg.vocab_size, cfg.d_model
      table = jnp.zeros((v, d), jnp.float32).at[ids.reshape(-1)].add(
          g_x.reshape(-1, d).astype(jnp.float32))
      g = table.reshape(-1)
      if tied:
        g = g + g_e_head.astype(jnp.float32)
      return g, all_finite(g)

    self.embed_fwd = jax.jit(self._counted("embed_fwd", embed_fwd))
    self.block_fwd = jax.jit(self._counted("block_fwd", block_fwd))
    self.block_bwd = jax.jit(self._counted("block_bwd", block_bwd))
    self.head = jax.jit(self._counted("head_fwd_bwd", head_fwd_bwd))
    self.embed_bwd = jax.jit(self._counted("embed_bwd", embed_bwd))

  def _counted(self, name: str, fn):
    def traced(*args):
      self._counts[name] = self._counts.get(name, 0) + 1
      return fn(*args)
    return traced

  @property
  def compiles(self) -> dict[str, int]:
    """Traces of each template so far (one per distinct argument signature)."""
    return dict(self._counts)
