"""config.json in and out: every key of a Hugging Face config mapped onto `LlamaConfig`.

Every key either maps onto a `LlamaConfig` field, is on the list of keys that do not
change the model's math, or has a value checked to be the one this implementation
computes. Anything else is refused with the whole list of what is not implemented,
never silently dropped. `hf_config` writes the keys back for `transformers`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from megatrain_jax.hf_moe import MOE_KEYS, moe_from_hf, moe_to_hf
from megatrain_jax.models.config import LAYER_TYPES, LlamaConfig
from megatrain_jax.models.rope import RopeScaling

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
                 "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Qwen3MoeForCausalLM": "qwen3_moe"}
# What each architecture's attention is like: the dense family it shares it with.
FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
          "mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}

# config.json keys that describe tokens, caching, training-time init or bookkeeping.
NO_MATH_KEYS = frozenset({
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "use_cache", "initializer_range", "dtype", "torch_dtype", "transformers_version",
    "_name_or_path", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "generation_config", "vocab_file",
    "id2label", "label2id", "problem_type", "is_decoder", "use_return_dict",
})

# Keys whose value is checked against what this implementation computes.
_CHECKS: dict[str, tuple[Callable[[Any, dict], bool], str]] = {
    "hidden_act": (lambda v, c: v in ("silu", "swish"), "only SiLU is implemented"),
    "attention_dropout": (lambda v, c: not v, "attention dropout is not implemented"),
    "pretraining_tp": (lambda v, c: v in (None, 1), "tensor-parallel slicing of the "
                       "MLP (pretraining_tp > 1) is not implemented"),
    "mlp_bias": (lambda v, c: not v, "MLP biases are not implemented"),
    "attention_bias": (lambda v, c: not v, "attention biases on Llama/Mistral/Qwen3 "
                       "(including the output projection) are not implemented"),
    "partial_rotary_factor": (lambda v, c: v == 1.0, "partial rotary embeddings are not "
                              "implemented"),
}

# The keys of each rotary scaling type (besides rope_type / type and rope_theta), and
# their names in `RopeScaling`.
_ROPE_KEYS = {
    "linear": {"factor": "factor"},
    "llama3": {"factor": "factor", "low_freq_factor": "low_freq_factor",
               "high_freq_factor": "high_freq_factor",
               "original_max_position_embeddings": "original_max_position_embeddings"},
    "yarn": {"factor": "factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
             "attention_factor": "attention_factor", "mscale": "mscale",
             "mscale_all_dim": "mscale_all_dim", "truncate": "truncate",
             "original_max_position_embeddings": "original_max_position_embeddings"},
}
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK scaling (frequencies that change with the sequence length "
               "at inference) is not implemented",
    "longrope": "LongRoPE's per-dimension factors are not implemented",
}


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None, list[str]]:
  """(rope_theta, the scaling or None, problems) from `rope_parameters` (transformers
  5) or `rope_scaling` with `rope_theta` (earlier)."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = params.pop("rope_type", params.pop("type", "default"))
  params.pop("partial_rotary_factor", None)  # checked as its own key when at top level
  if kind == "default":
    extra = sorted(params)
    return theta, None, [f"rope parameters {extra}: not used by the default rope type"
                         ] if extra else []
  if kind not in _ROPE_KEYS:
    why = _ROPE_REFUSED.get(kind, f"only {['default', *_ROPE_KEYS]} are implemented")
    return theta, None, [f"rope type {kind!r}: {why}"]
  unknown = sorted(set(params) - set(_ROPE_KEYS[kind]))
  if unknown:
    return theta, None, [f"rope type {kind!r} with {unknown}: not implemented"]
  kw = {ours: params[theirs] for theirs, ours in _ROPE_KEYS[kind].items()
        if params.get(theirs) is not None}
  if kind in ("llama3", "yarn"):
    kw.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
  try:
    return theta, RopeScaling(rope_type=kind, **kw), []
  except ValueError as e:
    return theta, None, [f"rope type {kind!r}: {e}"]


def _rope_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
  """`rope_parameters` for config.json."""
  out: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    out["rope_type"] = s.rope_type
    for theirs, ours in _ROPE_KEYS[s.rope_type].items():
      value = getattr(s, ours)
      if value is not None and not (ours == "truncate" and value is True):
        out[theirs] = value
  return out


# How each architecture decides which layers slide (transformers 5.24):
#   every      Mistral, Mixtral: every layer, when sliding_window is set;
#   every_on   Qwen3-MoE: every layer, with use_sliding_window;
#   per_layer  Qwen2, Qwen3, Qwen2-MoE: the layers layer_types names, with
#              use_sliding_window; without layer_types, Qwen2 and Qwen3 slide the layers
#              from max_window_layers on, Qwen2-MoE the even-numbered ones below it.
_WINDOW_STYLE = {"llama": None, "mistral": "every", "mixtral": "every",
                 "qwen3_moe": "every_on", "qwen2": "per_layer", "qwen3": "per_layer",
                 "qwen2_moe": "per_layer"}


def _default_layer_types(hf: dict[str, Any], arch: str, n: int) -> list[str]:
  first = hf.get("max_window_layers", 28)
  if arch == "qwen2_moe":
    slides = [bool((i + 1) % 2) and i < first for i in range(n)]
  else:
    slides = [i >= first for i in range(n)]
  return ["sliding_attention" if x else "full_attention" for x in slides]


def _windows_from_hf(hf: dict[str, Any], arch: str | None
                     ) -> tuple[int | None, tuple[str, ...] | None, list[str]]:
  """(sliding_window, layer_types, problems), as `transformers` reads them (see
  `_WINDOW_STYLE`). A window at least max_position_embeddings long is no window: no
  batch is longer (`check_batch`)."""
  window, types = hf.get("sliding_window"), hf.get("layer_types")
  n = hf.get("num_hidden_layers", 0)
  if types is not None and (not isinstance(types, list) or len(types) != n
                            or any(t not in LAYER_TYPES for t in types)):
    return None, None, [f"layer_types={types!r}: expected one of {LAYER_TYPES} for each "
                        f"of the {n} layers"]
  style = _WINDOW_STYLE.get(arch)
  if style is None:
    if window is not None or hf.get("use_sliding_window"):
      return None, None, [f"sliding_window={window!r}: {arch} has no sliding window"]
    return None, None, []
  if style != "every" and not hf.get("use_sliding_window", False):
    window = None  # transformers drops the window
  if window is None:
    return None, None, []
  if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
    return None, None, [f"sliding_window={window!r}: expected a positive integer"]
  if style == "per_layer":
    types = types if types is not None else _default_layer_types(hf, arch, n)
  elif types is not None and "full_attention" in types:
    return None, None, [f"layer_types={types!r}: {arch} slides every layer (transformers "
                        "ignores layer_types there); a mixed stack is a Qwen2, Qwen3 or "
                        "Qwen2-MoE config"]
  else:
    types = None
  if window >= hf.get("max_position_embeddings", window + 1):
    return None, None, []
  if types is not None:
    types = None if all(t == "sliding_attention" for t in types) else tuple(types)
    if types is not None and "sliding_attention" not in types:
      window = types = None
  return window, types, []


def _windows_to_hf(cfg: LlamaConfig, arch: str) -> dict[str, Any]:
  """config.json's window keys for `arch` (a mix it cannot hold refused)."""
  sliding = [cfg.layer_window(i) is not None for i in range(cfg.n_layers)]
  style = _WINDOW_STYLE[arch]
  if style is None:
    if any(sliding):
      raise ValueError(f"sliding_window cannot be written as {arch} (it has no sliding "
                       "window): write it as mistral, qwen2 or qwen3.")
    return {}
  window = cfg.sliding_window if any(sliding) else None
  if style in ("every", "every_on"):
    if any(sliding) and not all(sliding):
      raise ValueError(f"A stack mixing sliding and full attention cannot be written as "
                       f"{arch} (it slides every layer or none): write it as qwen2, qwen3 "
                       "or qwen2_moe.")
    if style == "every":
      return {"sliding_window": window}
    return {"use_sliding_window": any(sliding), "sliding_window": window}
  return {"use_sliding_window": any(sliding), "sliding_window": window,
          "max_window_layers": sliding.index(True) if any(sliding) else cfg.n_layers,
          "layer_types": ["sliding_attention" if x else "full_attention" for x in sliding]}


# Read apart: the rotary settings (`_rope_from_hf`), the head width, the windows and
# the experts.
_SPECIAL = frozenset({"rope_theta", "rope_parameters", "rope_scaling", "head_dim",
                      "sliding_window", "use_sliding_window", "max_window_layers",
                      "layer_types"}) | MOE_KEYS

_MAPPED = {"vocab_size": "vocab_size", "hidden_size": "d_model",
           "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
           "num_key_value_heads": "n_kv_heads", "intermediate_size": "d_ff",
           "max_position_embeddings": "max_seq_len", "rms_norm_eps": "norm_eps",
           "tie_word_embeddings": "tie_embeddings"}


def config_from_hf(hf: dict[str, Any]) -> tuple[LlamaConfig, str]:
  """The model config of a config.json dict.

  Args:
    hf: config.json's contents.

  Returns:
    (LlamaConfig, architecture: "llama", "qwen2", "qwen3" or "mistral").

  Raises:
    ValueError: listing every key or value this implementation does not handle.
  """
  archs = hf.get("architectures") or []
  arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
  if arch is None:
    arch = {v: v for v in ARCHITECTURES.values()}.get(hf.get("model_type"))
  problems = []
  if arch is None:
    problems.append(f"architectures={archs} / model_type={hf.get('model_type')!r}: only "
                    f"{sorted(ARCHITECTURES)} are implemented")
  theta, scaling, rope_problems = _rope_from_hf(hf)
  window, layer_types, window_problems = _windows_from_hf(hf, arch)
  moe_kw, moe_problems = moe_from_hf(hf, arch)
  problems += rope_problems + window_problems + moe_problems
  for key, value in hf.items():
    if key in _MAPPED or key in NO_MATH_KEYS or key in _SPECIAL:
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
  kw = {ours: hf[theirs] for theirs, ours in _MAPPED.items() if theirs in hf}
  kw["rope_theta"], kw["rope_scaling"] = theta, scaling
  kw["sliding_window"], kw["layer_types"] = window, layer_types
  kw.setdefault("n_kv_heads", hf["num_attention_heads"])
  kw["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
  kw["qkv_bias"] = FAMILY[arch] == "qwen2"
  kw["qk_norm"] = FAMILY[arch] == "qwen3"
  kw.update(moe_kw)
  kw["norm_eps"] = float(kw.get("norm_eps", 1e-6))
  head_dim = hf.get("head_dim")
  if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
    kw["attn_head_dim"] = int(head_dim)
  return LlamaConfig(**kw), arch


def read_config(local_dir: str) -> tuple[LlamaConfig, str, dict[str, Any]]:
  """The model config of a checkpoint directory's config.json.

  Args:
    local_dir: the directory.

  Returns:
    (LlamaConfig, architecture, the config.json dict).

  Raises:
    FileNotFoundError: no config.json.
    ValueError: config.json is not JSON, or uses what is not implemented.
  """
  path = os.path.join(local_dir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: pass a directory holding a Hugging "
                            "Face checkpoint (config.json and *.safetensors).")
  return _read_config_file(path)


def _read_config_file(path: str) -> tuple[LlamaConfig, str, dict[str, Any]]:
  try:
    with open(path, encoding="utf-8") as f:
      hf = json.load(f)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON ({e}).") from None
  cfg, arch = config_from_hf(hf)
  return cfg, arch, hf


def hf_config(cfg: LlamaConfig, architecture: str | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
  """The config.json of a model.

  Args:
    cfg: the model.
    architecture: a value of `ARCHITECTURES` (default: for a MoE model qwen2_moe with
      a shared expert, qwen3_moe with query/key norms, else mixtral; for a dense one
      qwen2 with q/k/v biases, qwen3 with query/key norms, mistral with a sliding
      window, else llama).
    extra: a source config.json, whose keys that do not change the math (token
      ids and such) are kept.

  Returns:
    config.json's contents.

  Raises:
    ValueError: an unknown architecture, or what it cannot hold (q/k/v biases,
      query/key norms, a sliding window, a mixed stack, experts).
  """
  if cfg.n_experts:
    default = ("qwen2_moe" if cfg.shared_expert_d_ff else "qwen3_moe" if cfg.qk_norm
               else "mixtral")
  else:
    default = ("qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else
               "mistral" if cfg.sliding_window is not None else "llama")
  arch = architecture or default
  if arch not in ARCHITECTURES.values():
    raise ValueError(f"architecture={arch!r} is not one of {sorted(ARCHITECTURES.values())}.")
  family = FAMILY[arch]
  if arch != "qwen2_moe" and cfg.qkv_bias != (family == "qwen2"):
    raise ValueError(f"qkv_bias={cfg.qkv_bias} cannot be written as {arch}: only Qwen2 "
                     "has (and needs) q/k/v biases.")
  if cfg.qk_norm != (family == "qwen3"):
    raise ValueError(f"qk_norm={cfg.qk_norm} cannot be written as {arch}: only Qwen3 "
                     "has (and needs) query/key norms.")
  name = {v: k for k, v in ARCHITECTURES.items()}[arch]
  out = {"architectures": [name], "model_type": arch, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
         "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
         "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
         "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
         "rope_theta": cfg.rope_theta, "rope_parameters": _rope_to_hf(cfg),
         "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
         "attention_dropout": 0.0, "torch_dtype": "float32", "use_cache": True}
  if arch == "llama":
    out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  out.update(_windows_to_hf(cfg, arch))
  out.update(moe_to_hf(cfg, arch, extra or {}))
  if family == "qwen3":
    out.update(attention_bias=False)
  for k, v in (extra or {}).items():
    if k in NO_MATH_KEYS and k not in ("architectures", "model_type"):
      out[k] = v
  return out


def config_from_hf_json(path: str) -> LlamaConfig:
  """A LlamaConfig from a Hugging Face config.json file, wherever it is.

  Args:
    path: the file.

  Returns:
    The config.

  Raises:
    ValueError: the file is not JSON, or uses what is not implemented.
  """
  return _read_config_file(path)[0]
