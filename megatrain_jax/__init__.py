"""megatrain_jax: full-precision LLM training on one accelerator with host offload.

`import megatrain_jax as mt` gives the models, both trainers and the engine; the
modules that pull in more (`mt.hf`, `mt.checkpoint`, `mt.planner`, `mt.train`,
`mt.bench`, `mt.figures`, `mt.lora`) load on first use.
"""

import importlib

from megatrain_jax.models import Llama, LlamaConfig, PRESETS, RopeScaling, preset
from megatrain_jax.models.batch import check_batch
from megatrain_jax.resident import ResidentTrainer
from megatrain_jax.engine import (DeviceTransport, EngineConfig, MeshTransport, SimulatedLink,
                                  StreamingTrainer)
from megatrain_jax import data, engine, metrics, models, optim

__version__ = "0.1.0"
_LAZY = ("hf", "checkpoint", "planner", "train", "bench", "figures", "lora")


def __getattr__(name):
  if name in _LAZY:
    return importlib.import_module(f"megatrain_jax.{name}")
  raise AttributeError(f"module 'megatrain_jax' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_LAZY))
