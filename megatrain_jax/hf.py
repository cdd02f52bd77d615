"""Hugging Face checkpoints in and out: Llama, Qwen2, Qwen3, Mistral and their MoE kin (Mixtral,
Qwen2-MoE, Qwen3-MoE), safetensors on local disk.

    cfg, model = mt.hf.from_pretrained("path/to/dir")        # NNX model
    trainer = mt.hf.streaming_trainer("path/to/dir", optax.adamw(1e-5))
    mt.hf.save_pretrained(trainer, cfg, "out/dir")          # transformers loads it

Every tensor's shape and dtype is checked against config.json from the file
headers before anything is read or built. Reading then goes tensor by tensor with
numpy (`safetensors_reader`: bf16 and fp16 converted exactly, no PyTorch), one
unit at a time, so a checkpoint larger than the accelerator loads straight into
the streaming engine's host store. `config.json` is mapped key by key
(`megatrain_jax.hf_config`): what is not implemented is refused with the whole
list, never silently dropped.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.models import llama
from megatrain_jax.models.config import COMPUTE_FIELDS, LlamaConfig
from megatrain_jax.models.llama import Llama, Params
from megatrain_jax.hf_config import (ARCHITECTURES, NO_MATH_KEYS, config_from_hf,
                                     hf_config, read_config)
from megatrain_jax.hf_lora import (load_adapter, read_adapter_config, save_adapter,
                                   with_adapters)
from megatrain_jax.hf_names import (block_tensor_names, set_leaf, stack_slices, tree_get,
                                    unit_names, unit_trees)
from megatrain_jax.models import lora as lora_lib
from megatrain_jax.models.params import adapter_key, unit_key
from megatrain_jax.safetensors_reader import TensorInfo, checkpoint_tensors, read_tensor

__all__ = ["ARCHITECTURES", "NO_MATH_KEYS", "block_tensor_names", "check_checkpoint",
           "config_from_hf", "from_pretrained", "hf_config", "load_adapter", "load_units",
           "read_adapter_config", "read_config", "save_adapter", "save_pretrained",
           "streaming_trainer", "tree_get"]


# -- reading ----------------------------------------------------------------------

def _expected_shapes(cfg: LlamaConfig, architecture: str | None
                     ) -> list[dict[str, tuple[int, ...]]]:
  """For each unit, HF tensor name -> the shape config.json implies for it."""
  out = []
  for tree, names in zip(llama.abstract_units(cfg), unit_names(cfg, architecture),
                         strict=True):
    shapes = {}
    for name, (path, transpose) in names.items():
      sliced = isinstance(path[-1], int)
      shape = tuple(tree_get(tree, path[:-1] if sliced else path).shape)[int(sliced):]
      shapes[name] = tuple(reversed(shape)) if transpose else shape
    out.append(shapes)
  return out


def _architecture(local_dir: str, architecture: str | None) -> str:
  return architecture or read_config(local_dir)[1]


def check_checkpoint(local_dir: str, cfg: LlamaConfig, architecture: str | None = None
                     ) -> dict[str, TensorInfo]:
  """Checks every tensor of a checkpoint against `cfg` from the file headers alone.

  Args:
    local_dir: the checkpoint directory.
    cfg: the config read from its config.json.
    architecture: its architecture (default: read from config.json).

  Returns:
    name -> TensorInfo of the tensors the model reads.

  Raises:
    ValueError: one message listing what does not match: tensors missing (with the
      layers config.json promises and the weights hold), extra, of the wrong shape
      or of a non-floating dtype, each with its file; or an unreadable file.
    FileNotFoundError: no checkpoint file.
  """
  found = checkpoint_tensors(local_dir)
  expected = _expected_shapes(cfg, _architecture(local_dir, architecture))
  known = {n for names in expected for n in names}
  problems = []
  missing = [n for names in expected for n in names if n not in found]
  if missing:
    held = sorted({int(n.split(".")[2]) for n in found if n.startswith("model.layers.")})
    absent = sorted({int(n.split(".")[2]) for n in missing if n.startswith("model.layers.")})
    if absent and held and absent[0] > held[-1]:
      problems.append(
          f"config.json has num_hidden_layers={cfg.n_layers}, but the weights hold layers "
          f"{held[0]}..{held[-1]}: model.layers.{absent[0]}. and later are missing")
    problems += [f"{n} is missing" for n in missing
                 if not (n.startswith("model.layers.") and held and absent
                         and absent[0] > held[-1] and int(n.split(".")[2]) > held[-1])]
  # Some tied checkpoints store lm_head.weight anyway (a copy of the embedding).
  ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
  extra = sorted(n for n in found if n not in known and n not in ignorable
                 and not n.endswith("rotary_emb.inv_freq"))
  if extra:
    problems.append(f"it holds tensors this model does not use: {extra[:5]}"
                    f"{' ...' if len(extra) > 5 else ''}")
  for names in expected:
    for name, shape in names.items():
      info = found.get(name)
      if info is None:
        continue
      if info.shape != shape:
        problems.append(f"{name} in {info.path} has shape {info.shape}; config.json "
                        f"implies {shape}")
      if not info.floating:
        problems.append(f"{name} in {info.path} is {info.dtype_name}, not a floating type")
  if problems:
    raise ValueError(f"The checkpoint in {local_dir} does not match its config.json: "
                     + "; ".join(problems[:12]) + (" ..." if len(problems) > 12 else "")
                     + ". Is config.json the one these weights were saved with?")
  return found


def load_units(local_dir: str, cfg: LlamaConfig | None = None,
               architecture: str | None = None) -> Iterator[Params]:
  """The unit trees (embed, each block, head) as fp32 numpy, read one at a time.

  Every tensor is checked against the config before this returns (before any
  tensor is read), so a bad checkpoint fails here, never inside a step.

  Args:
    local_dir: the checkpoint directory.
    cfg: its config (default: read from its config.json).
    architecture: its architecture (default: read from config.json).

  Returns:
    An iterator over the unit trees.

  Raises:
    ValueError, FileNotFoundError: as `check_checkpoint`.
  """
  cfg = cfg or read_config(local_dir)[0]
  architecture = _architecture(local_dir, architecture)
  found = check_checkpoint(local_dir, cfg, architecture)

  def units():
    for names in unit_names(cfg, architecture):
      tree: dict = {}
      for name, (path, transpose) in names.items():
        x = read_tensor(found[name])
        set_leaf(tree, path, np.ascontiguousarray(x.T) if transpose else x, cfg.n_experts)
      yield stack_slices(tree)

  return units()


def _config(local_dir: str, compute: Mapping[str, Any] | None):
  """read_config, with the fields that change how the model computes (not what)."""
  cfg, arch, _ = read_config(local_dir)
  unknown = sorted(set(compute or {}) - set(COMPUTE_FIELDS))
  if unknown:
    raise ValueError(f"compute={unknown} are not settings of how a checkpoint's model "
                     f"computes; those are {COMPUTE_FIELDS}.")
  return (cfg.replace(**compute) if compute else cfg), arch


def streaming_trainer(local_dir: str, optimizer: optax.GradientTransformation,
                      config: EngineConfig | None = None,
                      compute: Mapping[str, Any] | None = None, *,
                      lora: lora_lib.LoraConfig | None = None, adapter_dir: str | None = None,
                      key: jax.Array | None = None, **kw) -> StreamingTrainer:
  """A `StreamingTrainer` over a checkpoint of any architecture in `ARCHITECTURES`, loaded unit by unit
  into the host store (the model is never whole on the device).

  Args:
    local_dir: the checkpoint directory.
    optimizer: any Optax transform.
    config: the engine config.
    compute: config fields that change how the model computes, not what
      (`models.config.COMPUTE_FIELDS`, e.g. {"attention_block": 512}).
    lora: fresh LoRA adapters on the checkpoint (`models.lora`), drawn from `key`.
    adapter_dir: a PEFT adapter to start from (its adapter_config.json says the
      rank and targets); not with `lora`.
    key: the fresh adapters' PRNG key (default: key 0).
    **kw: passed to `StreamingTrainer.from_units` (e.g. grad_hook, trainable). With
      adapters, `trainable` defaults to them (`nnx.LoRAParam`): the base is kept
      frozen in `EngineConfig.frozen_dtype`, no fp32 copy of it ever made whole.

  Returns:
    The trainer.

  Raises:
    ValueError, FileNotFoundError: a config, checkpoint or adapter that cannot be read
      (see `read_config`, `check_checkpoint`, `read_adapter_config`).
  """
  cfg, arch = _config(local_dir, compute)
  units = load_units(local_dir, cfg, arch)
  if lora is not None and adapter_dir is not None:
    raise ValueError("Pass lora= (fresh adapters) or adapter_dir= (a PEFT adapter), not both.")
  if lora is not None:
    cfg = cfg.replace(lora=lora)
    base = jax.random.key(0) if key is None else key
    units = (tree if not 0 < u <= cfg.n_layers else lora_lib.init_adapters(
        lora, tree, adapter_key(unit_key(base, "block", u - 1))) for u, tree in enumerate(units))
  elif adapter_dir is not None:
    cfg = cfg.replace(lora=read_adapter_config(adapter_dir))
    units = with_adapters(cfg, units, adapter_dir)
  if cfg.lora is not None:
    kw.setdefault("trainable", nnx.LoRAParam)
  return StreamingTrainer.from_units(cfg, optimizer, config, units, **kw)


def from_pretrained(local_dir: str, dtype=jnp.float32,
                    compute: Mapping[str, Any] | None = None) -> tuple[LlamaConfig, Llama]:
  """An NNX model from a local checkpoint directory (any architecture in `ARCHITECTURES`).

  To train a model bigger than the device, use `streaming_trainer` instead, which
  never builds the whole model on the device.

  Args:
    local_dir: the checkpoint directory.
    dtype: the model's compute dtype (parameters are fp32).
    compute: config fields that change how the model computes, not what
      (`models.config.COMPUTE_FIELDS`).

  Returns:
    (cfg, the model).
  """
  cfg, arch = _config(local_dir, compute)
  units = list(load_units(local_dir, cfg, arch))
  logging.info("Loaded %s checkpoint %s: %.1fM parameters.", arch, local_dir,
               cfg.param_count() / 1e6)
  params = {"embed": units[0], "blocks": units[1:-1], "head": units[-1]}
  return cfg, Llama(cfg, params=params, compute_dtype=dtype)


# -- writing ----------------------------------------------------------------------

def save_pretrained(model_or_trainer, cfg: LlamaConfig, out_dir: str,
                    architecture: str | None = None, max_shard_bytes: int = 4 * 2**30,
                    extra_config: dict[str, Any] | None = None,
                    merge_lora: bool = False) -> None:
  """Writes config.json and fp32 safetensors that `transformers` loads.

  Units are read one at a time, so a trainer's host store is never copied whole.

  Args:
    model_or_trainer: a `Llama`, a `StreamingTrainer`, a `ResidentTrainer` or a
      parameter tree.
    cfg: the model.
    out_dir: where to write (created if missing).
    architecture: as `hf_config`.
    max_shard_bytes: above this the weights are sharded, with
      model.safetensors.index.json.
    extra_config: a source config.json (token ids and such are kept).
    merge_lora: fold LoRA adapters into the kernels (`merge_and_unload` in PEFT);
      a model with adapters needs it (or `save_adapter` for the adapters alone).

  Raises:
    ValueError: the model has adapters and `merge_lora` is False.
  """
  from safetensors.numpy import save_file
  units = unit_trees(model_or_trainer)
  if cfg.lora is not None:
    if not merge_lora:
      raise ValueError("The model has LoRA adapters, which a plain checkpoint has no place "
                       "for: pass merge_lora=True to fold them into the weights, or write "
                       "them alone with mt.hf.save_adapter.")
    lc = cfg.lora
    units = (lora_lib.merged_unit(t, lc) for t in units)
    cfg = cfg.replace(lora=None)
  else:
    units = (_without_adapters(t) for t in units)
  os.makedirs(out_dir, exist_ok=True)
  config = hf_config(cfg, architecture, extra_config)
  written: list[list[str]] = []  # tensor names of each full shard on disk
  current: dict[str, np.ndarray] = {}
  size = 0

  def flush():
    nonlocal size
    save_file(current, os.path.join(out_dir, f"shard-{len(written):05d}.tmp"),
              metadata={"format": "pt"})
    written.append(list(current))
    current.clear()
    size = 0

  names_of = unit_names(cfg, config["model_type"])
  for names, tree in zip(names_of, units, strict=True):
    for name, (path, transpose) in names.items():
      x = np.asarray(tree_get(tree, path), np.float32)
      x = np.ascontiguousarray(x.T) if transpose else x
      if current and size + x.nbytes > max_shard_bytes:
        flush()
      current[name] = x
      size += x.nbytes
  if not written:
    save_file(current, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  else:
    flush()
    n, weight_map = len(written), {}
    for i, names in enumerate(written):
      final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
      os.replace(os.path.join(out_dir, f"shard-{i:05d}.tmp"), os.path.join(out_dir, final))
      weight_map.update({name: final for name in names})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w",
              encoding="utf-8") as f:
      json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
  with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  logging.info("Wrote %s (%s, %d file(s)).", out_dir, config["architectures"][0],
               max(1, len(written)))


def _without_adapters(tree: Params) -> Params:
  """A unit tree, refused if it has adapters its config does not say of."""
  if lora_lib.has_adapters(tree):
    raise ValueError("The model has LoRA adapters but the config given has lora=None (a "
                     "config read before mt.lora.apply?): pass the model's own config "
                     "(model.cfg or trainer.cfg), with merge_lora=True.")
  return tree


# Files of a source checkpoint that a fine-tuned export carries over unchanged.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def export(model_or_trainer, cfg: LlamaConfig, out_dir: str,
           source_dir: str | None = None, merge_lora: bool = False) -> None:
  """`save_pretrained`, keeping a source checkpoint's architecture, config entries
  and tokenizer files (a fine-tuned model that loads like its source).

  Args:
    model_or_trainer: as `save_pretrained`.
    cfg: the model.
    out_dir: where to write.
    source_dir: the Hugging Face checkpoint the model was fine-tuned from, if any.
    merge_lora: as `save_pretrained`.
  """
  arch, extra = (read_config(source_dir)[1:] if source_dir else (None, None))
  save_pretrained(model_or_trainer, cfg, out_dir, architecture=arch, extra_config=extra,
                  merge_lora=merge_lora)
  for name in TOKENIZER_FILES if source_dir else ():
    src = os.path.join(source_dir, name)
    if os.path.exists(src):
      shutil.copyfile(src, os.path.join(out_dir, name))
