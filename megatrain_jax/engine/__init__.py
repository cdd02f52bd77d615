"""The streaming engine. Its modules, in the order data flows (docs/engine.md):

config -> schedule -> memory -> transport (mesh) -> prefetch -> templates -> step ->
gradients -> host_optimizer (probe) -> store -> state -> runtime -> trainer.
"""

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.flat import FlatSpec
from megatrain_jax.engine.host_optimizer import HostOptimizer
from megatrain_jax.engine.schedule import Schedule
from megatrain_jax.engine.state import Snapshot, TrainerState
from megatrain_jax.engine.templates import Templates
from megatrain_jax.engine.trainer import StreamingTrainer
from megatrain_jax.engine.mesh import MeshTransport
from megatrain_jax.engine.transport import DeviceTransport, SimulatedLink, Transport
from megatrain_jax.engine import memory
