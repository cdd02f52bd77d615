"""Data parallel over the local devices (`EngineConfig.data_parallel`).

`MeshTransport` is a `DeviceTransport` over a one-axis `jax.sharding.Mesh` named
"data". It changes where bytes go, and nothing else in the engine:

  units      `h2d` puts each unit's streaming copy on every device of the mesh
             (replicated; how PJRT routes the copies on an accelerator has not
             been measured, only fake CPU devices);
  batches    `to_device` shards the token ids, labels and mask over "data", so
             each device computes its share of every micro-batch;
  gradients  the templates are the same jitted functions: XLA partitions them by
             their inputs' shardings, and a unit's gradient, a sum over the batch,
             comes out replicated after an all-reduce inside the template. `d2h`
             brings it back once, from the first device;
  checkpoints  activations keep their sharding on the way to host memory and back.

So the host state, the host optimizer and the updates are exactly those of one
device, and a step on N devices equals a step on one over the same global batch up
to the order of the sums (tests/test_scale_out.py).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from megatrain_jax.engine.transport import DeviceTransport, _memory_kinds

AXIS = "data"
NamedSharding, P = jax.sharding.NamedSharding, jax.sharding.PartitionSpec


def local_devices(n: int) -> list[jax.Device]:
  """The first `n` local devices (0: all of them).

  Args:
    n: how many.

  Returns:
    The devices.

  Raises:
    ValueError: there are fewer than `n`.
  """
  devices = jax.local_devices()
  if n > len(devices):
    raise ValueError(
        f"EngineConfig.data_parallel={n} but this process has {len(devices)} local "
        f"device(s) ({devices[0].platform}): lower it, or on the CPU backend start the "
        f"process with XLA_FLAGS=--xla_force_host_platform_device_count={n}.")
  return devices[:n] if n else devices


class MeshTransport(DeviceTransport):
  """Units to every device of a "data" mesh, batches split over it, gradients back
  once (see the module docstring)."""

  def __init__(self, devices: Sequence[jax.Device] | None = None, d2h_path: str = "auto"):
    """Builds the mesh.

    Args:
      devices: the mesh's devices (default: every local device).
      d2h_path: as `DeviceTransport`.

    Raises:
      ValueError: no device.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
      raise ValueError("MeshTransport needs at least one device.")
    super().__init__(devices[0], d2h_path)
    self.devices = devices
    self.mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    kinds = _memory_kinds(devices[0])
    self._kind = "device" if "device" in kinds else None
    self._host_kind = "pinned_host" if "pinned_host" in kinds else None
    self.replicated = NamedSharding(self.mesh, P(), memory_kind=self._kind)
    self.split = NamedSharding(self.mesh, P(AXIS), memory_kind=self._kind)

  @property
  def n_devices(self) -> int:
    """Devices in the mesh."""
    return len(self.devices)

  def h2d(self, staged):
    """Sends a streaming copy to every device of the mesh.

    Args:
      staged: a `stage` result.

    Returns:
      The unit, replicated over the mesh in device memory.
    """
    return jax.device_put(staged, self.replicated)

  def h2d_cast(self, master, dtype):
    """Casts a master (on the CPU backend, into the first device; else on the host),
    then sends it to every device.

    Args:
      master: a CPU-backend fp32 master, as a tuple of consecutive parts.
      dtype: the compute dtype.

    Returns:
      The unit, replicated over the mesh.
    """
    return self.h2d(super().h2d_cast(master, dtype))

  def d2h(self, device_array):
    """Brings a gradient back once, from the first device.

    Args:
      device_array: a gradient, replicated by the template's all-reduce (any other
        sharding is gathered first).

    Returns:
      A CPU-backend array.
    """
    if not device_array.sharding.is_fully_replicated:
      device_array = jax.device_put(device_array, self.replicated)
    return super().d2h(device_array.addressable_shards[0].data)

  def to_device(self, x):
    """Splits a batch array over the mesh's "data" axis.

    Args:
      x: a numpy array whose first dimension divides by the device count (a 0-d
        one is replicated).

    Returns:
      The sharded device array.
    """
    x = np.asarray(x)
    return jax.device_put(x, self.split if x.ndim else self.replicated)

  def offload(self, device_array):
    """Moves an activation to pinned host memory, keeping its sharding.

    Args:
      device_array: an array on the mesh.

    Returns:
      The same shards in pinned host memory.

    Raises:
      ValueError: the platform has no pinned host memory.
    """
    if self._host_kind is None:
      raise ValueError("activations='host' with data_parallel > 1 needs the devices' "
                       "pinned_host memory, which this platform does not have: use "
                       "activations='device'.")
    return jax.device_put(device_array, device_array.sharding.with_memory_kind(
        self._host_kind)).block_until_ready()

  def reload(self, host_array):
    """Moves an `offload` result back to device memory, keeping its sharding.

    Args:
      host_array: what `offload` returned.

    Returns:
      The array on the mesh in device memory.
    """
    return jax.device_put(host_array, host_array.sharding.with_memory_kind(
        self._kind)).block_until_ready()
