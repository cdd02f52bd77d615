"""Llama-family decoder: pure per-unit functions and the Flax NNX model over them.

The model is three kinds of *unit*, each with a plain parameter tree and a pure
function, which is what lets an engine run it one unit at a time:

  embed  {"embedding": V x D}                          ids -> x
  block  {"attn_norm", "attn": {q,k,v,o}, "mlp_norm",  x -> x   (n_layers of them)
          "mlp": {gate, up, down}}   (an MoE layer's "mlp": `models.moe`)
  head   {"final_norm": {"scale"}, ["lm_head": {"kernel": D x V}]}   x -> logits

The whole model's tree is {"embed": ..., "blocks": [block, ...], "head": ...}. With
`tie_embeddings` the head has no "lm_head" and uses the embedding's transpose.
Linear kernels are [in, out]. Parameters are fp32; `compute_dtype` casts them
(and the activations) when a unit runs. The unit trees' initialisation (one PRNG
key per unit, so an engine can build any unit alone) is in `models.params`; the
layers themselves (norm, rotary, attention, SwiGLU) are in `models.layers`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.models import layers, moe
from megatrain_jax.models import lora as lora_lib
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.layers import attention, mlp, rms_norm
# The unit trees' initialisation and assembly, part of this module's interface.
from megatrain_jax.models.params import (  # pylint: disable=unused-import
    INIT_STD, Params, abstract_units, assemble_units, init_block, init_embed, init_head,
    init_params, split_units, unit_key)


# ----------------------------------------------------------------------------
# Forward (pure).
# ----------------------------------------------------------------------------

def _cast(tree, dtype):
  # Leaves already in `dtype` stay the same arrays: a layer's vjp then keeps its
  # parameters themselves, not copies (`engine.residuals`).
  return jax.tree.map(lambda a: a if a.dtype == dtype else a.astype(dtype), tree)


def embed_apply(p: Params, ids_BxT, compute_dtype=jnp.float32):
  """The embedding unit: looks up each token's row.

  Args:
    p: the embed tree.
    ids_BxT: the token ids.
    compute_dtype: the dtype of the result.

  Returns:
    The embeddings, [B, T, D].
  """
  return jnp.take(p["embedding"], ids_BxT, axis=0).astype(compute_dtype)


def block_apply_stats(cfg: LlamaConfig, p: Params, x_BxTxD, positions_T=None,
                      window: int | None = None, segment_ids=None, dropout_keys=None
                      ) -> tuple[jax.Array, moe.RouterStats | None]:
  """One decoder block and its router stats; computes in x's dtype.

  Args:
    cfg: the model.
    p: the block's tree (an MoE block when its "mlp" has "experts").
    x_BxTxD: the block's input.
    positions_T: the position of each token, [T] or [B, T]; None means 0..T-1.
    window: the layer's attention window (`cfg.layer_window(i)`; None: full).
    segment_ids: int [B, T] keeping packed documents apart (None: one per row).
    dropout_keys: LoRA dropout's per-sequence keys of this layer
      (`lora.layer_keys`), or None: no dropout.

  Returns:
    (the block's output [B, T, D], its `moe.RouterStats`, or None for a dense block).
  """
  p = _cast(p, x_BxTxD.dtype)
  if positions_T is None:
    positions_T = jnp.arange(x_BxTxD.shape[1])
  ad = (None if cfg.lora is None else
        lora_lib.Adapters(cfg.lora.scale, cfg.lora.dropout, dropout_keys))
  h = x_BxTxD + attention(cfg, p["attn"],
                          rms_norm(x_BxTxD, p["attn_norm"]["scale"], cfg.norm_eps),
                          positions_T, window, segment_ids, ad)
  if "experts" in p["mlp"]:
    y, stats = moe.moe_apply(cfg, p["mlp"], rms_norm(h, p["mlp_norm"]["scale"], cfg.norm_eps))
    return h + y, stats
  ff = lambda y: y + mlp(p["mlp"], rms_norm(y, p["mlp_norm"]["scale"], cfg.norm_eps), ad)
  if cfg.mlp_chunk:
    return layers.over_token_chunks(ff, h, cfg.mlp_chunk), None
  return ff(h), None


def block_apply(cfg: LlamaConfig, p: Params, x_BxTxD, positions_T=None,
                window: int | None = None, segment_ids=None, dropout_keys=None):
  """One decoder block; computes in x's dtype (params are cast to it).

  Args:
    cfg: the model.
    p: the block's tree.
    x_BxTxD: the block's input.
    positions_T: the position of each token, [T] or [B, T]; None means 0..T-1.
    window: the layer's attention window (`cfg.layer_window(i)`; None: full).
    segment_ids: int [B, T] keeping packed documents apart (None: one per row).
    dropout_keys: as `block_apply_stats`.

  Returns:
    The block's output, [B, T, D].
  """
  return block_apply_stats(cfg, p, x_BxTxD, positions_T, window, segment_ids,
                           dropout_keys)[0]


def head_norm(cfg: LlamaConfig, head_p: Params, x_BxTxD):
  """The head's final RMS norm.

  Args:
    cfg: the model.
    head_p: the head's tree.
    x_BxTxD: the last block's output.

  Returns:
    The normalised activations, in x's dtype.
  """
  return rms_norm(x_BxTxD, head_p["final_norm"]["scale"].astype(x_BxTxD.dtype),
                  cfg.norm_eps)


def head_kernel(cfg: LlamaConfig, head_p: Params, embed_p: Params | None):
  """The LM head's [D, V] kernel: its own, or the tied embedding's transpose.

  Args:
    cfg: the model.
    head_p: the head's tree.
    embed_p: the embed tree; needed only with tied embeddings.

  Returns:
    The kernel.

  Raises:
    ValueError: the embeddings are tied and `embed_p` is None.
  """
  if cfg.tie_embeddings:
    if embed_p is None:
      raise ValueError("A tied-embedding head needs the embedding parameters.")
    return embed_p["embedding"].T
  return head_p["lm_head"]["kernel"]


def logits_apply(cfg: LlamaConfig, head_p: Params, embed_p: Params | None, x_BxTxD):
  """Full logits in fp32 (for inference and tests; training uses the chunked loss).

  Args:
    cfg: the model.
    head_p: the head's tree.
    embed_p: the embed tree; needed only with tied embeddings.
    x_BxTxD: the last block's output.

  Returns:
    The logits, [B, T, V].
  """
  h = head_norm(cfg, head_p, x_BxTxD)
  w = head_kernel(cfg, head_p, embed_p).astype(h.dtype)
  return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)


def forward_and_aux(cfg: LlamaConfig, params: Params, ids_BxT, compute_dtype=jnp.float32,
                    positions=None, segment_ids=None, dropout_keys=None
                    ) -> tuple[jax.Array, jax.Array]:
  """Logits of the whole model, and its load-balancing loss.

  Args:
    cfg: the model.
    params: the whole model's tree.
    ids_BxT: the token ids.
    compute_dtype: the dtype the embedding and blocks compute in.
    positions: int [B, T] positions (packed documents restart at 0); None: 0..T-1.
    segment_ids: int [B, T] keeping packed documents apart; None: one per row.
    dropout_keys: LoRA dropout's per-sequence keys of the step
      (`lora.sequence_keys`), or None: no dropout.

  Returns:
    (the fp32 logits [B, T, V], `moe.aux_loss` over the MoE layers: 0 with none).
  """
  x = embed_apply(params["embed"], ids_BxT, compute_dtype)
  stats = []
  for i, p in enumerate(params["blocks"]):
    x, st = block_apply_stats(cfg, p, x, positions, cfg.layer_window(i), segment_ids,
                              lora_lib.layer_keys(dropout_keys, i))
    if st is not None:
      stats.append(st)
  aux = (moe.aux_loss(cfg, moe.total_stats(stats), len(stats) * ids_BxT.size)
         if stats else jnp.float32(0.0))
  return logits_apply(cfg, params["head"], params["embed"], x), aux


def forward(cfg: LlamaConfig, params: Params, ids_BxT, compute_dtype=jnp.float32,
            positions=None, segment_ids=None):
  """Logits of the whole model from its parameter tree.

  Args:
    cfg: the model.
    params: the whole model's tree.
    ids_BxT: the token ids.
    compute_dtype: the dtype the embedding and blocks compute in.
    positions: as `forward_and_aux`.
    segment_ids: as `forward_and_aux`.

  Returns:
    The fp32 logits, [B, T, V].
  """
  return forward_and_aux(cfg, params, ids_BxT, compute_dtype, positions, segment_ids)[0]


# ----------------------------------------------------------------------------
# Flax NNX model: a stateful view over the same trees.
# ----------------------------------------------------------------------------

def _wrap(tree):
  # Adapters (`models.lora`) are their own variable type, so a filter selects them.
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (nnx.LoRAParam if getattr(path[-1], "key", None)
                       in lora_lib.ADAPTER_KEYS else nnx.Param)(x), tree)


def _unwrap(tree):
  return jax.tree.map(lambda p: p[...], tree,
                      is_leaf=lambda x: isinstance(x, nnx.Param))


class Unit(nnx.Module):
  """One unit's parameters, as NNX Params in a nested dict of the unit's layout."""

  def __init__(self, tree: Params):
    self.p = nnx.data(_wrap(tree))

  def tree(self) -> Params:
    """The unit's parameters.

    Returns:
      The plain tree of their values.
    """
    return _unwrap(self.p)

  def set_tree(self, tree: Params) -> None:
    """Sets every parameter, as fp32, from a tree of the unit's layout.

    Args:
      tree: the new values.
    """
    jax.tree.map(lambda param, v: param.set_value(jnp.asarray(v, jnp.float32)),
                 self.p, tree, is_leaf=lambda x: isinstance(x, nnx.Param))


class Llama(nnx.Module):
  """Llama / Qwen2 / Qwen3 / Mistral decoder. `model(ids) -> logits` (fp32).

  Decomposition for engines: `model.embed`, `model.blocks[i]`, `model.head` are
  `Unit`s whose `.tree()` feeds the pure `embed_apply`, `block_apply` and head
  functions of this module; `model.param_tree()` is the whole tree.
  """

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs | None = None,
               compute_dtype=jnp.float32, params: Params | None = None):
    """Random init from `rngs`, or the given `params` tree (e.g. a loaded checkpoint)."""
    if not isinstance(cfg, LlamaConfig):
      raise TypeError(f"Llama needs a LlamaConfig, got {type(cfg).__name__}.")
    if (rngs is None) == (params is None):
      raise ValueError("Llama needs exactly one of rngs= (random init) or params= "
                       "(a parameter tree).")
    self.cfg = cfg
    self.compute_dtype = compute_dtype
    if params is None:
      params = init_params(cfg, rngs.params())
    elif len(params["blocks"]) != cfg.n_layers:
      raise ValueError(f"params has {len(params['blocks'])} blocks; the config has "
                       f"n_layers={cfg.n_layers}.")
    f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
    self.embed = Unit(f32(params["embed"]))
    self.blocks = nnx.List([Unit(f32(b)) for b in params["blocks"]])
    self.head = Unit(f32(params["head"]))

  def param_tree(self) -> Params:
    """The whole model's parameters.

    Returns:
      {"embed": ..., "blocks": [...], "head": ...}, plain arrays.
    """
    return {"embed": self.embed.tree(),
            "blocks": [b.tree() for b in self.blocks],
            "head": self.head.tree()}

  def load_param_tree(self, params: Params) -> None:
    """Sets every parameter, as fp32, from a whole model's tree.

    Args:
      params: the new values, laid out as `param_tree()`.
    """
    self.embed.set_tree(params["embed"])
    for block, p in zip(self.blocks, params["blocks"], strict=True):
      block.set_tree(p)
    self.head.set_tree(params["head"])

  def __call__(self, ids_BxT):
    return forward(self.cfg, self.param_tree(), ids_BxT, self.compute_dtype)
