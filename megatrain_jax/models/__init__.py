"""Llama-family models: config, pure per-unit functions, NNX model, loss."""

from megatrain_jax.models.config import LlamaConfig, PRESETS, preset
from megatrain_jax.models.llama import Llama, Unit
from megatrain_jax.models.rope import RopeScaling
from megatrain_jax.models import layers, llama, loss, moe, rope
