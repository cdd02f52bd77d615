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

Several processes (`jax.distributed`, see `megatrain_jax.distributed`): the mesh
spans the first `data_parallel` local devices of every process, process by
process. Each process sends its units to its own devices only
(`jax.make_array_from_single_device_arrays`), gives its own rows of every batch
(`jax.make_array_from_process_local_data`), and receives the all-reduced gradient
on its first device; every process then applies the same update to its own copy
of the host state (replicated, not partitioned).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from megatrain_jax.engine.device.transport import DeviceTransport, _memory_kinds

AXIS = "data"
NamedSharding, P = jax.sharding.NamedSharding, jax.sharding.PartitionSpec
SingleDeviceSharding = jax.sharding.SingleDeviceSharding


def mesh_devices(n: int) -> list[jax.Device]:
  """The first `n` local devices of every process (0: all), process by process.

  Args:
    n: devices per process.

  Returns:
    The devices; this process's alone in a one-process run.

  Raises:
    ValueError: this process, or another one, has fewer than `n`.
  """
  local = local_devices(n)
  if jax.process_count() == 1:
    return local
  by_process: dict[int, list[jax.Device]] = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  out = []
  for p, devices in sorted(by_process.items()):
    if len(devices) < len(local):
      raise ValueError(f"Process {p} has {len(devices)} device(s) and this one uses "
                       f"{len(local)}: give every process the same --data_parallel.")
    out += sorted(devices, key=lambda d: d.id)[:len(local)]
  return out


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
    mine = [d for d in devices if d.process_index == jax.process_index()]
    if not mine:
      raise ValueError("MeshTransport needs at least one device of this process.")
    super().__init__(mine[0], d2h_path)
    self.devices, self.local = devices, mine
    self.mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    kinds = _memory_kinds(mine[0])
    self._kind = "device" if "device" in kinds else None
    self._host_kind = "pinned_host" if "pinned_host" in kinds else None
    self.replicated = NamedSharding(self.mesh, P(), memory_kind=self._kind)
    self.split = NamedSharding(self.mesh, P(AXIS), memory_kind=self._kind)
    self._each = [SingleDeviceSharding(d, memory_kind=self._kind) for d in mine]

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
    # One copy to each of this process's devices, joined into one global array
    # (a `device_put` to the mesh's sharding cannot address other processes').
    parts = jax.device_put([staged] * len(self._each), self._each)
    return jax.make_array_from_single_device_arrays(staged.shape, self.replicated, parts)

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
      x: this process's rows, a numpy array whose first dimension divides by its
        device count (a 0-d one is replicated).

    Returns:
      The sharded device array; its first dimension is every process's rows,
      in process order.
    """
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(self.split if x.ndim else self.replicated, x)

  def global_sum(self, value):
    """Sums a number over the processes (a collective: every process calls it).

    Args:
      value: this process's share.

    Returns:
      The sum over the processes, in process order.
    """
    if jax.process_count() == 1:
      return value
    return float(np.sum(multihost_utils.process_allgather(np.float32(value)), dtype=np.float64))

  def offload(self, tree):
    """Moves a checkpoint to pinned host memory, keeping each array's sharding.

    Args:
      tree: an array on the mesh, or a tree of them.

    Returns:
      The same shards in pinned host memory.

    Raises:
      ValueError: the platform has no pinned host memory.
    """
    if self._host_kind is None:
      raise ValueError("activations='host' with data_parallel > 1 needs the devices' "
                       "pinned_host memory, which this platform does not have: use "
                       "activations='device'.")
    return jax.block_until_ready(jax.tree.map(lambda a: jax.device_put(
        a, a.sharding.with_memory_kind(self._host_kind)), tree))

  def reload(self, tree):
    """Moves an `offload` result back to device memory, keeping each sharding.

    Args:
      tree: what `offload` returned.

    Returns:
      The arrays on the mesh in device memory.
    """
    return jax.block_until_ready(jax.tree.map(lambda a: jax.device_put(
        a, a.sharding.with_memory_kind(self._kind)), tree))
