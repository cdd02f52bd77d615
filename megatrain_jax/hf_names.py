"""Hugging Face tensor names mapped onto the unit trees, the nested-dict helpers that
build a unit tree from them, and a model's unit trees one at a time
(`megatrain_jax.hf` and `hf_lora` read and write with these).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from megatrain_jax.engine import StreamingTrainer
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.llama import Llama, Params, split_units
from megatrain_jax.resident import ResidentTrainer


def block_tensor_names(i: int, cfg: LlamaConfig, architecture: str | None = None
                       ) -> dict[str, tuple[tuple[Any, ...], bool]]:
  """How one layer's Hugging Face tensors map onto our block tree.

  Args:
    i: the layer (0-based).
    cfg: the model (q/k/v biases or not, experts or not).
    architecture: names an MoE layer's tensors as Mixtral does
      (`block_sparse_moe.experts.E.w1`) when "mixtral", else as Qwen-MoE does
      (`mlp.experts.E.gate_proj`).

  Returns:
    HF tensor name -> (path in our block tree, whether it is stored transposed). A
    path ending in an int names one expert's slice of a stacked [E, ...] leaf.
  """
  pre = f"model.layers.{i}."
  names = {pre + "input_layernorm.weight": (("attn_norm", "scale"), False),
           pre + "post_attention_layernorm.weight": (("mlp_norm", "scale"), False)}
  for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
    names[f"{pre}self_attn.{theirs}.weight"] = (("attn", ours, "kernel"), True)
    if cfg.qkv_bias and ours != "o":
      names[f"{pre}self_attn.{theirs}.bias"] = (("attn", ours, "bias"), False)
  if cfg.qk_norm:
    for ours in ("q_norm", "k_norm"):
      names[f"{pre}self_attn.{ours}.weight"] = (("attn", ours, "scale"), False)
  if not cfg.layer_is_moe(i):
    for ours in ("gate", "up", "down"):
      names[f"{pre}mlp.{ours}_proj.weight"] = (("mlp", ours, "kernel"), True)
    return names
  mixtral = architecture == "mixtral"
  moe = pre + ("block_sparse_moe." if mixtral else "mlp.")
  names[moe + "gate.weight"] = (("mlp", "router", "kernel"), True)
  theirs = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {
      "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
  for e in range(cfg.n_experts):
    for ours, name in theirs.items():
      names[f"{moe}experts.{e}.{name}.weight"] = (("mlp", "experts", ours, "kernel", e), True)
  if cfg.shared_expert_d_ff:
    for ours in ("gate", "up", "down"):
      names[f"{moe}shared_expert.{ours}_proj.weight"] = (("mlp", "shared", ours, "kernel"),
                                                         True)
    names[moe + "shared_expert_gate.weight"] = (("mlp", "shared_gate", "kernel"), True)
  return names


def unit_names(cfg: LlamaConfig, architecture: str | None = None
                ) -> list[dict[str, tuple[tuple[Any, ...], bool]]]:
  """Each unit's map of Hugging Face tensor names, embed and head included.

  Args:
    cfg: the model.
    architecture: as `block_tensor_names`.

  Returns:
    One map per unit, in unit order, as `block_tensor_names` gives a block's.
  """
  embed = {"model.embed_tokens.weight": (("embedding",), False)}
  head = {"model.norm.weight": (("final_norm", "scale"), False)}
  if not cfg.tie_embeddings:
    head["lm_head.weight"] = (("lm_head", "kernel"), True)
  return ([embed] + [block_tensor_names(i, cfg, architecture) for i in range(cfg.n_layers)]
          + [head])


def set_leaf(tree: dict, path: tuple[Any, ...], value, stack: int) -> None:
  """Sets a leaf, or (a path ending in an int) one of `stack` slices of a leaf.

  Args:
    tree: the nested dict, built as it goes.
    path: keys, outermost first; a final int names a slice.
    value: the leaf or slice.
    stack: slices of a sliced leaf.
  """
  *keys, last = path
  if isinstance(last, int):
    *keys, leaf = keys
    for k in keys:
      tree = tree.setdefault(k, {})
    tree.setdefault(leaf, [None] * stack)[last] = value
    return
  for k in keys:
    tree = tree.setdefault(k, {})
  tree[last] = value


def stack_slices(tree):
  """The tree with every list of slices `set_leaf` built stacked into one array.

  Args:
    tree: a nested dict from `set_leaf`.

  Returns:
    The same layout, each list of slices one array.
  """
  if isinstance(tree, list):
    return np.stack(tree)
  return {k: stack_slices(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def tree_get(tree: dict, path: tuple[Any, ...]):
  """The leaf at a path of a nested dict.

  Args:
    tree: the dict.
    path: keys, outermost first; a final int indexes the leaf's first axis.

  Returns:
    The leaf (or its slice).
  """
  for k in path:
    tree = tree[k]
  return tree


def unit_trees(obj) -> Iterator[Params]:
  """Unit trees of a model, in unit order (embed, each block, head).

  Args:
    obj: a `Llama`, a `StreamingTrainer` (read one unit at a time), a
      `ResidentTrainer` or a whole parameter tree.

  Returns:
    An iterator over the unit trees.

  Raises:
    TypeError: `obj` is none of those.
  """
  if isinstance(obj, Llama):
    yield obj.embed.tree()
    for b in obj.blocks:
      yield b.tree()
    yield obj.head.tree()
  elif isinstance(obj, StreamingTrainer):
    for u in range(obj.schedule.n_units):
      yield obj.unit_params(u)
  elif isinstance(obj, (ResidentTrainer, dict)):
    yield from split_units(obj.params() if isinstance(obj, ResidentTrainer) else obj)
  else:
    raise TypeError(f"save_pretrained takes a Llama, a trainer or a parameter tree, got "
                    f"{type(obj).__name__}.")
