"""Llama-family unit parameter trees: initialisation, abstract shapes, assembly.

Initialisation derives one PRNG key per unit from a base key (`unit_key`), so an
engine can build any unit alone, on the host, and get the same values the NNX model
would. `models.llama` has the layout and the functions that run the units.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from megatrain_jax.models import lora as lora_lib
from megatrain_jax.models import moe
from megatrain_jax.models.config import LlamaConfig

Params = dict[str, Any]
INIT_STD = 0.02


def unit_key(base_key: jax.Array, unit: str, index: int = 0) -> jax.Array:
  """The PRNG key of one unit: `unit` in {"embed", "block", "head"}.

  Args:
    base_key: the model's key.
    unit: the kind of unit.
    index: the block's index (0 for embed and head).

  Returns:
    `base_key` folded with the unit's kind, then with `index`.
  """
  kind = {"embed": 0, "block": 1, "head": 2}[unit]
  return jax.random.fold_in(jax.random.fold_in(base_key, kind), index)


def _normal(key, shape):
  return INIT_STD * jax.random.normal(key, shape, jnp.float32)


def init_embed(cfg: LlamaConfig, key: jax.Array) -> Params:
  """A fresh embedding unit: normal with std `INIT_STD`.

  Args:
    cfg: the model.
    key: the unit's PRNG key (`unit_key`).

  Returns:
    {"embedding": [V, D]}, fp32.
  """
  return {"embedding": _normal(key, (cfg.vocab_size, cfg.d_model))}


def init_block(cfg: LlamaConfig, key: jax.Array, moe_layer: bool = False) -> Params:
  """A fresh decoder block: kernels normal (std `INIT_STD`), norm scales 1, biases 0.

  Args:
    cfg: the model.
    key: the unit's PRNG key (`unit_key`).
    moe_layer: an MoE block (`cfg.layer_is_moe(i)`), whose "mlp" is `models.moe`'s
      tree.

  Returns:
    The block's tree (see the module docstring), fp32; with `cfg.lora`, the targeted
    projections carry fresh adapters (`models.lora.init_adapters`).
  """
  d, hd = cfg.d_model, cfg.head_dim
  q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
  kq, kk, kv, ko, kg, ku, kd = jax.random.split(key, 7)

  def dense(k, n_in, n_out, bias=False):
    p = {"kernel": _normal(k, (n_in, n_out))}
    if bias:
      p["bias"] = jnp.zeros((n_out,), jnp.float32)
    return p

  attn = {
      "q": dense(kq, d, q_dim, cfg.qkv_bias),
      "k": dense(kk, d, kv_dim, cfg.qkv_bias),
      "v": dense(kv, d, kv_dim, cfg.qkv_bias),
      "o": dense(ko, q_dim, d),
  }
  if cfg.qk_norm:
    attn["q_norm"] = {"scale": jnp.ones((hd,), jnp.float32)}
    attn["k_norm"] = {"scale": jnp.ones((hd,), jnp.float32)}
  if moe_layer:
    mlp_p = moe.init_moe(cfg, kg, _normal)
  else:
    mlp_p = {"gate": dense(kg, d, cfg.d_ff), "up": dense(ku, d, cfg.d_ff),
             "down": dense(kd, cfg.d_ff, d)}
  block = {
      "attn_norm": {"scale": jnp.ones((d,), jnp.float32)},
      "attn": attn,
      "mlp_norm": {"scale": jnp.ones((d,), jnp.float32)},
      "mlp": mlp_p,
  }
  if cfg.lora is not None:
    block = lora_lib.init_adapters(cfg.lora, block, adapter_key(key))
  return block


def adapter_key(block_key: jax.Array) -> jax.Array:
  """The PRNG key of a block's LoRA adapters (`models.lora`), from the block's key.

  Args:
    block_key: the block's key (`unit_key(base, "block", i)`).

  Returns:
    Its adapters' key.
  """
  return jax.random.fold_in(block_key, 0x10A)


def init_head(cfg: LlamaConfig, key: jax.Array) -> Params:
  """A fresh head: final norm scale one, LM head kernel normal with std `INIT_STD`.

  Args:
    cfg: the model.
    key: the unit's PRNG key (`unit_key`).

  Returns:
    {"final_norm": {"scale"}}, plus {"lm_head": {"kernel": [D, V]}} unless the
    embeddings are tied; fp32.
  """
  p = {"final_norm": {"scale": jnp.ones((cfg.d_model,), jnp.float32)}}
  if not cfg.tie_embeddings:
    p["lm_head"] = {"kernel": _normal(key, (cfg.d_model, cfg.vocab_size))}
  return p


# Jitted once per config: eager init would dispatch (and compile) op by op.
_jit_init_embed = jax.jit(init_embed, static_argnums=0)
_jit_init_block = jax.jit(init_block, static_argnums=(0, 2))
_jit_init_head = jax.jit(init_head, static_argnums=0)


@functools.lru_cache(maxsize=64)
def abstract_units(cfg: LlamaConfig) -> tuple[Any, ...]:
  """Every unit's abstract parameter tree, without allocating.

  Args:
    cfg: the model.

  Returns:
    ShapeDtypeStruct trees of the embedding, each block and the head; blocks of
    one structure (dense or MoE) share one tree object.
  """
  # The key is made inside each trace, so that nothing starts a JAX backend (a
  # launcher sizes pinned host memory before the accelerator's client exists).
  key = lambda: jax.random.key(0)
  kinds: dict[bool, Any] = {}
  blocks = []
  for i in range(cfg.n_layers):
    kind = cfg.layer_is_moe(i)
    if kind not in kinds:
      kinds[kind] = jax.eval_shape(lambda kind=kind: init_block(cfg, key(), kind))
    blocks.append(kinds[kind])
  return (jax.eval_shape(lambda: init_embed(cfg, key())), *blocks,
          jax.eval_shape(lambda: init_head(cfg, key())))


def assemble_units(units) -> Params:
  """The whole model's tree from its unit trees in unit order (embed, blocks, head).

  Args:
    units: the unit trees: embed, each block, head.

  Returns:
    {"embed": ..., "blocks": [...], "head": ...}.
  """
  units = list(units)
  return {"embed": units[0], "blocks": units[1:-1], "head": units[-1]}


def split_units(tree: Params) -> list[Params]:
  """The unit trees, in unit order, of a whole model's tree (`assemble_units` undone).

  Args:
    tree: the whole model's tree.

  Returns:
    The embed, each block and the head.
  """
  return [tree["embed"], *tree["blocks"], tree["head"]]


def init_adapters_tree(cfg: LlamaConfig, params: Params, base_key: jax.Array) -> Params:
  """A whole model's tree with fresh adapters (`cfg.lora`) on its blocks: block i's
  from the key `init_params` would give them.

  Args:
    cfg: the model, with `lora`.
    params: the tree without adapters (not changed).
    base_key: the adapters' base key.

  Returns:
    A new tree with the adapters.
  """
  blocks = [lora_lib.init_adapters(cfg.lora, b, adapter_key(unit_key(base_key, "block", i)))
            for i, b in enumerate(params["blocks"])]
  return {**params, "blocks": blocks}


def init_params(cfg: LlamaConfig, base_key: jax.Array) -> Params:
  """A fresh model's whole tree, each unit from its own key (`unit_key`).

  Args:
    cfg: the model.
    base_key: the model's key.

  Returns:
    {"embed": ..., "blocks": [...], "head": ...}, fp32.
  """
  return {"embed": _jit_init_embed(cfg, unit_key(base_key, "embed")),
          "blocks": [_jit_init_block(cfg, unit_key(base_key, "block", i), cfg.layer_is_moe(i))
                     for i in range(cfg.n_layers)],
          "head": _jit_init_head(cfg, unit_key(base_key, "head"))}
