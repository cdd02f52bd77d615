"""The compute settings a long sequence needs to fit a device (`fit_compute`)."""

from __future__ import annotations

from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.planner.hardware import Hardware
from megatrain_jax.planner.plan import device_total

# What a long sequence needs, tried in order when the model as given does not fit:
# attention in blocks (cuDNN's fused kernel on a GPU in bf16), then the feed-forward
# in chunks too. Each fills only settings the model leaves unset.
LONG_CONTEXT = ({"attention_block": 1024}, {"attention_block": 1024, "mlp_chunk": 8192})


def fit_compute(cfg: LlamaConfig, ec, hw: Hardware, batch_size: int, seq_len: int
                ) -> LlamaConfig:
  """The model with the first compute settings under which a step fits `hw`.

  Args:
    cfg: the model.
    ec: the engine config (its `activations="auto"` is decided for each candidate).
    hw: the hardware profile.
    batch_size: sequences per step.
    seq_len: tokens per sequence.

  Returns:
    `cfg` if it fits, else the first of `LONG_CONTEXT` applied to it that does
    (the last one if none does).
  """
  candidates = [cfg] + [cfg.replace(**{k: v for k, v in c.items() if getattr(cfg, k) is None})
                        for c in LONG_CONTEXT]
  for c in candidates:
    dev = device_total(c, ec, batch_size, seq_len, hw.flash_attention, hw.device_bytes)
    if dev["total"] <= hw.device_bytes:
      return c
  return candidates[-1]

