"""Host bytes per parameter of a training process, measured from its peak RSS."""

from __future__ import annotations

import os
import resource
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.bench.suite import Suite
from megatrain_jax.bench.timing import child_figures, synthetic_batch
from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.models.config import preset
from megatrain_jax.models.lora import LoraConfig
from megatrain_jax.optim import adamw


def rss_bytes() -> int:
  """This process's resident memory now.

  Returns:
    Resident bytes, from /proc/self/statm.
  """
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
  """This process's peak resident memory since it started its program.

  Read from VmHWM in /proc/self/status. `getrusage`'s ru_maxrss would not do for a
  child process: Linux carries the parent's peak across fork and exec into it, so
  a child started by a process that had used 5 GB reports at least 5 GB.

  Returns:
    Peak resident bytes (ru_maxrss where /proc is missing).
  """
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_memory_child(model_name: str, steps: int = 2, stream_copy: str = "auto",
                      lora_rank: int | None = None, layer_factor: int = 1,
                      state_dir: str | None = None, grad_accum: int = 1) -> dict[str, Any]:
  """Run in a fresh process: peak RSS of training `model_name`, per parameter.

  Trains the preset on a synthetic batch of `grad_accum` 64-token sequences (one a
  micro-batch), in bf16, with AdamW; the baseline is the resident memory once the
  backend is up. With `lora_rank`, adapters of that rank on every projection train
  and the base is frozen (kept in bf16); the figure is then per parameter of the base.

  Args:
    model_name: the model preset.
    steps: training steps taken.
    stream_copy: the engine's `stream_copy` setting.
    lora_rank: train LoRA adapters of this rank only (None: every weight).
    layer_factor: the preset with this many times its layers.
    state_dir: keep the optimizer state there (the disk tier; None: in RAM).
    grad_accum: micro-batches a step (their gradients accumulate in RAM).

  Returns:
    {"host_bytes_per_param", "rss_model", "rss_param_count", "rss_peak_bytes",
    "rss_baseline_bytes"}: the peak over the baseline per parameter, and its parts.
  """
  cfg = preset(model_name)
  cfg = cfg.replace(n_layers=cfg.n_layers * layer_factor)
  n_base = cfg.param_count()
  kw = {}
  if lora_rank is not None:
    cfg, kw = cfg.replace(lora=LoraConfig(rank=lora_rank)), {"trainable": nnx.LoRAParam}
  batch = synthetic_batch(cfg, grad_accum, 64)
  jax.block_until_ready(jnp.zeros(1) + 1)  # backend up before the baseline
  base = rss_bytes()
  ec = EngineConfig(compute_dtype=jnp.bfloat16, stream_copy=stream_copy, grad_accum=grad_accum,
                    **({} if state_dir is None else {"state_tier": "disk",
                                                     "state_dir": state_dir}))
  with StreamingTrainer.from_config(cfg, adamw(1e-4), ec, jax.random.key(0), **kw) as eng:
    for _ in range(steps):
      eng.step(batch)
    n = eng.stats()["param_count"] if lora_rank is None else n_base
  peak = peak_rss_bytes()
  return {"host_bytes_per_param": (peak - base) / n, "rss_model": model_name,
          "rss_param_count": n, "rss_peak_bytes": peak, "rss_baseline_bytes": base}


def host_memory_run(model_name: str, stream_copy: str, lora_rank: int | None = None,
                    layer_factor: int = 1, state_dir: str | None = None,
                    grad_accum: int = 1) -> dict[str, Any]:
  """Runs `host_memory_child` in a fresh Python process and reads back its figures.

  Args:
    model_name: the model preset.
    stream_copy: the engine's `stream_copy` setting.
    lora_rank: as `host_memory_child`.
    layer_factor: as `host_memory_child`.
    state_dir: as `host_memory_child`.
    grad_accum: as `host_memory_child`.

  Returns:
    The child's figures.

  Raises:
    RuntimeError: the child exits with an error or writes no result.
  """
  code = ("import json, sys; from megatrain_jax.bench import host_memory as m; "
          "json.dump(m.host_memory_child("
          f"{model_name!r}, stream_copy={stream_copy!r}, lora_rank={lora_rank!r}, "
          f"layer_factor={layer_factor!r}, state_dir={state_dir!r}, "
          f"grad_accum={grad_accum!r}), open(sys.argv[1], 'w'))")
  return child_figures(["-c", code], "host-memory")


def host_memory(s: Suite) -> dict[str, Any]:
  """Host bytes per parameter with the engine's defaults (on the CPU backend each
  fetch casts the master), and with the compute-dtype copies kept, as the default
  does on an accelerator.

  Args:
    s: the sizes (its `rss_model`).

  Returns:
    The figures of `host_memory_child` with the defaults, plus
    "host_bytes_per_param_kept_copies".
  """
  out = host_memory_run(s.rss_model, "auto")
  out["host_bytes_per_param_kept_copies"] = host_memory_run(
      s.rss_model, "keep")["host_bytes_per_param"]
  return out
