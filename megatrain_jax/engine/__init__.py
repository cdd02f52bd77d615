"""The streaming engine: host store, transport and prefetch, templates, host optimizer."""

from megatrain_jax.engine.flat import FlatSpec
from megatrain_jax.engine.host_optimizer import HostOptimizer, probe_separable
from megatrain_jax.engine.trainer import EngineConfig, StreamingTrainer
from megatrain_jax.engine.transport import DeviceTransport, SimulatedLink, Transport
