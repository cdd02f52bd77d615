"""One parameterized config for the Llama family (Llama 2/3, Qwen2, Qwen3, Mistral)."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatrain_jax.models.rope import RopeScaling

# Fields added after checkpoints were first written: `to_dict` leaves them out at their
# defaults, so that settings recorded before them still compare equal on resume.
_LATER_FIELDS = ("attn_head_dim", "rope_scaling", "qk_norm", "sliding_window", "layer_types")
LAYER_TYPES = ("full_attention", "sliding_attention")


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
  slides when `sliding_window` is set). `layer_window(i)` is layer i's window.
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

  def __post_init__(self):
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
    if self.attn_head_dim is not None and (
        isinstance(self.attn_head_dim, bool) or not isinstance(self.attn_head_dim, int)
        or self.attn_head_dim <= 0):
      raise ValueError(f"LlamaConfig.attn_head_dim must be a positive integer or None, "
                       f"got {self.attn_head_dim!r}.")
    if self.attn_head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"LlamaConfig.d_model={self.d_model} is not divisible by "
          f"n_heads={self.n_heads}; choose n_heads dividing d_model, or set "
          "attn_head_dim.")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"LlamaConfig.rope_scaling must be a RopeScaling or None, got "
                       f"{type(self.rope_scaling).__name__}.")
    if self.sliding_window is not None and (
        isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
        or self.sliding_window <= 0):
      raise ValueError(f"LlamaConfig.sliding_window must be a positive integer or None, "
                       f"got {self.sliding_window!r}.")
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
    if self.layer_types is not None:
      out["layer_types"] = list(self.layer_types)
    for name in _LATER_FIELDS:
      if out[name] in (None, False):
        del out[name]
    return out

  def block_param_count(self) -> int:
    """Parameters of one decoder block.

    Returns:
      The count: attention (with biases and q/k norms if any), MLP and the two norms.
    """
    d, hd = self.d_model, self.head_dim
    q, kv = self.n_heads * hd, self.n_kv_heads * hd
    attn = d * q + 2 * d * kv + q * d
    if self.qkv_bias:
      attn += q + 2 * kv
    if self.qk_norm:
      attn += 2 * hd
    mlp = 3 * d * self.d_ff
    return attn + mlp + 2 * d

  def param_count(self, include_embeddings: bool = True) -> int:
    """Total parameters; `include_embeddings=False` drops embedding and LM head.

    Args:
      include_embeddings: whether to count the embedding and LM head (one matrix
        when tied).

    Returns:
      The count.
    """
    n = self.n_layers * self.block_param_count() + self.d_model  # + final norm
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
