"""Moving unit buffers between host memory and the accelerator.

`DeviceTransport` is the real path: the streaming copy of every unit lives in
the accelerator's `pinned_host` memory, `h2d` is one `jax.device_put` into
`device` memory, and gradients come back to the host backend with `d2h`. When
no streaming copy is kept, `h2d_cast` makes the compute-dtype copy from the
fp32 master's parts at fetch time.
`SimulatedLink` wraps it and adds the time a link of a given bandwidth would
take (a sleep, which releases the GIL), so overlap is measurable on CPU.
"""

from __future__ import annotations

import abc
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

SingleDeviceSharding = jax.sharding.SingleDeviceSharding


@functools.lru_cache(maxsize=None)
def _cast_into(sharding: jax.sharding.Sharding, dtype) -> jax.stages.Wrapped:
  """A jitted join of a master's parts into one flat array in `sharding`, cast to
  `dtype`: always a new buffer (an fp32 master is donated by its next update, so
  the fetched copy must not be the master itself)."""
  return jax.jit(lambda parts: jnp.array(jnp.concatenate(parts), dtype=dtype, copy=True),
                 out_shardings=sharding)


def _memory_kinds(device) -> set[str]:
  try:
    return {m.kind for m in device.addressable_memories()}
  except (AttributeError, NotImplementedError):
    return set()


class Transport(abc.ABC):
  """The interface the engine uses. Every method may run on a worker thread."""

  device: jax.Device
  host_device: jax.Device

  @abc.abstractmethod
  def stage(self, host_array: jax.Array) -> jax.Array:
    """Makes a streaming copy.

    Args:
      host_array: a CPU-backend array, or a numpy array (a copy read from disk).

    Returns:
      The array in pinned host memory (where the device can read it by DMA).
    """

  @abc.abstractmethod
  def h2d(self, staged: jax.Array) -> jax.Array:
    """Moves a streaming copy to the accelerator.

    Args:
      staged: a `stage` result.

    Returns:
      The array in the accelerator's `device` memory.
    """

  @abc.abstractmethod
  def d2h(self, device_array: jax.Array) -> jax.Array:
    """Brings an accelerator array back to the host.

    Args:
      device_array: an array in device memory (a gradient).

    Returns:
      A CPU-backend array, ready when this returns.
    """

  @abc.abstractmethod
  def to_device(self, x) -> jax.Array:
    """Puts a small input (token ids, labels) in device memory.

    Args:
      x: a numpy array.

    Returns:
      The device array.
    """

  @abc.abstractmethod
  def offload(self, tree):
    """Moves a checkpoint to host memory where the device can read it back fast.

    Args:
      tree: an array in device memory (a block input), or a tree of them (with its
        layer's kept residuals).

    Returns:
      The same in host memory, ready when this returns.
    """

  @abc.abstractmethod
  def reload(self, tree):
    """Moves an `offload` result back to device memory.

    Args:
      tree: what `offload` returned.

    Returns:
      The same in device memory, ready when this returns.
    """

  def await_compute(self, array: jax.Array) -> None:
    """Blocks until an array computed on the device is ready: the compute that read
    a parameter buffer is done, so the buffer may be freed.

    Args:
      array: the compute's output.
    """
    array.block_until_ready()

  def h2d_cast(self, master: tuple[jax.Array, ...], dtype) -> jax.Array:
    """The fetch when no streaming copy is kept: joins and casts a master on the host,
    then `stage` and `h2d`.

    Args:
      master: a CPU-backend fp32 master, as a tuple of consecutive parts.
      dtype: the compute dtype.

    Returns:
      Its flat `dtype` copy in device memory.
    """
    host = SingleDeviceSharding(self.host_device)
    return self.h2d(self.stage(_cast_into(host, jnp.dtype(dtype))(master)))

  def global_sum(self, value: float) -> float:
    """A host number summed over every process of the run (token counts).

    Args:
      value: this process's share.

    Returns:
      The sum; `value` itself in a one-process run.
    """
    return value

  def stream_sharding(self) -> jax.sharding.Sharding | None:
    """Where the host optimizer may write streaming copies directly.

    Returns:
      A sharding, or None (they are made on the host, then staged).
    """
    return None


# How a gradient comes back to the host optimizer (`DeviceTransport.d2h`):
#   cpu_backend  one `device_put` to the CPU backend.
#   pinned_host  a `device_put` into the accelerator's pinned host memory, then a host
#                copy into a CPU-backend array.
# JAX users measured the first far below the link's rate on GPUs (jax issues 21438,
# 36651); `experiments/gpu_check.py` times both, and a template output placed in
# pinned host memory, so the choice per platform rests on a measurement.
D2H_PATHS = ("auto", "cpu_backend", "pinned_host")


class DeviceTransport(Transport):
  """Memory kinds on one accelerator; the host optimizer runs on the CPU backend."""

  def __init__(self, device: jax.Device | None = None, d2h_path: str = "auto"):
    """Finds the accelerator's memory kinds.

    Args:
      device: the accelerator (default: the first device).
      d2h_path: how gradients come back, one of `D2H_PATHS`; "auto" is
        "cpu_backend" (no copy at all on the CPU backend) until a GPU measurement
        says otherwise.
    """
    if d2h_path not in D2H_PATHS:
      raise ValueError(f"d2h_path={d2h_path!r} is not one of {D2H_PATHS}.")
    self.device = device or jax.local_devices()[0]
    self.host_device = jax.local_devices(backend="cpu")[0]
    kinds = _memory_kinds(self.device)
    self.on_device = SingleDeviceSharding(
        self.device, memory_kind="device" if "device" in kinds else None)
    self.pinned = (SingleDeviceSharding(self.device, memory_kind="pinned_host")
                   if "pinned_host" in kinds else None)
    self.on_host = SingleDeviceSharding(self.host_device)
    self.d2h_path = "cpu_backend" if d2h_path == "auto" or self.pinned is None else d2h_path

  def stage(self, host_array):
    kind = getattr(getattr(host_array, "sharding", None), "memory_kind", None)
    if self.pinned is None or kind == "pinned_host":
      return host_array
    return jax.device_put(host_array, self.pinned)

  def stream_sharding(self):
    # On the CPU backend the host optimizer can write the pinned copy itself; on an
    # accelerator the pinned memory belongs to another backend, so `stage` copies.
    return self.pinned if self.device == self.host_device else None

  def h2d(self, staged):
    return jax.device_put(staged, self.on_device)

  def h2d_cast(self, master, dtype):
    if self.device == self.host_device:
      # CPU backend: one XLA copy into `device` memory, which is host RAM.
      return _cast_into(self.on_device, jnp.dtype(dtype))(master)
    return super().h2d_cast(master, dtype)

  def d2h(self, device_array):
    if self.device == self.host_device:
      # CPU backend: `device` memory is host RAM already; no copy to make.
      return device_array.block_until_ready()
    if self.d2h_path == "pinned_host":
      pinned = jax.device_put(device_array, self.pinned).block_until_ready()
      return jax.device_put(np.asarray(pinned), self.on_host).block_until_ready()
    return jax.device_put(device_array, self.on_host).block_until_ready()

  def offload(self, tree):
    # Pinned memory of the accelerator's own client: a DMA each way, no second
    # backend involved (the CPU backend's copy where there is none).
    return jax.block_until_ready(jax.device_put(tree, self.pinned or self.on_host))

  def reload(self, tree):
    return jax.block_until_ready(jax.device_put(tree, self.on_device))

  def to_device(self, x):
    return jax.device_put(np.asarray(x), self.on_device)


class SimulatedLink(Transport):
  """A `DeviceTransport` whose h2d and d2h take at least bytes / `gb_per_s`.

  Each direction is its own link (like PCIe's full duplex), serialized: two
  concurrent transfers in one direction queue behind each other.
  """

  def __init__(self, gb_per_s: float, base: Transport | None = None):
    if not gb_per_s > 0:
      raise ValueError(f"SimulatedLink bandwidth must be positive, got {gb_per_s}.")
    self.gb_per_s = float(gb_per_s)
    self.base = base or DeviceTransport()
    self.device, self.host_device = self.base.device, self.base.host_device
    self._locks = {"h2d": threading.Lock(), "d2h": threading.Lock()}
    self.bytes_moved = {"h2d": 0, "d2h": 0}  # what the link was charged, each way

  def _move(self, direction: str, move, array, nbytes: int | None = None):
    if nbytes is None:
      nbytes = sum(a.nbytes for a in jax.tree.leaves(array))
    with self._locks[direction]:
      self.bytes_moved[direction] += nbytes
      t0 = time.perf_counter()
      out = move(array)
      delay = nbytes / (self.gb_per_s * 1e9) - (time.perf_counter() - t0)
      if delay > 0:
        time.sleep(delay)
    return out

  def stage(self, host_array):
    return self.base.stage(host_array)

  def stream_sharding(self):
    return self.base.stream_sharding()

  def h2d(self, staged):
    return self._move("h2d", self.base.h2d, staged)

  def h2d_cast(self, master, dtype):
    # The link carries the compute-dtype copy, whichever side casts.
    return self._move("h2d", lambda m: self.base.h2d_cast(m, dtype), master,
                      nbytes=sum(p.size for p in master) * jnp.dtype(dtype).itemsize)

  def d2h(self, device_array):
    return self._move("d2h", self.base.d2h, device_array)

  def offload(self, tree):
    return self._move("d2h", self.base.offload, tree)

  def reload(self, tree):
    return self._move("h2d", self.base.reload, tree)

  def await_compute(self, array):
    self.base.await_compute(array)

  def to_device(self, x):
    return self.base.to_device(x)

  def global_sum(self, value):
    return self.base.global_sum(value)
