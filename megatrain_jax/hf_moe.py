"""config.json's mixture-of-experts keys in and out, as transformers builds Mixtral,
Qwen2-MoE and Qwen3-MoE (`megatrain_jax.hf_config` maps the rest).
"""

from __future__ import annotations

from typing import Any

from megatrain_jax.models.config import LlamaConfig

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")

MOE_KEYS = frozenset({
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "router_aux_loss_coef", "output_router_logits",
    "router_jitter_noise", "qkv_bias"})


def moe_from_hf(hf: dict[str, Any], arch: str | None) -> tuple[dict[str, Any], list[str]]:
  """The MoE fields of `LlamaConfig` (and qkv_bias), and problems, as transformers
  builds the layers: Mixtral's every layer is MoE with width intermediate_size and
  renormalized top-k; Qwen2-MoE and Qwen3-MoE make layer i MoE unless it is in
  `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`. The
  load-balancing loss is in the training loss only with `output_router_logits`.

  Args:
    hf: the config.json dict.
    arch: its architecture (`hf_config.ARCHITECTURES`' values).

  Returns:
    (the fields, what is not implemented: one line each).
  """
  present = sorted(k for k in MOE_KEYS if k in hf and k != "qkv_bias")
  if arch not in MOE_ARCHITECTURES:
    problems = [f"{k}={hf[k]!r}: {arch} has no mixture-of-experts layers" for k in present]
    if "qkv_bias" in hf:
      problems.append(f"qkv_bias={hf['qkv_bias']!r}: unknown key for {arch}")
    return {}, problems
  n = hf.get("num_hidden_layers", 0)
  experts = hf.get("num_local_experts", hf.get("num_experts", 8))
  out: dict[str, Any] = {"n_experts": experts,
                         "n_experts_per_tok": hf.get("num_experts_per_tok", 2)}
  problems = []
  if hf.get("router_jitter_noise"):
    problems.append(f"router_jitter_noise={hf['router_jitter_noise']!r}: router jitter "
                    "noise is not implemented")
  coef = float(hf.get("router_aux_loss_coef", 0.0) or 0.0)
  out["router_aux_loss_coef"] = coef if hf.get("output_router_logits") else 0.0
  if arch == "mixtral":
    out["norm_topk_prob"] = True
    return out, problems
  out["moe_d_ff"] = hf.get("moe_intermediate_size")
  out["norm_topk_prob"] = bool(hf.get("norm_topk_prob", False))
  step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
  moe_layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                     for i in range(n))
  out["moe_layers"] = None if all(moe_layers) else moe_layers
  if not any(moe_layers):
    out.update(n_experts=0, moe_layers=None)
  if arch == "qwen2_moe":
    shared = hf.get("shared_expert_intermediate_size")
    out["shared_expert_d_ff"] = shared or None
    out["qkv_bias"] = bool(hf.get("qkv_bias", True))
  elif hf.get("shared_expert_intermediate_size"):
    problems.append("shared_expert_intermediate_size: Qwen3-MoE has no shared expert")
  return out, problems


def moe_to_hf(cfg: LlamaConfig, arch: str, extra: dict[str, Any]) -> dict[str, Any]:
  """config.json's MoE keys for `arch`.

  Args:
    cfg: the model.
    arch: the architecture to write.
    extra: keys read from the checkpoint's config.json (kept where the model has
      no value of its own).

  Returns:
    The keys.

  Raises:
    ValueError: a model `arch` cannot hold.
  """
  if arch not in MOE_ARCHITECTURES:
    if cfg.n_experts:
      raise ValueError(f"A mixture-of-experts model cannot be written as {arch}: write "
                       f"it as one of {list(MOE_ARCHITECTURES)}.")
    return {}
  moe = [cfg.layer_is_moe(i) for i in range(cfg.n_layers)]
  coef = cfg.router_aux_loss_coef
  out: dict[str, Any] = {
      "num_experts_per_tok": cfg.n_experts_per_tok, "output_router_logits": coef > 0,
      "router_aux_loss_coef": coef or extra.get("router_aux_loss_coef", 0.001)}
  if arch == "mixtral":
    if not all(moe) or not cfg.norm_topk_prob or cfg.moe_d_ff not in (None, cfg.d_ff) \
        or cfg.shared_expert_d_ff:
      raise ValueError("Mixtral's layers are all MoE, of width intermediate_size, with "
                       "renormalized top-k weights and no shared expert: this model is "
                       "not (write it as qwen2_moe or qwen3_moe).")
    return {**out, "num_local_experts": cfg.n_experts, "router_jitter_noise": 0.0}
  if bool(cfg.shared_expert_d_ff) != (arch == "qwen2_moe"):
    raise ValueError(f"shared_expert_d_ff={cfg.shared_expert_d_ff} cannot be written as "
                     f"{arch}: only Qwen2-MoE has (and needs) a shared expert.")
  out.update({"num_experts": cfg.n_experts, "moe_intermediate_size": cfg.expert_d_ff,
              "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
              "mlp_only_layers": [i for i, m in enumerate(moe) if not m]})
  if arch == "qwen2_moe":
    out.update(shared_expert_intermediate_size=cfg.shared_expert_d_ff,
               qkv_bias=cfg.qkv_bias)
  return out
