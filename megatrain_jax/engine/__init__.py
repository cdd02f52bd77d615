"""The streaming engine (docs/engine.md has the map).

  plan/     what a step is and needs, before anything runs (schedule, program,
            byte rules, the memory model, the preflight);
  device/   the accelerator's side (transports, prefetch, activations, templates,
            the ledger);
  host/     the host's side (masters and optimizer state, the update, gradients
            coming back, streaming copies, snapshots);
  and at the top: `config`, `execute` (runs a step's program), `runtime` (the parts
  the threads share), `health`, `nonfinite`, `build` and `trainer` (the facade).
"""

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.engine.plan.schedule import Schedule
from megatrain_jax.engine.host.state import Snapshot, TrainerState
from megatrain_jax.engine.device.templates import Templates
from megatrain_jax.engine.trainer import StreamingTrainer
from megatrain_jax.engine.device.mesh import MeshTransport
from megatrain_jax.engine.device.transport import DeviceTransport, SimulatedLink, Transport
from megatrain_jax.engine.plan import memory
