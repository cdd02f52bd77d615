"""LoRA adapters in PEFT's format: `adapter_config.json` and `adapter_model.safetensors`.

    mt.hf.save_adapter(trainer, cfg, "out/adapter")     # PeftModel.from_pretrained loads it
    model = mt.hf.load_adapter(model, "some/adapter")   # adapters from a PEFT directory

PEFT names layer i's adapter on q_proj
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]: our lora_a and lora_b transposed (`models.lora`).
Settings PEFT has and this engine does not (DoRA, rsLoRA, per-module ranks, biases,
modules_to_save, fan_in_fan_out, a regex for the targets) are refused by name on
reading, never dropped.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np
from absl import logging

from megatrain_jax.hf_names import unit_trees
from megatrain_jax.models import lora as lora_lib
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.llama import Llama, Params, assemble_units, split_units
from megatrain_jax.models.params import abstract_units
from megatrain_jax.safetensors_reader import read_header, read_tensor

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers."
# PEFT settings this engine reads, with the value each must have when it does not
# implement others.
_MUST_BE = {"peft_type": "LORA", "bias": "none", "use_dora": False, "use_rslora": False,
            "fan_in_fan_out": False, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
            "lora_bias": False, "exclude_modules": None, "target_parameters": None,
            "layer_replication": None, "trainable_token_indices": None}


def tensor_name(layer: int, target: str, which: str) -> str:
  """PEFT's name of one adapter matrix.

  Args:
    layer: the layer (0-based).
    target: the projection (`models.lora.ALL_TARGETS`).
    which: "A" or "B".

  Returns:
    e.g. "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".
  """
  part = "self_attn" if lora_lib.TARGETS[target][0] == "attn" else "mlp"
  return f"{_PREFIX}{layer}.{part}.{target}.lora_{which}.weight"


def adapter_config(lora: lora_lib.LoraConfig, base_model: str | None = None) -> dict[str, Any]:
  """PEFT's adapter_config.json for our adapters.

  Args:
    lora: the adapters' config.
    base_model: the base checkpoint's name or path, recorded for PEFT.

  Returns:
    The JSON object.
  """
  return {**_MUST_BE, "r": lora.rank, "lora_alpha": lora.alpha,
          "target_modules": sorted(lora.targets), "lora_dropout": lora.dropout,
          "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
          "inference_mode": True, "init_lora_weights": True}


def read_adapter_config(adapter_dir: str) -> lora_lib.LoraConfig:
  """Our `LoraConfig` from a PEFT adapter directory.

  Args:
    adapter_dir: the directory with adapter_config.json.

  Returns:
    The config.

  Raises:
    FileNotFoundError: no adapter_config.json there.
    ValueError: settings this engine does not implement, all of them named.
  """
  path = os.path.join(adapter_dir, ADAPTER_CONFIG)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: {adapter_dir} is not a PEFT adapter "
                            "directory (it needs adapter_config.json and "
                            "adapter_model.safetensors).")
  with open(path, encoding="utf-8") as f:
    c = json.load(f)
  bad = [f"{k}={c[k]!r} (needs {v!r})" for k, v in _MUST_BE.items()
         if k in c and c[k] != v and not (v in ({}, None) and not c[k])]
  missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in c]
  if missing:
    raise ValueError(f"{path} lacks {missing}: it is not a LoRA adapter config.")
  if c.get("init_lora_weights", True) not in (True, False, "gaussian"):
    bad.append(f"init_lora_weights={c['init_lora_weights']!r} (it changes the base "
               "weights too; True, False or 'gaussian' is read)")
  targets = c.get("target_modules")
  if isinstance(targets, str):
    bad.append(f"target_modules={targets!r} (a regex; a list of projection names is read)")
  elif not targets or any(t not in lora_lib.TARGETS for t in targets):
    bad.append(f"target_modules={targets!r} (needs names among {list(lora_lib.ALL_TARGETS)})")
  if bad:
    raise ValueError(f"{path} has settings this engine does not implement: "
                     f"{'; '.join(bad)}.")
  return lora_lib.LoraConfig(rank=int(c["r"]), alpha=float(c["lora_alpha"]),
                             targets=tuple(t for t in lora_lib.ALL_TARGETS if t in targets),
                             dropout=float(c.get("lora_dropout") or 0.0))


def save_adapter(model_or_trainer, cfg: LlamaConfig, out_dir: str,
                 base_model: str | None = None) -> None:
  """Writes a model's adapters as a PEFT adapter (fp32), one unit at a time.

  Args:
    model_or_trainer: a `Llama`, a `StreamingTrainer`, a `ResidentTrainer` or a
      parameter tree, with adapters.
    cfg: the model (`cfg.lora` set).
    out_dir: where to write (created if missing).
    base_model: the base checkpoint's name or path, recorded in the config.

  Raises:
    ValueError: the model has no adapters.
  """
  from safetensors.numpy import save_file
  if cfg.lora is None:
    raise ValueError("The model has no LoRA adapters to save (its config's lora is None); "
                     "save the whole model with mt.hf.save_pretrained.")
  tensors = {}
  for u, tree in enumerate(unit_trees(model_or_trainer)):  # one unit at a time
    if not 0 < u <= cfg.n_layers:
      continue
    i = u - 1
    for target in cfg.lora.targets:
      part, name = lora_lib.TARGETS[target]
      p = tree[part][name]
      tensors[tensor_name(i, target, "A")] = np.ascontiguousarray(
          np.asarray(p["lora_a"], np.float32).T)
      tensors[tensor_name(i, target, "B")] = np.ascontiguousarray(
          np.asarray(p["lora_b"], np.float32).T)
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(out_dir, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
    json.dump(adapter_config(cfg.lora, base_model), f, indent=2, sort_keys=True)
  logging.info("Wrote the LoRA adapter (rank %d, %s) to %s.", cfg.lora.rank,
               ",".join(cfg.lora.targets), out_dir)


def _adapter_tensors(adapter_dir: str, cfg: LlamaConfig) -> dict[str, np.ndarray]:
  """The adapter's tensors, checked against the model: every one there, of its shape."""
  path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist (adapter_model.bin, PyTorch's pickle "
                            "format, is not read: save the adapter with safetensors).")
  # fp32, bf16 or fp16 on disk, converted exactly (numpy has no bf16 of its own).
  found = {k.replace(".default.", "."): info for k, info in read_header(path).items()}
  tree = abstract_units(cfg)[1:-1]
  want = {}
  for i, block in enumerate(tree):
    for target in cfg.lora.targets:
      part, name = lora_lib.TARGETS[target]
      a, b = block[part][name]["lora_a"].shape, block[part][name]["lora_b"].shape
      want[tensor_name(i, target, "A")] = tuple(reversed(a))
      want[tensor_name(i, target, "B")] = tuple(reversed(b))
  missing = sorted(set(want) - set(found))
  extra = sorted(set(found) - set(want))
  shapes = [f"{k}: {found[k].shape} (needs {want[k]})" for k in want
            if k in found and tuple(found[k].shape) != want[k]]
  shapes += [f"{k}: {found[k].dtype} (needs a floating dtype)" for k in want
             if k in found and found[k].dtype not in ("F32", "BF16", "F16")]
  if missing or extra or shapes:
    raise ValueError(f"{path} does not match the model and its adapter_config.json: "
                     f"missing {missing[:4]}{'...' if len(missing) > 4 else ''} "
                     f"extra {extra[:4]}{'...' if len(extra) > 4 else ''} "
                     f"wrong shapes or dtypes {shapes[:4]}.")
  return {k: read_tensor(found[k]) for k in want}


def with_adapters(cfg: LlamaConfig, units: Iterator[Params], adapter_dir: str
                  ) -> Iterator[Params]:
  """Base unit trees (without adapters) with a PEFT adapter's matrices added.

  Args:
    cfg: the model, with `lora` as the adapter's config.
    units: the base's unit trees, in unit order (one at a time).
    adapter_dir: the PEFT adapter directory.

  Returns:
    The unit trees with the adapters, one at a time.
  """
  tensors = _adapter_tensors(adapter_dir, cfg)
  for u, tree in enumerate(units):
    if 0 < u <= cfg.n_layers:
      tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
      for target in cfg.lora.targets:
        part, name = lora_lib.TARGETS[target]
        tree[part][name] = {
            **tree[part][name],
            "lora_a": np.ascontiguousarray(tensors[tensor_name(u - 1, target, "A")].T),
            "lora_b": np.ascontiguousarray(tensors[tensor_name(u - 1, target, "B")].T)}
    yield tree


def load_adapter(model: Llama, adapter_dir: str) -> Llama:
  """Puts a PEFT adapter's matrices on a model, in place (replacing any it had).

  Args:
    model: the base model (with or without adapters).
    adapter_dir: the PEFT adapter directory.

  Returns:
    `model`, whose config has the adapter's `lora`.

  Raises:
    FileNotFoundError, ValueError: an adapter that cannot be read or does not fit.
  """
  from megatrain_jax import lora
  cfg = model.cfg.replace(lora=read_adapter_config(adapter_dir))
  base = lora_lib.strip_adapters(model.param_tree())  # any adapters it had are replaced
  units = list(with_adapters(cfg, iter(split_units(base)), adapter_dir))
  lora.replace_params(model, cfg, assemble_units(units))
  return model
