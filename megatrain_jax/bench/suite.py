"""The benchmark suite's sizes and goals, and the machine a result comes from."""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any

import jax

from megatrain_jax import launch
from megatrain_jax.engine.config import HOST_CHUNK
from megatrain_jax.models.config import LlamaConfig

# The model the step-time ratios use: it fits on any device, and its layers are big
# enough on 2 CPU cores that per-layer overheads are visible but not dominant.
BENCH_MODEL = LlamaConfig(vocab_size=260, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                          d_ff=1536, max_seq_len=2048)
# The goals each figure must meet on a 2-core CPU machine: (comparison, bound).
GOALS = {
    "stream_over_resident_remat": ("<=", 1.05),
    "stream_over_resident": ("report", None),
    "stream_over_resident_noremat": ("<=", 1.10),
    "activation_offload_overhead": ("<=", 1.10),
    "overlap_efficiency": (">=", 0.93),
    "no_prefetch_over_prefetch": (">=", 1.6),
    "host_opt_bw_ratio": (">=", 0.80),
    "host_bytes_per_param": ("<=", 14.5),
    "lora_over_full_step": ("<=", 0.8),
    "host_bytes_per_base_param_lora": ("<=", 2.3),
    "disk_io_efficiency": (">=", 0.8),
    "host_bytes_per_param_disk_tier": ("<=", 2.6),
}


@dataclasses.dataclass
class Suite:
  """Sizes of one benchmark suite."""
  model: LlamaConfig = BENCH_MODEL
  batch_size: int = 4
  seq_len: int = 512
  warmup: int = 2
  reps: int = 7
  opt_params: int = 32 * 2**20
  opt_slab: int = 2**20  # the host-optimizer profile's cache-sized pieces
  host_chunk: int = HOST_CHUNK  # elements per step of the host AdamW's in-place loop
  rss_model: str = "300m"
  state_dir: str | None = None  # the disk part's files (None: the temporary directory)


def machine() -> dict[str, Any]:
  """The machine and software a result was measured on.

  Returns:
    The first device's platform and kind, CPU count, Python and JAX versions, the
    architecture, the transparent huge pages mode and GLIBC_TUNABLES.
  """
  d = jax.devices()[0]
  return {"platform": d.platform, "device": str(d.device_kind), "cpus": os.cpu_count(),
          "python": platform.python_version(), "jax": jax.__version__,
          "machine": platform.machine(),
          # malloc's page size decides what each per-layer call's scratch costs
          # (see megatrain_jax/launch.py): the run's setting, stated.
          "transparent_huge_pages": launch.thp_mode(),
          "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}
