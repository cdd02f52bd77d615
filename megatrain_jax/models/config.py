"""One parameterized config for the Llama family (Llama 2/3, Qwen2, Qwen3, Mistral)."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatrain_jax.models.lora import ATTENTION_TARGETS, LoraConfig
from megatrain_jax.models.rope import RopeScaling

# Fields added after checkpoints were first written: `to_dict` leaves them out at their
# defaults, so that settings recorded before them still compare equal on resume.
_LATER_FIELDS = ("attn_head_dim", "rope_scaling", "qk_norm", "sliding_window", "layer_types",
                 "n_experts", "n_experts_per_tok", "moe_d_ff", "shared_expert_d_ff",
                 "norm_topk_prob", "moe_layers", "router_aux_loss_coef", "attention_block",
                 "mlp_chunk", "lora")

LAYER_TYPES = ("full_attention", "sliding_attention")
# Fields that change how the model computes, not what: a checkpoint trains with any.
COMPUTE_FIELDS = ("attention_block", "mlp_chunk")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape of a decoder-only Llama-family model.

  Qwen2 is `qkv_bias=True`; Qwen3 is `qk_norm=True` with its own `attn_head_dim`;
  Llama 3.1 and later use `rope_scaling`; Mistral is `sliding_window` on every layer;
  Llama 2 is the defaults. Every field is validated at construction, so a bad
  value fails here, naming the field, and not deep inside a JAX trace.

  `attn_head_dim` is the width of one attention head (None: d_model // n_heads; the
  `head_dim` property is the width in use). `qk_norm` adds an RMS norm over each head
  of the queries and keys before the rotary embedding. `sliding_window` W lets each
  token attend to itself and the W - 1 tokens before it; `layer_types` names each
  layer's attention, "full_attention" or "sliding_attention" (None: every layer
  slides when `sliding_window` is set). `layer_window(i)` is layer i's window. Each
  setting has one spelling: a `layer_types` or `moe_layers` that names every layer
  becomes None, and a `moe_d_ff` equal to d_ff becomes None.

  Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE) have `n_experts` SwiGLU
  experts of width `moe_d_ff` (None: d_ff); a softmax router picks
  `n_experts_per_tok` per token, their weights renormalized to sum to one when
  `norm_topk_prob`. `shared_expert_d_ff` adds Qwen2-MoE's shared expert with its
  sigmoid gate. `moe_layers` says which layers are MoE (None: all, when n_experts > 0);
  the others are dense with width d_ff. `router_aux_loss_coef` weights the
  load-balancing loss added to the training loss (0: none), defined as in
  `transformers` (`models.moe.aux_loss`).

  `attention_block` picks how attention is computed, not what: None runs
  `layers.dense_attention` (it forms the T x T scores);
  an int runs `models.blockwise` with blocks of that many tokens, whose memory grows
  with T, not T^2 (or cuDNN's fused kernel on an NVIDIA GPU in bf16); "auto" (the
  default) picks cuDNN's kernel where it runs, else the blockwise kernel from
  `layers.AUTO_BLOCKWISE_FROM` tokens on and the dense one below
  (`layers.attention_kernel`). `mlp_chunk` runs a dense layer's norm and feed-forward that many
  tokens at a time, each chunk recomputed in the backward, so its d_ff-wide
  intermediates take one chunk's memory at any sequence length (None: all at once).

  `lora` puts low-rank adapters on the blocks' projections (`models.lora`,
  `megatrain_jax.lora.apply`); None: none. An MoE layer's feed-forward takes none.
  """

  vocab_size: int = 260
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  d_ff: int = 384
  max_seq_len: int = 512
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  attn_head_dim: int | None = None
  rope_scaling: RopeScaling | None = None
  qk_norm: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  n_experts: int = 0
  n_experts_per_tok: int = 2
  moe_d_ff: int | None = None
  shared_expert_d_ff: int | None = None
  norm_topk_prob: bool = True
  moe_layers: tuple[bool, ...] | None = None
  router_aux_loss_coef: float = 0.0
  attention_block: int | str | None = "auto"
  mlp_chunk: int | None = None
  lora: LoraConfig | None = None

  def __post_init__(self):
    if isinstance(self.lora, dict):  # as read back from JSON
      object.__setattr__(self, "lora", LoraConfig(**self.lora))
    if self.lora is not None and not isinstance(self.lora, LoraConfig):
      raise ValueError(f"LlamaConfig.lora must be a LoraConfig or None, got "
                       f"{type(self.lora).__name__}.")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                 "d_ff", "max_seq_len"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"LlamaConfig.{name} must be a positive integer, got {value!r}.")
    for name in ("rope_theta", "norm_eps"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(
            f"LlamaConfig.{name} must be a positive number, got {value!r}.")
    for name in ("attn_head_dim", "sliding_window", "moe_d_ff", "shared_expert_d_ff",
                 "attention_block", "mlp_chunk"):
      value = getattr(self, name)
      if name == "attention_block" and value == "auto":
        continue
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value <= 0):
        raise ValueError(f"LlamaConfig.{name} must be a positive integer or None"
                         f"{', or auto' if name == 'attention_block' else ''}, got "
                         f"{value!r}.")
    if self.attn_head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"LlamaConfig.d_model={self.d_model} is not divisible by "
          f"n_heads={self.n_heads}; choose n_heads dividing d_model, or set "
          "attn_head_dim.")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"LlamaConfig.rope_scaling must be a RopeScaling or None, got "
                       f"{type(self.rope_scaling).__name__}.")
    if self.layer_types is not None:
      if isinstance(self.layer_types, list):  # as read back from JSON
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
      if (not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.n_layers
          or any(t not in LAYER_TYPES for t in self.layer_types)):
        raise ValueError(f"LlamaConfig.layer_types must name each of the n_layers="
                         f"{self.n_layers} layers one of {LAYER_TYPES}, got "
                         f"{self.layer_types!r}.")
      if "sliding_attention" in self.layer_types and self.sliding_window is None:
        raise ValueError("LlamaConfig.layer_types has sliding layers but sliding_window "
                         "is None: set the window's width.")
      if all(t == "sliding_attention" for t in self.layer_types):  # one spelling each
        object.__setattr__(self, "layer_types", None)
    self._check_moe()
    if self.lora is not None and self.lora.mlp_targets() and any(
        self.layer_is_moe(i) for i in range(self.n_layers)):
      raise ValueError(
          f"LoraConfig.targets {list(self.lora.mlp_targets())} are feed-forward "
          "projections, and this model's MoE layers keep their experts as stacked "
          "[E, in, out] kernels that take no adapters; target the attention "
          f"projections {list(ATTENTION_TARGETS)} instead.")
    if (self.lora is not None and self.lora.dropout and self.lora.mlp_targets()
        and self.mlp_chunk):
      raise ValueError(
          f"LoRA dropout on {list(self.lora.mlp_targets())} with mlp_chunk="
          f"{self.mlp_chunk}: a chunk mixes the tokens of several sequences, and each "
          "sequence draws its own masks. Unset mlp_chunk, set LoraConfig.dropout=0, or "
          "target the attention projections only.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"LlamaConfig.n_heads={self.n_heads} is not divisible by "
          f"n_kv_heads={self.n_kv_heads}; grouped-query attention needs "
          "n_kv_heads to divide n_heads.")
    if self.head_dim % 2:
      raise ValueError(
          f"LlamaConfig head dim {self.head_dim} is odd; rotary embeddings rotate pairs "
          "of features and need an even head dim.")

  @property
  def head_dim(self) -> int:
    """The width of one attention head."""
    return self.attn_head_dim or self.d_model // self.n_heads

  def _check_moe(self):
    for name in ("n_experts", "n_experts_per_tok"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"LlamaConfig.{name} must be a non-negative integer, got {value!r}.")
    if self.n_experts and not 1 <= self.n_experts_per_tok <= self.n_experts:
      raise ValueError(f"LlamaConfig.n_experts_per_tok={self.n_experts_per_tok} must be "
                       f"between 1 and n_experts={self.n_experts}.")
    if not isinstance(self.router_aux_loss_coef, (int, float)) or self.router_aux_loss_coef < 0:
      raise ValueError(f"LlamaConfig.router_aux_loss_coef must be a number >= 0, got "
                       f"{self.router_aux_loss_coef!r}.")
    if self.moe_layers is not None:
      if isinstance(self.moe_layers, list):  # as read back from JSON
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
      if (not isinstance(self.moe_layers, tuple) or len(self.moe_layers) != self.n_layers
          or any(not isinstance(m, bool) for m in self.moe_layers)):
        raise ValueError(f"LlamaConfig.moe_layers must hold one bool for each of the "
                         f"n_layers={self.n_layers} layers, got {self.moe_layers!r}.")
      if any(self.moe_layers) and not self.n_experts:
        raise ValueError("LlamaConfig.moe_layers names MoE layers but n_experts is 0.")
      if all(self.moe_layers):
        object.__setattr__(self, "moe_layers", None)
    if self.moe_d_ff == self.d_ff:
      object.__setattr__(self, "moe_d_ff", None)

  def layer_is_moe(self, i: int) -> bool:
    """Whether layer i is a mixture-of-experts layer.

    Args:
      i: the layer (0-based).

    Returns:
      True for an MoE layer, False for a dense one.
    """
    return bool(self.n_experts) and (self.moe_layers is None or self.moe_layers[i])

  @property
  def expert_d_ff(self) -> int:
    """The width of one expert."""
    return self.moe_d_ff or self.d_ff

  def layer_window(self, i: int) -> int | None:
    """Layer i's attention window.

    Args:
      i: the layer (0-based).

    Returns:
      The sliding window's width, or None for full causal attention.
    """
    if self.sliding_window is None or (
        self.layer_types is not None and self.layer_types[i] != "sliding_attention"):
      return None
    return self.sliding_window

  def replace(self, **changes: Any) -> "LlamaConfig":
    """A copy with some fields changed (and validated again).

    Args:
      **changes: field name -> new value.

    Returns:
      The new config.
    """
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """The fields as a dict (JSON-ready; what a checkpoint records).

    Returns:
      Field name -> value; the fields added later are left out at their defaults.
    """
    out = dataclasses.asdict(self)
    if self.lora is not None:
      out["lora"] = self.lora.to_dict()
    for name in ("layer_types", "moe_layers"):
      if out[name] is not None:
        out[name] = list(out[name])
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    for name in _LATER_FIELDS:
      if getattr(self, name) == defaults[name]:
        del out[name]
    return out

  def block_param_count(self, layer: int = 0, active: bool = False) -> int:
    """Parameters of one decoder block.

    Args:
      layer: which block (MoE and dense layers differ).
      active: count only the experts one token runs through (n_experts_per_tok of
        them), for FLOPs.

    Returns:
      The count: attention (with biases and q/k norms if any), MLP (router, experts
      and shared expert for an MoE layer) and the two norms.
    """
    d, hd = self.d_model, self.head_dim
    q, kv = self.n_heads * hd, self.n_kv_heads * hd
    attn = d * q + 2 * d * kv + q * d
    if self.qkv_bias:
      attn += q + 2 * kv
    if self.qk_norm:
      attn += 2 * hd
    mlp = 3 * d * self.d_ff
    if self.layer_is_moe(layer):
      experts = self.n_experts_per_tok if active else self.n_experts
      mlp = d * self.n_experts + 3 * d * self.expert_d_ff * experts
      if self.shared_expert_d_ff:
        mlp += 3 * d * self.shared_expert_d_ff + d
    return attn + mlp + 2 * d + self.adapter_param_count()

  def adapter_param_count(self) -> int:
    """Parameters of one block's LoRA adapters (`lora`): r x (in + out) per target.

    Returns:
      The count (0 without `lora`).
    """
    if self.lora is None:
      return 0
    d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, self.d_ff), "up_proj": (d, self.d_ff),
              "down_proj": (self.d_ff, d)}
    return sum(self.lora.rank * sum(shapes[t]) for t in self.lora.targets)

  def param_count(self, include_embeddings: bool = True, active: bool = False) -> int:
    """Total parameters; `include_embeddings=False` drops embedding and LM head.

    Args:
      include_embeddings: whether to count the embedding and LM head (one matrix
        when tied).
      active: count only the experts one token runs through (see
        `block_param_count`).

    Returns:
      The count.
    """
    n = sum(self.block_param_count(i, active) for i in range(self.n_layers)) + self.d_model
    if include_embeddings:
      n += self.vocab_size * self.d_model
      if not self.tie_embeddings:
        n += self.vocab_size * self.d_model
    return n


# Named sizes for the launcher. `tiny` trains in about a minute on 2 CPU cores.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=260, d_model=128, n_layers=4, n_heads=4,
                        n_kv_heads=2, d_ff=384, max_seq_len=512),
    "small": LlamaConfig(vocab_size=260, d_model=256, n_layers=8, n_heads=8,
                         n_kv_heads=4, d_ff=768, max_seq_len=1024),
    "medium": LlamaConfig(vocab_size=260, d_model=512, n_layers=8, n_heads=8,
                          n_kv_heads=4, d_ff=1536, max_seq_len=2048),
    # 304M parameters with the byte vocabulary: the host-memory benchmark's model.
    "300m": LlamaConfig(vocab_size=260, d_model=1024, n_layers=26, n_heads=16,
                        n_kv_heads=8, d_ff=2816, max_seq_len=2048),
    # About 350M parameters with a 32K vocabulary.
    "350m": LlamaConfig(vocab_size=32000, d_model=1024, n_layers=24, n_heads=16,
                        n_kv_heads=8, d_ff=2816, max_seq_len=2048),
    # Llama-2-7B's shape (6.74B parameters).
    "7b": LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=32, d_ff=11008, max_seq_len=4096),
    # Qwen2.5-32B's shape (32.8B parameters).
    "32b": LlamaConfig(vocab_size=152064, d_model=5120, n_layers=64, n_heads=40,
                       n_kv_heads=8, d_ff=27648, max_seq_len=32768, rope_theta=1000000.0,
                       qkv_bias=True),
    # Llama-3-70B's shape (70.6B parameters).
    "70b": LlamaConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                       n_kv_heads=8, d_ff=28672, max_seq_len=8192, rope_theta=500000.0),
    # Mistral-Large-2's shape (122.6B parameters).
    "123b": LlamaConfig(vocab_size=32768, d_model=12288, n_layers=88, n_heads=96,
                        n_kv_heads=8, d_ff=28672, max_seq_len=32768, rope_theta=1e6),
    # GPT-3 175B's width, depth and heads as a Llama decoder (its feed-forward's
    # parameters in SwiGLU form: d_ff = 8/3 d_model).
    "175b": LlamaConfig(vocab_size=50257, d_model=12288, n_layers=96, n_heads=96,
                        n_kv_heads=96, d_ff=32768, max_seq_len=2048),
    # `tiny` with mixture-of-experts layers: a dense first layer, then three layers of
    # 8 experts (top 2) with a shared expert and the load-balancing loss.
    "tiny_moe": LlamaConfig(vocab_size=260, d_model=128, n_layers=4, n_heads=4,
                            n_kv_heads=2, d_ff=384, max_seq_len=512, n_experts=8,
                            n_experts_per_tok=2, moe_d_ff=96, shared_expert_d_ff=192,
                            moe_layers=(False, True, True, True),
                            router_aux_loss_coef=0.01),
    # Qwen3-30B-A3B's shape (30.5B parameters, 3.3B active per token): 48 layers of
    # 128 experts, 8 routed per token.
    "30b_a3b": LlamaConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                           n_kv_heads=4, d_ff=6144, max_seq_len=40960, rope_theta=1e6,
                           norm_eps=1e-6, attn_head_dim=128, qk_norm=True, n_experts=128,
                           n_experts_per_tok=8, moe_d_ff=768, norm_topk_prob=True,
                           router_aux_loss_coef=0.001),
}


def preset(name: str) -> LlamaConfig:
  """A named model size.

  Args:
    name: a key of `PRESETS`.

  Returns:
    Its config.

  Raises:
    ValueError: `name` is not in `PRESETS`.
  """
  if name not in PRESETS:
    raise ValueError(
        f"Unknown model size {name!r}; choose one of {sorted(PRESETS)}.")
  return PRESETS[name]
