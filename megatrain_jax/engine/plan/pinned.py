"""Pinned host memory on a GPU, and XLA's cap on it.

XLA's GPU client takes pinned (page-locked) host memory, the memory kind
`pinned_host`, from one pool whose size it reads once, when the client starts, from
`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (GiB; 64 when unset). The engine puts two
things there: the kept compute-dtype streaming copies (one per unit, plus the one an
update is replacing; `stream_copy="keep"`, the accelerator default) and the
activation checkpoints sent to host memory (`activations="host"`). In bf16 the
copies alone pass 64 GiB at about 32B parameters.

`pinned_bytes` counts them from the plan without starting a JAX backend, so that a
launcher can `configure` the variable first; an explicit setting wins and is
checked. `check` is the preflight's refusal of a run over the limit in force.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax.numpy as jnp
from absl import logging

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.plan.memory import GiB, step_plan
from megatrain_jax.engine.plan.sizes import keeps_stream_copy, unit_sizes
from megatrain_jax.models.config import LlamaConfig

ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_GIB = 64
# XLA stages its own transfers through the same pool: the limit set leaves this much
# beyond the engine's bytes.
HEADROOM = 0.10


def pinned_bytes(cfg: LlamaConfig, ec: EngineConfig, batch_size: int, seq_len: int,
                 on_cpu: bool = False) -> dict[str, int]:
  """The pinned host bytes of a streaming run, by kind, and their total.

  Args:
    cfg: the model.
    ec: the engine config; `activations="auto"` is counted as "host" (the most it
      can take), since resolving it needs the accelerator.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    on_cpu: whether the run is on the CPU backend (where no copies are kept).

  Returns:
    {"stream_copies", "activation_checkpoints", "total"}.
  """
  sizes = unit_sizes(cfg)
  cd = jnp.dtype(ec.compute_dtype).itemsize
  copies = cd * (sum(sizes) + max(sizes)) if keeps_stream_copy(ec, on_cpu) else 0
  most = ec if ec.activations != "auto" else dataclasses.replace(ec, activations="host")
  ckpts = step_plan(cfg, most, batch_size, seq_len).host_checkpoint_bytes
  return {"stream_copies": copies, "activation_checkpoints": ckpts,
          "total": copies + ckpts}


def limit_bytes() -> int:
  """The pinned-memory limit XLA's GPU client uses (or will use) in this process.

  Returns:
    `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB, or the 64 GiB default.

  Raises:
    ValueError: the variable is set to something other than a positive integer.
  """
  text = os.environ.get(ENV)
  if text is None:
    return DEFAULT_GIB * GiB
  try:
    gib = int(text)
  except ValueError:
    gib = 0
  if gib <= 0:
    raise ValueError(f"{ENV}={text!r} is not a positive whole number of GiB; XLA "
                     "reads it as one.")
  return gib * GiB


def limit_for(total: int) -> int:
  """The limit, in GiB, that holds `total` pinned bytes with XLA's headroom.

  Args:
    total: the engine's pinned bytes.

  Returns:
    At least the 64 GiB default.
  """
  return max(DEFAULT_GIB, math.ceil(total * (1 + HEADROOM) / GiB) + 1)


def _backends_started() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    return xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):  # a JAX without it: assume the worst
    return True


def configure(pinned: dict[str, int]) -> int:
  """Sets `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` for a run's pinned bytes, before JAX
  starts its backends. A value the user set is kept and checked.

  Args:
    pinned: `pinned_bytes` of the run.

  Returns:
    The limit in force, in bytes.

  Raises:
    ValueError: the user's setting is malformed or too small for the run, naming
      the variable and the value the run needs.
  """
  need = limit_for(pinned["total"])
  if ENV in os.environ:
    limit = limit_bytes()
    if pinned["total"] > limit:
      raise ValueError(_too_small(pinned, limit, need))
    return limit
  if _backends_started():
    logging.warning("JAX's backends already started: %s cannot be set for this run "
                    "(it needs %d GiB of pinned host memory; set %s=%d before starting).",
                    ENV, math.ceil(pinned["total"] / GiB), ENV, need)
    return limit_bytes()
  if need > DEFAULT_GIB:
    os.environ[ENV] = str(need)
    logging.info("Set %s=%d for %.1f GiB of pinned host memory (%s).", ENV, need,
                 pinned["total"] / GiB, _kinds(pinned))
  return limit_bytes()


def check(pinned: dict[str, int]) -> None:
  """Refuses a run on a GPU whose pinned bytes pass the limit in force.

  Args:
    pinned: `pinned_bytes` of the run.

  Raises:
    ValueError: over the limit, naming the variable and the value to set.
  """
  limit = limit_bytes()
  if pinned["total"] > limit:
    raise ValueError(_too_small(pinned, limit, limit_for(pinned["total"])))


def _kinds(pinned: dict[str, int]) -> str:
  return ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in pinned.items() if k != "total")


def _too_small(pinned: dict[str, int], limit: int, need: int) -> str:
  return (f"This run needs {pinned['total'] / GiB:.2f} GiB of pinned host memory "
          f"({_kinds(pinned)}), over XLA's limit of {limit / GiB:.0f} GiB ({ENV}). "
          f"Set {ENV}={need} before starting Python (the launchers set it when it is "
          "unset), or pin less: stream_copy='on_fetch' keeps no copies, "
          "activations='device' sends no checkpoints.")
