"""What this process runs on: the backend, the accelerator's memory, the host's.

`engine.memory` and the preflight read these facts; nothing here allocates.
"""

from __future__ import annotations

import os

import jax


def on_cpu_backend() -> bool:
  """Whether the engine computes on the CPU backend.

  Returns:
    True when the default device is a CPU (its device memory is host RAM).
  """
  return jax.devices()[0].platform == "cpu"


def on_gpu() -> bool:
  """Whether this process's default backend is a GPU.

  Returns:
    True on a GPU, whose client caps pinned host memory (`engine.pinned`).
  """
  return jax.devices()[0].platform in ("gpu", "cuda", "rocm")


def available_host_bytes() -> int:
  """Host memory the kernel says a new allocation can get.

  Returns:
    MemAvailable from /proc/meminfo (elsewhere, the free pages).
  """
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def accelerator_bytes() -> int | None:
  """The accelerator's memory limit.

  Returns:
    Its `bytes_limit`, or None on the CPU backend (where device memory is host RAM).
  """
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return None
  stats = dev.memory_stats() or {}
  return stats.get("bytes_limit")
