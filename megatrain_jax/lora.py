"""LoRA: low-rank adapters on a frozen base, trained by either trainer.

  model = mt.Llama(cfg, rngs=nnx.Rngs(0))          # or mt.hf.from_pretrained(dir)[1]
  model = mt.lora.apply(model, mt.lora.LoraConfig(rank=16, alpha=32),
                        rngs=nnx.Rngs(1))
  trainer = mt.StreamingTrainer(model, tx, config, trainable=nnx.LoRAParam)

`apply` adds adapters (`nnx.LoRAParam` variables, so `trainable=nnx.LoRAParam`
selects them) to the projections `LoraConfig.targets` names, with Hugging Face's
names (q_proj ... down_proj). The math and the layout are in `models.lora`. With
`trainable=nnx.LoRAParam` the engine keeps the base on the host in
`EngineConfig.frozen_dtype` only: no fp32 master, no optimizer state, no gradient.
`merge` folds trained adapters into the kernels, for export or inference without
them.
"""

from __future__ import annotations

import jax
from flax import nnx

from megatrain_jax.models import llama
from megatrain_jax.models.lora import (  # pylint: disable=unused-import
    ALL_TARGETS, ATTENTION_TARGETS, ADAPTER_KEYS, LoraConfig, is_adapter, merged,
    merged_unit, strip_adapters)
from megatrain_jax.models.params import init_adapters_tree


def apply(model: llama.Llama, lora_config: LoraConfig, *, rngs: nnx.Rngs) -> llama.Llama:
  """Adds fresh adapters to a model, in place: lora_b is zero, so its output is
  unchanged until they train.

  Args:
    model: the model (without adapters).
    lora_config: which projections, the rank, alpha and dropout.
    rngs: the adapters' randomness (`rngs.params()` is drawn once).

  Returns:
    `model`, whose config now has `lora=lora_config`.

  Raises:
    ValueError: the model has adapters already, or an MoE model's feed-forward is
      targeted.
  """
  if not isinstance(lora_config, LoraConfig):
    raise TypeError(f"mt.lora.apply needs a LoraConfig, got {type(lora_config).__name__}.")
  if model.cfg.lora is not None:
    raise ValueError(f"The model has adapters already ({model.cfg.lora}); merge them "
                     "(mt.lora.merge) before adding others.")
  cfg = model.cfg.replace(lora=lora_config)  # validates the targets against the model
  tree = init_adapters_tree(cfg, model.param_tree(), rngs.params())
  replace_params(model, cfg, tree)
  return model


def merge(model: llama.Llama) -> llama.Llama:
  """Folds the adapters into the kernels (kernel + lora_a @ lora_b * alpha / r), in
  place, and removes them.

  Args:
    model: a model with adapters.

  Returns:
    `model`, whose config now has `lora=None`.

  Raises:
    ValueError: the model has no adapters.
  """
  if model.cfg.lora is None:
    raise ValueError("The model has no adapters to merge.")
  replace_params(model, model.cfg.replace(lora=None), merged_tree(model.cfg, model.param_tree()))
  return model


def merged_tree(cfg, params: dict) -> dict:
  """A whole model's tree with its adapters folded into the kernels.

  Args:
    cfg: the model's config (its `lora` gives the targets and scale).
    params: the tree, with adapters.

  Returns:
    The tree without adapters, fp32 where merged.
  """
  return {**params, "blocks": [merged_unit(b, cfg.lora) for b in params["blocks"]]}


def adapter_tree(params: dict) -> dict:
  """The adapter leaves of a whole model's tree, by path.

  Args:
    params: the tree (`Llama.param_tree()` or a trainer's `params()`).

  Returns:
    {path tuple: array} for every lora_a and lora_b leaf.
  """
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
    if is_adapter(keys):
      out[keys] = leaf
  return out


def replace_params(model: llama.Llama, cfg, tree: dict) -> None:
  """Replaces a model's config and units, in place, with ones of `tree`'s layout.

  Args:
    model: the model.
    cfg: its new config (adapters or none).
    tree: its new whole tree, of `cfg`'s layout.
  """
  fresh = llama.Llama(cfg, params=tree, compute_dtype=model.compute_dtype)
  model.cfg = cfg
  model.embed, model.blocks, model.head = fresh.embed, fresh.blocks, fresh.head


