"""megatrain_jax: full-precision LLM training on one accelerator with host offload.

`import megatrain_jax as mt` gives the models, both trainers and the engine
(`mt.Llama`, `mt.StreamingTrainer`, ...), generation (`mt.generate`, in
`megatrain_jax.generation`), and the modules that pull in more
(`mt.hf`, `mt.checkpoint`, `mt.planner`, `mt.train`, `mt.bench`, `mt.figures`,
`mt.lora`, `mt.rl`). Everything loads on first use: importing the package itself imports
neither JAX nor NumPy, so a launcher can set up its process first
(`megatrain_jax.launch`).
"""

import importlib

__version__ = "0.1.0"

# Name -> the module that defines it.
_NAMES = {
    "Llama": "megatrain_jax.models", "LlamaConfig": "megatrain_jax.models",
    "PRESETS": "megatrain_jax.models", "RopeScaling": "megatrain_jax.models",
    "preset": "megatrain_jax.models", "check_batch": "megatrain_jax.models.batch",
    "ResidentTrainer": "megatrain_jax.resident", "Trainer": "megatrain_jax.protocol",
    "DeviceTransport": "megatrain_jax.engine", "EngineConfig": "megatrain_jax.engine",
    "MeshTransport": "megatrain_jax.engine", "SimulatedLink": "megatrain_jax.engine",
    "StreamingTrainer": "megatrain_jax.engine", "generate": "megatrain_jax.generation",
}
_MODULES = ("data", "engine", "metrics", "models", "optim", "hf", "checkpoint", "planner",
            "train", "bench", "figures", "lora", "launch", "rl")


def __getattr__(name):
  if name in _NAMES:
    return getattr(importlib.import_module(_NAMES[name]), name)
  if name in _MODULES:
    return importlib.import_module(f"megatrain_jax.{name}")
  raise AttributeError(f"module 'megatrain_jax' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_NAMES) + list(_MODULES))
