"""Hugging Face checkpoints in and out: Llama, Qwen2 and Mistral safetensors on local disk.

    cfg, model = mt.hf.from_pretrained("path/to/dir")        # NNX model
    trainer = mt.StreamingTrainer.from_pretrained("path/to/dir", optax.adamw(1e-5))
    mt.hf.save_pretrained(trainer, cfg, "out/dir")          # transformers loads it

Reading goes tensor by tensor through `safetensors` (numpy; PyTorch is not
needed), one unit at a time, so a checkpoint larger than the accelerator loads
straight into the streaming engine's host store. `config.json` is mapped key by
key: every key either maps onto `LlamaConfig`, is on the list of keys that do
not change the model's math, or has a value checked to be the one this
implementation computes. Anything else is refused with the whole list of what
is not implemented, never silently dropped.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.llama import Llama, Params

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "MistralForCausalLM": "mistral"}

# config.json keys that describe tokens, caching, training-time init or bookkeeping.
NO_MATH_KEYS = frozenset({
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "use_cache", "initializer_range", "dtype", "torch_dtype", "transformers_version",
    "_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "max_window_layers", "generation_config", "vocab_file",
    "id2label", "label2id", "problem_type", "is_decoder", "use_return_dict",
})

# Keys whose value is checked against what this implementation computes.
_CHECKS: dict[str, tuple[Callable[[Any, dict], bool], str]] = {
    "hidden_act": (lambda v, c: v in ("silu", "swish"), "only SiLU is implemented"),
    "attention_dropout": (lambda v, c: not v, "attention dropout is not implemented"),
    "pretraining_tp": (lambda v, c: v in (None, 1), "tensor-parallel slicing of the "
                       "MLP (pretraining_tp > 1) is not implemented"),
    "mlp_bias": (lambda v, c: not v, "MLP biases are not implemented"),
    "attention_bias": (lambda v, c: not v, "attention biases on Llama/Mistral "
                       "(including the output projection) are not implemented"),
    "rope_scaling": (lambda v, c: v is None or v.get("rope_type", v.get("type")) == "default",
                     "rope scaling is not implemented"),
    "use_sliding_window": (lambda v, c: not v, "sliding-window attention is not "
                           "implemented"),
    "sliding_window": (lambda v, c: v is None or c.get("use_sliding_window") is False
                       or v >= c.get("max_position_embeddings", 0),
                       "an active sliding window (shorter than max_position_embeddings) "
                       "is not implemented"),
    "layer_types": (lambda v, c: all(t == "full_attention" for t in v),
                    "only full attention is implemented"),
    "head_dim": (lambda v, c: v is None or v * c["num_attention_heads"] == c["hidden_size"],
                 "head_dim must equal hidden_size / num_attention_heads"),
    "rope_parameters": (lambda v, c: v.get("rope_type", "default") == "default"
                        and set(v) <= {"rope_type", "rope_theta"},
                        "only the default rope type is implemented"),
}

_MAPPED = {"vocab_size": "vocab_size", "hidden_size": "d_model",
           "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ff",
           "max_position_embeddings": "max_seq_len", "rms_norm_eps": "norm_eps",
           "tie_word_embeddings": "tie_embeddings", "rope_theta": "rope_theta"}


def config_from_hf(hf: dict[str, Any]) -> tuple[LlamaConfig, str]:
  """(LlamaConfig, architecture) from a config.json dict; ValueError lists what is
  not implemented."""
  archs = hf.get("architectures") or []
  arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if arch is None:
    arch = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}.get(hf.get("model_type"))
  problems = []
  if arch is None:
    problems.append(f"architectures={archs} / model_type={hf.get('model_type')!r}: only "
                    f"{sorted(ARCHITECTURES)} are implemented")
  for key, value in hf.items():
    if key in _MAPPED or key in NO_MATH_KEYS:
      continue
    if key in _CHECKS:
      ok, why = _CHECKS[key]
      if value is not None and not ok(value, hf):
        problems.append(f"{key}={value!r}: {why}")
      continue
    problems.append(f"{key}={value!r}: unknown key")
  if problems:
    raise ValueError("This config.json uses what megatrain_jax does not implement:\n  "
                     + "\n  ".join(problems))
  rope = hf.get("rope_parameters") or {}
  kw = {ours: hf[theirs] for theirs, ours in _MAPPED.items() if theirs in hf}
  kw["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kw.setdefault("n_kv_heads", hf["num_attention_heads"])
  kw["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
  kw["qkv_bias"] = arch == "qwen2"
  kw["norm_eps"] = float(kw.get("norm_eps", 1e-6))
  return LlamaConfig(**kw), arch


def read_config(local_dir: str) -> tuple[LlamaConfig, str, dict[str, Any]]:
  path = os.path.join(local_dir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: pass a directory holding a Hugging "
                            "Face checkpoint (config.json and *.safetensors).")
  with open(path, encoding="utf-8") as f:
    hf = json.load(f)
  cfg, arch = config_from_hf(hf)
  return cfg, arch, hf


# -- tensor names -----------------------------------------------------------------

def _block_names(i: int, cfg: LlamaConfig) -> dict[str, tuple[tuple[str, ...], bool]]:
  """HF tensor name -> (path in our block tree, transpose?)."""
  pre = f"model.layers.{i}."
  names = {pre + "input_layernorm.weight": (("attn_norm", "scale"), False),
           pre + "post_attention_layernorm.weight": (("mlp_norm", "scale"), False)}
  for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
    names[f"{pre}self_attn.{theirs}.weight"] = (("attn", ours, "kernel"), True)
    if cfg.qkv_bias and ours != "o":
      names[f"{pre}self_attn.{theirs}.bias"] = (("attn", ours, "bias"), False)
  for ours in ("gate", "up", "down"):
    names[f"{pre}mlp.{ours}_proj.weight"] = (("mlp", ours, "kernel"), True)
  return names


def _unit_names(cfg: LlamaConfig) -> list[dict[str, tuple[tuple[str, ...], bool]]]:
  embed = {"model.embed_tokens.weight": (("embedding",), False)}
  head = {"model.norm.weight": (("final_norm", "scale"), False)}
  if not cfg.tie_embeddings:
    head["lm_head.weight"] = (("lm_head", "kernel"), True)
  return [embed] + [_block_names(i, cfg) for i in range(cfg.n_layers)] + [head]


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
  for k in path:
    tree = tree[k]
  return tree


# -- reading ----------------------------------------------------------------------

class _Tensors:
  """Tensors of a single or sharded safetensors checkpoint, opened lazily."""

  def __init__(self, local_dir: str):
    from safetensors import safe_open
    self._open = safe_open
    index = os.path.join(local_dir, "model.safetensors.index.json")
    single = os.path.join(local_dir, "model.safetensors")
    if os.path.exists(index):
      with open(index, encoding="utf-8") as f:
        self.where = {k: os.path.join(local_dir, v) for k, v in json.load(f)["weight_map"].items()}
    elif os.path.exists(single):
      with safe_open(single, framework="numpy") as f:
        self.where = {k: single for k in f.keys()}
    else:
      raise FileNotFoundError(f"{local_dir} holds neither model.safetensors nor "
                              "model.safetensors.index.json.")
    self._files: dict[str, Any] = {}

  def close(self) -> None:
    for f in self._files.values():
      f.__exit__(None, None, None)
    self._files.clear()

  def get(self, name: str) -> np.ndarray:
    if name not in self.where:
      raise KeyError(f"The checkpoint has no tensor {name!r}.")
    path = self.where[name]
    if path not in self._files:
      self._files[path] = self._open(path, framework="numpy").__enter__()
    return self._files[path].get_tensor(name)


def load_units(local_dir: str, cfg: LlamaConfig | None = None) -> Iterator[Params]:
  """Yields the unit trees (embed, each block, head) as fp32 numpy, one at a time."""
  cfg = cfg or read_config(local_dir)[0]
  tensors = _Tensors(local_dir)
  expected = _unit_names(cfg)
  known = {n for names in expected for n in names}
  # Some tied checkpoints store lm_head.weight anyway (a copy of the embedding).
  ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
  extra = sorted(n for n in tensors.where if n not in known and n not in ignorable
                 and not n.endswith("rotary_emb.inv_freq"))
  if extra:
    raise ValueError(f"The checkpoint holds tensors this model does not use: {extra[:5]}"
                     f"{' ...' if len(extra) > 5 else ''}; is config.json the right one?")
  try:
    for names in expected:
      tree: dict = {}
      for name, (path, transpose) in names.items():
        x = np.asarray(tensors.get(name), np.float32)
        _set(tree, path, np.ascontiguousarray(x.T) if transpose else x)
      yield tree
  finally:
    tensors.close()


def from_pretrained(local_dir: str, dtype=jnp.float32) -> tuple[LlamaConfig, Llama]:
  """(cfg, NNX model) from a local Llama / Qwen2 / Mistral checkpoint directory.

  `dtype` is the model's compute dtype; parameters are fp32. To train a model
  bigger than the device, use `StreamingTrainer.from_pretrained` instead, which
  never builds the whole model on the device.
  """
  cfg, arch, _ = read_config(local_dir)
  units = list(load_units(local_dir, cfg))
  logging.info("Loaded %s checkpoint %s: %.1fM parameters.", arch, local_dir,
               cfg.param_count() / 1e6)
  params = {"embed": units[0], "blocks": units[1:-1], "head": units[-1]}
  return cfg, Llama(cfg, params=params, compute_dtype=dtype)


# -- writing ----------------------------------------------------------------------

def _unit_trees(obj) -> Iterator[Params]:
  """Unit trees of a Llama, a StreamingTrainer or a ResidentTrainer (or a params tree)."""
  if isinstance(obj, Llama):
    yield obj.embed.tree()
    for b in obj.blocks:
      yield b.tree()
    yield obj.head.tree()
  elif hasattr(obj, "unit_params"):
    for u in range(obj.n_units):
      yield obj.unit_params(u)
  else:
    tree = obj.params() if hasattr(obj, "params") else obj
    yield tree["embed"]
    yield from tree["blocks"]
    yield tree["head"]


def hf_config(cfg: LlamaConfig, architecture: str | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
  """config.json for `cfg`; architecture defaults to qwen2 with qkv biases, else llama."""
  arch = architecture or ("qwen2" if cfg.qkv_bias else "llama")
  if arch not in ARCHITECTURES.values():
    raise ValueError(f"architecture={arch!r} is not one of {sorted(ARCHITECTURES.values())}.")
  if cfg.qkv_bias != (arch == "qwen2"):
    raise ValueError(f"qkv_bias={cfg.qkv_bias} cannot be written as {arch}: only Qwen2 "
                     "has q/k/v biases.")
  name = {v: k for k, v in ARCHITECTURES.items()}[arch]
  out = {"architectures": [name], "model_type": arch, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
         "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
         "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
         "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
         "rope_theta": cfg.rope_theta,
         "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
         "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
         "attention_dropout": 0.0, "torch_dtype": "float32", "use_cache": True}
  if arch == "llama":
    out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  else:
    out.update(sliding_window=None, use_sliding_window=False)
  for k, v in (extra or {}).items():
    if k in NO_MATH_KEYS and k not in ("architectures", "model_type"):
      out[k] = v
  return out


def save_pretrained(model_or_trainer, cfg: LlamaConfig, out_dir: str,
                    architecture: str | None = None, max_shard_bytes: int = 4 * 2**30,
                    extra_config: dict[str, Any] | None = None) -> None:
  """Writes config.json and fp32 safetensors (sharded above `max_shard_bytes`, with
  model.safetensors.index.json) that `transformers` loads.

  Units are read one at a time, so a trainer's host store is never copied whole.
  `extra_config` carries token ids and such from the source config.json.
  """
  from safetensors.numpy import save_file
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

  for names, tree in zip(_unit_names(cfg), _unit_trees(model_or_trainer), strict=True):
    for name, (path, transpose) in names.items():
      x = np.asarray(_get(tree, path), np.float32)
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
