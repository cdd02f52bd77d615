"""Rotary position embeddings: the frequencies, with the scalings Llama 3.x and long-context
checkpoints use.

`RopeScaling` is the `rope_scaling` / `rope_parameters` of a Hugging Face config:
`linear` divides every frequency by `factor`; `llama3` divides the low frequencies by
`factor`, keeps the high ones and blends in between (Llama 3.1 and later); `yarn`
blends interpolated and extrapolated frequencies over a ramp of dimensions and scales
cos/sin by an attention factor. Each is computed the way `transformers` computes it
(in fp32), so logits agree with its models.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ROPE_TYPES = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A rotary scaling (see the module docstring for each `rope_type`).

  Attributes:
    rope_type: "linear", "llama3" or "yarn".
    factor: how much longer the context than in pretraining.
    original_max_position_embeddings: the pretraining context (llama3, yarn).
    low_freq_factor: llama3's low-frequency boundary (as in its config).
    high_freq_factor: llama3's high-frequency boundary.
    beta_fast: yarn's ramp boundary for extrapolation (default 32).
    beta_slow: yarn's ramp boundary for interpolation (default 1).
    attention_factor: yarn's cos/sin scale (None: from factor, mscale, mscale_all_dim).
    mscale: yarn's mscale.
    mscale_all_dim: yarn's mscale_all_dim.
    truncate: yarn rounds its correction range to whole dimensions.
  """

  rope_type: str
  factor: float
  original_max_position_embeddings: int | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  beta_fast: float | None = None
  beta_slow: float | None = None
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"RopeScaling.rope_type={self.rope_type!r} is not one of "
                       f"{ROPE_TYPES}.")
    if not (isinstance(self.factor, (int, float)) and self.factor > 0):
      raise ValueError(f"RopeScaling.factor must be a positive number, got {self.factor!r}.")
    needs = {"llama3": ("original_max_position_embeddings", "low_freq_factor",
                        "high_freq_factor"),
             "yarn": ("original_max_position_embeddings",)}.get(self.rope_type, ())
    missing = [k for k in needs if getattr(self, k) is None]
    if missing:
      raise ValueError(f"RopeScaling of type {self.rope_type!r} needs {missing}.")
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError("RopeScaling: llama3 needs high_freq_factor > low_freq_factor.")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None
                ) -> tuple[np.ndarray, float]:
  """The rotary inverse frequencies of one head, and the scale of cos and sin.

  Args:
    head_dim: the head's width (even).
    theta: the rotary base.
    scaling: the scaling, or None for plain rotary embeddings.

  Returns:
    (fp32 [head_dim / 2] inverse frequencies, attention scaling: 1.0 but for yarn).
  """
  f32 = np.float32
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
  inv_freq = (f32(1.0) / (f32(theta) ** exponents)).astype(f32)
  if scaling is None:
    return inv_freq, 1.0
  factor = f32(scaling.factor)
  if scaling.rope_type == "linear":
    return (inv_freq / factor).astype(f32), 1.0
  if scaling.rope_type == "llama3":
    old = f32(scaling.original_max_position_embeddings)
    low, high = f32(scaling.low_freq_factor), f32(scaling.high_freq_factor)
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(f32)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32), 1.0
  # yarn
  attention = scaling.attention_factor
  if attention is None:
    if scaling.mscale and scaling.mscale_all_dim:
      attention = (_yarn_mscale(scaling.factor, scaling.mscale)
                   / _yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    else:
      attention = _yarn_mscale(scaling.factor)
  fast, slow = scaling.beta_fast or 32, scaling.beta_slow or 1
  original = scaling.original_max_position_embeddings

  def correction_dim(rotations):
    return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

  lo, hi = correction_dim(fast), correction_dim(slow)
  if scaling.truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, head_dim - 1)
  if lo == hi:
    hi += 0.001
  ramp = np.clip((np.arange(head_dim // 2, dtype=f32) - f32(lo)) / f32(hi - lo), 0, 1)
  extrapolation = (1 - ramp).astype(f32)
  pos_freqs = f32(theta) ** exponents
  interpolated = f32(1.0) / (factor * pos_freqs)
  extrapolated = f32(1.0) / pos_freqs
  inv = interpolated * (1 - extrapolation) + extrapolated * extrapolation
  return inv.astype(f32), float(attention)
