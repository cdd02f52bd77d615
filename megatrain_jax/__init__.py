"""megatrain_jax: full-precision LLM training on one accelerator with host offload."""

from megatrain_jax.models import Llama, LlamaConfig, PRESETS, preset
from megatrain_jax.resident import ResidentTrainer
from megatrain_jax.engine import (EngineConfig, StreamingTrainer, SimulatedLink,
                                  DeviceTransport)
from megatrain_jax.batch import check_batch
from megatrain_jax import data, engine, metrics, models, optim

__version__ = "0.1.0"
