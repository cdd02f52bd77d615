"""`EngineConfig`: how the streaming engine runs, with the value sets of its choices.

Every field carries its help text in `metadata["help"]`, made by `config_field`, as
do `TrainConfig`'s and `DistributedConfig`'s; an experiment's config file holds every
field, each overridable on the command line (`megatrain_jax.configs`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# The choices of the string-valued fields. Flags and checks read them from here.
OPTIMIZER_MODES = ("auto", "per_unit", "whole_tree")
NONFINITE_POLICIES = ("raise", "skip")
STREAM_COPIES = ("auto", "keep", "on_fetch", "disk")
ACTIVATIONS = ("auto", "device", "host")
# Where each unit's fp32 master and optimizer state live (`engine.host.disk_store`).
STATE_TIERS = ("host", "disk")
# What a layer's backward recomputes (`engine.residuals`): its whole forward, all but
# the matmul outputs, or nothing.
RECOMPUTE = ("full", "dots", "none")
# Compute dtypes by name; masters and optimizer state are always fp32.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Elements per step of the fused host AdamW's in-place loop: p, g, m and v of one
# chunk (4 MiB at 2**18) stay in the last-level cache between reading and writing
# them, in few enough steps that the loop's own cost does not show
# (the sweep in docs/performance.md, "Each step timed after its own").
HOST_CHUNK = 2**18
# Gradients each engine queue holds at once (device -> host, then host -> optimizer):
# a full queue makes the step wait, which bounds the gradients on the device.
MAX_PENDING_GRADIENTS = 2


def config_field(default, help_text: str, **meta) -> dataclasses.Field:
  """A config dataclass's field with its help and what a check knows of it.

  Args:
    default: the default value.
    help_text: what the field means (shown by `megatrain_jax.configs.describe`).
    **meta: `choices` (the allowed values), `low` (a lower bound), `size` (bytes: a
      string like "8G" is accepted), `positive`, or `flag=False` (not in a config
      file: set from Python only).

  Returns:
    The `dataclasses.field`.
  """
  return dataclasses.field(default=default, metadata={"help": help_text, **meta})


_field = config_field


def dtype_name(dtype) -> str:
  """"float32" or "bfloat16" for a compute dtype given as a name or a dtype.

  Args:
    dtype: a key of `DTYPES` or a dtype (e.g. `jnp.bfloat16`).

  Returns:
    The dtype's name in `DTYPES`.

  Raises:
    ValueError: the dtype is not one of `DTYPES`.
  """
  if isinstance(dtype, str):
    if dtype not in DTYPES:
      raise ValueError(f"compute_dtype={dtype!r} is not one of {sorted(DTYPES)}.")
    return dtype
  name = jnp.dtype(dtype).name
  if name not in DTYPES:
    raise ValueError(f"compute_dtype must be float32 or bfloat16, got {name}.")
  return name


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How the streaming engine runs. Each field's help is in its metadata; in a config
  file they are `config.engine.<field>` (`python experiments/train.py --describe`
  lists them)."""

  prefetch_depth: int = _field(
      2, "Units fetched ahead of the one computing (0: each fetch waits for the "
      "previous unit's compute, no overlap).", low=0)
  checkpoint_every: int = _field(
      1, "Keep a block's input every this many layers; the backward recomputes a "
      "group of this many layers and holds their parameters for the group.", low=1)
  compute_dtype: Any = _field(
      jnp.float32, "Compute dtype, float32 or bfloat16; masters and optimizer state "
      "stay fp32.", choices=tuple(DTYPES))
  grad_accum: int = _field(
      1, "Micro-batches per step; the batch size must divide by it.", low=1)
  stream_embed_head: bool = _field(
      True, "Fetch the embedding and head when used (else keep their compute copies "
      "on the device, refreshed after each update).")
  optimizer_mode: str = _field(
      "auto", "Host optimizer: per_unit (update each unit as its gradient arrives; "
      "only for transforms the probe proves element-wise), whole_tree (one update "
      "after the sweep), or auto (probe the transform).", choices=OPTIMIZER_MODES)
  device_budget_bytes: int | None = _field(
      None, "Refuse configs and batches whose predicted device bytes exceed this "
      "(None: the accelerator's memory).", low=1, size=True)
  loss_chunk_tokens: int | None = _field(
      None, "Tokens per chunk of fp32 logits in the loss (None: fit 256 MiB).", low=1)
  transport: Any = _field(
      None, "How bytes move (None: `DeviceTransport()`; the launcher's "
      "--simulated_link_gb_per_s gives a `SimulatedLink`).", flag=False)
  timeout_s: float = _field(
      600.0, "Longest a caller waits on the engine (a fetch, a gradient slot, an "
      "update) before a TimeoutError; an idle engine never times out.", positive=True)
  return_freed_memory: bool = _field(
      True, "Set glibc's mmap threshold so freed unit buffers go back to the system "
      "(process-wide; see engine/host/malloc.py).")
  nonfinite: str = _field(
      "raise", "A NaN or infinite loss or gradient: raise FloatingPointError, or skip "
      "the step (every update then waits for the whole sweep).",
      choices=NONFINITE_POLICIES)
  stream_copy: str = _field(
      "auto", "Where a fetch's compute-dtype copy comes from: keep (one per unit in "
      "pinned host memory), on_fetch (cast from the fp32 master at each fetch), disk "
      "(with state_tier=disk: one file per unit beside its state, read at each fetch, "
      "so RAM holds no copy of the model), auto (on_fetch on the CPU backend, keep on "
      "an accelerator; with state_tier=disk, keep, or disk where the run would not "
      "fit this machine's available RAM with them kept).", choices=STREAM_COPIES)
  host_threads: int | None = _field(
      None, "Threads of the fused host AdamW, each on its own part of every unit "
      "(None: one per CPU this process may use).", low=1)
  host_chunk: int = _field(
      HOST_CHUNK, "Elements each host AdamW thread updates at a time (p, g, m, v of a "
      "chunk should fit the last-level cache).", low=1)
  activations: str = _field(
      "auto", "Where the block inputs kept for the backward wait: device, host (pinned "
      "host memory, sent during the forward and fetched back ahead of the backward: "
      "device memory flat in depth), or auto (host when a step would not fit the "
      "device budget or the accelerator otherwise).", choices=ACTIVATIONS)
  recompute: str = _field(
      "full", "What a layer's backward recomputes: full (its whole forward, from the "
      "kept block input), dots (all but the matmul outputs, kept from the forward: "
      "jax.checkpoint_policies.dots_with_no_batch_dims_saveable), none (nothing: the "
      "forward keeps every residual). Kept residuals go where `activations` says; "
      "dots and none need checkpoint_every=1.", choices=RECOMPUTE)
  data_parallel: int = _field(
      1, "Local devices each micro-batch is split over (data parallel): every unit "
      "goes to each of them, XLA sums the gradients across them inside the "
      "templates, and each gradient comes back once (engine/device/mesh.py). 0: all local "
      "devices. The batch must divide by it times grad_accum.", low=0)
  device_checkpoints: int | None = _field(
      None, "With activations=host: how many of the last checkpoint groups stay on the "
      "device (the backward needs them first, so sending them out and back would "
      "only cost link time). None: as many as fit within the step's device peak "
      "with only the last one kept, at least 1.", low=1)
  last_layer_in_head: bool = _field(
      True, "Run the last layer's forward and backward inside the head's call, so its "
      "forward runs once and its parameters are fetched once a micro-batch; only "
      "when its checkpoint group is that layer alone, recompute is full and the "
      "layer is dense.")
  frozen_dtype: str | None = _field(
      None, "Dtype the frozen parameters (`trainable=`) are kept in on the host: they "
      "have no fp32 master, no optimizer state and no gradient (None: the compute "
      "dtype; float32 for exact fp32 work).", choices=tuple(DTYPES))
  state_tier: str = _field(
      "host", "Where each unit's fp32 master and optimizer state live: host (RAM) or "
      "disk (a file per unit under state_dir, read ahead of its update and written "
      "back behind it; RAM keeps the compute-dtype copies, the gradient accumulators "
      "and a few units' state in flight).", choices=STATE_TIERS)
  state_dir: str | None = _field(
      None, "With state_tier=disk: the directory for the state files, on a fast disk "
      "(several, comma-separated, to stripe over drives). Each run needs its own.")
  state_in_flight: int = _field(
      2, "With state_tier=disk: units whose state is read ahead of their update, and "
      "units written behind, at most; with the fused AdamW, pieces (state_piece_mb) "
      "read ahead, updated at once and written behind.", low=1)
  state_piece_mb: float = _field(
      64.0, "With state_tier=disk and the fused AdamW: MiB of fp32 master in a piece of "
      "a unit, about (a whole number of host_chunk); each unit's state streams from "
      "its file through the update and back a piece at a time.", low=1e-3)
  step_start_buffers: int = _field(
      1, "Extra parameter buffers the prefetcher may fill at a step's start, while "
      "the forward holds few activations; only as many as stay within the step's "
      "device peak are used (0: none; none either with prefetch_depth=0).", low=0)
  turn_buffers: int = _field(
      1, "Extra parameter buffers the prefetcher may fill for the backward's first "
      "units while the head's call holds its own; only as many as stay within the "
      "step's device peak are used (0: none; none either with prefetch_depth=0).", low=0)

  def __post_init__(self):
    object.__setattr__(self, "compute_dtype", DTYPES[dtype_name(self.compute_dtype)])
    for f in dataclasses.fields(self):
      value, meta = getattr(self, f.name), f.metadata
      if ("choices" in meta and f.name != "compute_dtype" and value not in meta["choices"]
          and not (value is None and f.default is None)):
        raise ValueError(f"EngineConfig.{f.name}={value!r} is not one of "
                         f"{meta['choices']}.")
      if "low" in meta and not (value is None and f.default is None):
        number = float if isinstance(f.default, float) else int
        if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (number is int and not isinstance(value, int)) or value < meta["low"]):
          kind = "a number" if number is float else "an integer"
          raise ValueError(f"EngineConfig.{f.name} must be {kind} >= {meta['low']}"
                           f"{' or None' if f.default is None else ''}, got {value!r}.")
      if meta.get("positive") and (isinstance(value, bool)
                                   or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"EngineConfig.{f.name} must be a positive number, got {value!r}.")
    if self.state_tier == "disk":
      if not self.state_dir:
        raise ValueError("EngineConfig(state_tier='disk') needs state_dir: a directory on "
                         "a fast disk for the optimizer state files.")
      if self.stream_copy == "on_fetch":
        raise ValueError("stream_copy='on_fetch' casts each fetch from the fp32 master, "
                         "which state_tier='disk' keeps on disk: use stream_copy='keep' "
                         "or 'auto' (the compute-dtype copies stay in RAM).")
    if self.stream_copy == "disk" and self.state_tier != "disk":
      raise ValueError("stream_copy='disk' keeps the compute-dtype copies in files beside "
                       "the optimizer state: set state_tier='disk' and state_dir too.")
    if self.recompute != "full" and self.checkpoint_every != 1:
      raise ValueError(f"EngineConfig.recompute={self.recompute!r} keeps every layer's "
                       f"residuals, so checkpoint_every={self.checkpoint_every} groups "
                       "nothing: set checkpoint_every=1, or recompute='full' to "
                       "recompute groups of layers.")

  @property
  def frozen_dtype_name(self) -> str:
    """The dtype frozen parameters are kept in ("float32" or "bfloat16")."""
    return self.frozen_dtype or self.dtype_name

  @property
  def dtype_name(self) -> str:
    """The compute dtype's name ("float32" or "bfloat16")."""
    return jnp.dtype(self.compute_dtype).name
