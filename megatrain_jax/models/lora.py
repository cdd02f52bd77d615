"""Low-rank adapters (LoRA) on a block's projections: their config, init and math.

An adapted projection's tree gains two leaves beside its kernel [in, out]:
"lora_a" [in, r] and "lora_b" [r, out], and computes

  y = x @ kernel (+ bias) + dropout(x) @ lora_a @ lora_b * alpha / r

as PEFT's `LoraLayer` does (its `lora_A.weight` is our lora_a transposed, its
`lora_B.weight` our lora_b transposed). lora_a starts uniform in +-1/sqrt(in)
(PyTorch's default for a Linear, which PEFT keeps) and lora_b at zero, so a fresh
adapter leaves the model's output unchanged. The adapters are part of the model's
config (`LlamaConfig.lora`), so every unit tree, abstract shape and plan made from
the config has them; `megatrain_jax.lora` adds them to a model and merges them back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# Hugging Face's projection names -> where the projection sits in a block's tree.
TARGETS = {"q_proj": ("attn", "q"), "k_proj": ("attn", "k"), "v_proj": ("attn", "v"),
           "o_proj": ("attn", "o"), "gate_proj": ("mlp", "gate"), "up_proj": ("mlp", "up"),
           "down_proj": ("mlp", "down")}
ALL_TARGETS = tuple(TARGETS)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_KEYS = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which projections get adapters, and their rank, scale and dropout.

  Attributes:
    rank: the adapters' rank r.
    alpha: the scale's numerator: the adapter's output is multiplied by alpha / r.
    targets: Hugging Face projection names (of `ALL_TARGETS`).
    dropout: the probability of zeroing each element of an adapter's input during
      training (0: none); the trainers then need a PRNG key per step.
  """

  rank: int = 16
  alpha: float = 32.0
  targets: tuple[str, ...] = ALL_TARGETS
  dropout: float = 0.0

  def __post_init__(self):
    if isinstance(self.targets, (list, str)):  # as read back from JSON, or one name
      object.__setattr__(self, "targets",
                         (self.targets,) if isinstance(self.targets, str) else
                         tuple(self.targets))
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
      raise ValueError(f"LoraConfig.rank must be a positive integer, got {self.rank!r}.")
    if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
      raise ValueError(f"LoraConfig.alpha must be a positive number, got {self.alpha!r}.")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or not self.targets:
      raise ValueError(f"LoraConfig.targets {list(self.targets)!r}: "
                       f"{'unknown ' + str(unknown) if unknown else 'none given'}; "
                       f"choose among {list(ALL_TARGETS)}.")
    if len(set(self.targets)) != len(self.targets):
      raise ValueError(f"LoraConfig.targets {list(self.targets)!r} names a projection twice.")
    # One spelling per set of targets (the order given does not matter).
    object.__setattr__(self, "targets", tuple(t for t in ALL_TARGETS if t in self.targets))
    if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}.")

  @property
  def scale(self) -> float:
    """alpha / rank, what an adapter's output is multiplied by."""
    return float(self.alpha) / self.rank

  def paths(self) -> tuple[tuple[str, str], ...]:
    """Where the targets sit in a block's tree, in `ALL_TARGETS` order.

    Returns:
      ("attn", "q"), ("mlp", "down"), ...
    """
    return tuple(TARGETS[t] for t in ALL_TARGETS if t in self.targets)

  def mlp_targets(self) -> tuple[str, ...]:
    """The targets in the feed-forward (which an MoE layer does not have).

    Returns:
      Target names.
    """
    return tuple(t for t in self.targets if TARGETS[t][0] == "mlp")

  def to_dict(self) -> dict[str, Any]:
    """The fields as a JSON-ready dict.

    Returns:
      Field name -> value (targets as a list).
    """
    return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
            "dropout": self.dropout}


def init_adapters(lora: LoraConfig, block: dict, key: jax.Array) -> dict:
  """A block's tree with fresh adapters on the targeted projections.

  Args:
    lora: the adapters' config.
    block: the block's tree (its kernels give the shapes; it is not changed).
    key: the block's adapter key.

  Returns:
    A new tree: each target's dict gains lora_a (uniform in +-1/sqrt(in)) and
    lora_b (zeros), fp32.
  """
  out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in block.items()}
  for i, (part, name) in enumerate(lora.paths()):
    kernel = block[part][name]["kernel"]
    n_in, n_out = kernel.shape
    bound = 1.0 / n_in ** 0.5
    a = jax.random.uniform(jax.random.fold_in(key, i), (n_in, lora.rank), jnp.float32,
                           -bound, bound)
    out[part][name] = {**block[part][name], "lora_a": a,
                       "lora_b": jnp.zeros((lora.rank, n_out), jnp.float32)}
  return out


@dataclasses.dataclass(frozen=True)
class Adapters:
  """How a block's adapted projections compute, inside one call.

  Attributes:
    scale: alpha / rank.
    rate: the dropout probability.
    keys: one PRNG key per sequence of the batch, as raw key data (uint32 [B, 2],
      `jax.random.key_data`; already folded with the layer), or None: no dropout
      (evaluation, or `rate` 0). Each sequence's masks come from its own key, so a
      batch split into micro-batches draws the same masks as the whole batch. Raw
      data, not typed keys, so that a layer that keeps its residuals keeps plain
      arrays.
  """

  scale: float
  rate: float = 0.0
  keys: Any = None

  def delta(self, p: dict, x, target: str):
    """What an adapted projection adds to x @ kernel.

    Args:
      p: the projection's tree, with lora_a and lora_b.
      x: its input, [B, T, in].
      target: the projection's name (of `ALL_TARGETS`): each draws its own mask.

    Returns:
      dropout(x) @ lora_a @ lora_b * scale, in x's dtype. Dropout, as PyTorch's,
      zeroes each element with probability `rate` and scales the others by
      1 / (1 - rate).
    """
    if self.keys is not None and self.rate > 0:
      slot = ALL_TARGETS.index(target)
      draw = lambda k: jax.random.bernoulli(
          jax.random.fold_in(jax.random.wrap_key_data(k), slot), 1.0 - self.rate,
          x.shape[1:])
      keep = jax.vmap(draw)(self.keys)
      x = jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - self.rate), x.dtype),
                    jnp.zeros((), x.dtype))
    # As one [tokens, in] matrix: XLA's CPU backend differentiates a [B, T, in] @
    # [in, r] product three times slower (its weight gradient contracts two axes).
    x2 = x.reshape(-1, x.shape[-1])
    y = (x2 @ p["lora_a"]) @ (p["lora_b"] * jnp.asarray(self.scale, x.dtype))  # r x out
    return y.reshape(*x.shape[:-1], y.shape[-1])


  def deltas(self, ps: dict, x) -> dict:
    """What the adapted ones of several projections that share an input add: with no
    dropout, one product with their lora_a side by side (fewer, wider matmuls, in the
    forward and in the backward); with dropout, each its own (`delta`).

    Args:
      ps: target name -> the projection's tree, all reading `x`.
      x: their input, [B, T, in].

    Returns:
      target name -> its addition, for the adapted ones only.
    """
    adapted = {t: p for t, p in ps.items() if "lora_a" in p}
    if len(adapted) < 2 or (self.keys is not None and self.rate > 0):
      return {t: self.delta(p, x, t) for t, p in adapted.items()}
    x2 = x.reshape(-1, x.shape[-1])
    xa = x2 @ jnp.concatenate([p["lora_a"] for p in adapted.values()], axis=1)
    out, at = {}, 0
    for t, p in adapted.items():
      r = p["lora_a"].shape[1]
      y = xa[:, at:at + r] @ (p["lora_b"] * jnp.asarray(self.scale, x.dtype))
      out[t], at = y.reshape(*x.shape[:-1], y.shape[-1]), at + r
    return out


def layer_keys(keys, layer):
  """Per-sequence dropout keys of one layer, from the step's per-sequence keys.

  Args:
    keys: raw key data, uint32 [B, 2] (`sequence_keys`), or None.
    layer: the layer's index (an int or a traced scalar).

  Returns:
    Each key folded with `layer`, as raw key data; or None.
  """
  if keys is None:
    return None
  fold = lambda k: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), layer))
  return jax.vmap(fold)(keys)


def check_key(lora: LoraConfig | None, key) -> None:
  """Refuses a training step with LoRA dropout and no key, or not one key.

  Args:
    lora: the model's adapters' config (or None).
    key: the step's PRNG key (or None).

  Raises:
    ValueError: dropout is on and `key` is None or not a single PRNG key of the
      default implementation.
  """
  if lora is None or not lora.dropout:
    return
  if key is None:
    raise ValueError(f"LoRA dropout ({lora.dropout}) draws its masks from a PRNG key: pass "
                     "step(batch, key=...) with a new key each step (e.g. "
                     "jax.random.fold_in(key, step)), or set LoraConfig.dropout=0.")
  typed = hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  raw_shape = jax.random.key_data(jax.random.key(0)).shape
  ok = ((typed and key.shape == () and jax.random.key_impl(key) == jax.random.key_impl(
      jax.random.key(0))) or (not typed and hasattr(key, "shape")
                              and tuple(key.shape) == raw_shape and key.dtype == jnp.uint32))
  if not ok:
    raise ValueError(f"step(key=...) must be one PRNG key of the default implementation "
                     f"(jax.random.key(seed)), got {type(key).__name__} "
                     f"{getattr(key, 'dtype', '')}{list(getattr(key, 'shape', ()))}.")


def sequence_keys(key: jax.Array, rows) -> jax.Array:
  """One dropout key per sequence of a step's batch, as raw key data.

  Args:
    key: the step's key (typed, or raw uint32 data).
    rows: the sequences' indices in the step's global batch ([B] ints), so that a
      micro-batch draws what the whole batch would for the same sequences.

  Returns:
    uint32 [B, 2] (`jax.random.key_data` of each sequence's key).
  """
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)
  return jax.vmap(lambda r: jax.random.key_data(jax.random.fold_in(key, r)))(
      jnp.asarray(rows, jnp.uint32))


def merged(p: dict, scale: float) -> dict:
  """A projection's tree with its adapter folded into the kernel (and removed).

  Args:
    p: the projection's tree.
    scale: alpha / rank.

  Returns:
    {"kernel": kernel + lora_a @ lora_b * scale, ...the other leaves}, fp32.
  """
  out = {k: v for k, v in p.items() if k not in ADAPTER_KEYS}
  if "lora_a" in p:
    delta = jnp.asarray(p["lora_a"], jnp.float32) @ jnp.asarray(p["lora_b"], jnp.float32)
    out["kernel"] = jnp.asarray(p["kernel"], jnp.float32) + delta * jnp.float32(scale)
  return out


def merged_unit(tree: dict, lora: LoraConfig) -> dict:
  """A unit's tree with its adapters (if any) folded into their kernels (`merged`).

  Args:
    tree: a unit's tree (a block's, or the embedding's or head's, which have none).
    lora: the adapters' config (targets and scale).

  Returns:
    A new tree without adapters.
  """
  out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
  for part, name in lora.paths():
    if "lora_a" in out.get(part, {}).get(name, {}):
      out[part][name] = merged(out[part][name], lora.scale)
  return out


def strip_adapters(tree: Any) -> Any:
  """A tree without its adapter leaves (the base's tree).

  Args:
    tree: a whole model's or a unit's tree (nested dicts and lists).

  Returns:
    A new tree of the same nesting, without lora_a and lora_b.
  """
  if isinstance(tree, dict):
    return {k: strip_adapters(v) for k, v in tree.items() if k not in ADAPTER_KEYS}
  if isinstance(tree, list):
    return [strip_adapters(v) for v in tree]
  return tree


def has_adapters(tree: Any) -> bool:
  """Whether a tree (nested dicts and lists) holds any adapter leaf.

  Args:
    tree: a whole model's or a unit's tree.

  Returns:
    True if some dict in it has a lora_a or lora_b entry.
  """
  if isinstance(tree, dict):
    return any(k in ADAPTER_KEYS or has_adapters(v) for k, v in tree.items())
  if isinstance(tree, list):
    return any(has_adapters(v) for v in tree)
  return False


def is_adapter(path: tuple) -> bool:
  """Whether a parameter path (as `Llama.param_tree()`'s) names an adapter leaf.

  Args:
    path: e.g. ("blocks", 0, "attn", "q", "lora_a").

  Returns:
    True for lora_a and lora_b leaves.
  """
  return bool(path) and path[-1] in ADAPTER_KEYS
