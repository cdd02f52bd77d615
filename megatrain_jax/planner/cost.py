"""What a step costs: its operations counted (`engine.plan.program`), as bytes moved,
FLOPs and each resource's time on a `Hardware` profile.

The planner (`planner.plan`) takes the slowest of those times as a step's; see its
docstring for how they combine and for the data-parallel model.
"""

from __future__ import annotations

import jax.numpy as jnp

from megatrain_jax.engine.plan import memory, ops, sizes
from megatrain_jax.engine.plan import program as program_lib
from megatrain_jax.engine.plan.schedule import Schedule
from megatrain_jax.metrics import layer_forward_flops_per_token, model_flops_per_token
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.planner.hardware import Hardware


# The disk tier's files: each parameter's fp32 master and AdamW's two moments.
DISK_STATE_BYTES_PER_PARAM = 12


def disk_state_bytes(cfg: LlamaConfig, ec) -> int:
  """Bytes of the disk tier's state files (0 with the state in RAM).

  Args:
    cfg: the model.
    ec: the engine config (`state_tier`).

  Returns:
    The bytes.
  """
  if ec.state_tier != "disk":
    return 0
  return DISK_STATE_BYTES_PER_PARAM * sum(sizes.unit_sizes(cfg))


def disk_copy_bytes(cfg: LlamaConfig, ec) -> int:
  """Bytes of the streaming copies' files (`stream_copy="disk"`; else 0).

  Args:
    cfg: the model.
    ec: the engine config.

  Returns:
    The bytes: a compute-dtype copy of every parameter.
  """
  if ec.stream_copy != "disk":
    return 0
  return jnp.dtype(ec.compute_dtype).itemsize * sum(sizes.unit_sizes(cfg))


def disk_step_bytes(cfg: LlamaConfig, ec) -> tuple[int, int]:
  """Bytes a step reads from and writes to the disk tier's drives.

  Args:
    cfg: the model.
    ec: the engine config.

  Returns:
    (read, written): every state file once each way; with the copies on disk, also
    every fetch's copy read and every copy written once.
  """
  state, copies = disk_state_bytes(cfg, ec), disk_copy_bytes(cfg, ec)
  return state + (step_bytes(cfg, ec)["h2d"] if copies else 0), state + copies


def disk_figures(cfg: LlamaConfig, ec, files: bool = False) -> dict[str, int]:
  """The disk tier's bytes by kind (empty with the state in RAM).

  Args:
    cfg: the model.
    ec: the engine config.
    files: only the files' bytes.

  Returns:
    "state files", "copy files" (0 with the copies in RAM), and unless `files`,
    "read per step" and "written per step" (`disk_step_bytes`).
  """
  if ec.state_tier != "disk":
    return {}
  out = {"state files": disk_state_bytes(cfg, ec), "copy files": disk_copy_bytes(cfg, ec)}
  if not files:
    out["read per step"], out["written per step"] = disk_step_bytes(cfg, ec)
  return out


def step_program(cfg: LlamaConfig, ec) -> program_lib.StepProgram:
  """A step's operations for `ec` (`engine.plan.program`): what the planner counts
  its template calls, fetches, gradients and recomputed forwards from.

  Args:
    cfg: the model.
    ec: the engine config.

  Returns:
    The `StepProgram` of a step after the first (its fetches started ahead).
  """
  return program_lib.step_program(Schedule.build(cfg, ec), ec.grad_accum,
                                  keep=ec.recompute != "full")


def step_bytes(cfg: LlamaConfig, ec) -> dict[str, int]:
  """Bytes one step moves each way, and the host optimizer's traffic.

  Args:
    cfg: the model.
    ec: the engine config (compute dtype, grad_accum, stream_embed_head).

  Returns:
    {"h2d": every fetch of the step's program, "d2h": every gradient it sends,
    "host_opt"}: bytes per step.
  """
  prog = step_program(cfg, ec)
  unit, grad = sizes.unit_param_bytes(cfg, ec), sizes.unit_grad_bytes(cfg, ec)
  n, cd = sum(sizes.unit_sizes(cfg)), jnp.dtype(ec.compute_dtype).itemsize
  # AdamW-class: read master, grad, 2 moments; write master, 2 moments; write the copy.
  opt = n * (4 + 4 + 16 + cd) + (4 * n * 2 * (ec.grad_accum - 1))
  return {"h2d": sum(unit[u] for u in prog.fetched_units()),
          "d2h": sum(grad[u] for u in prog.sent_units()), "host_opt": opt}


def step_flops(cfg: LlamaConfig, ec, batch_size: int, seq_len: int) -> float:
  """FLOPs of one step: the model's forward and backward (`model_flops_per_token`),
  plus every forward its program runs again (`recomputed_flops_per_token`).

  Args:
    cfg: the model.
    ec: the engine config (recompute, checkpoint_every, grad_accum).
    batch_size: sequences per step.
    seq_len: tokens per sequence.

  Returns:
    The FLOPs.
  """
  prog = step_program(cfg, ec)
  again = sum(recomputed_flops_per_token(cfg, seq_len, op, ec.recompute) for op in prog.ops)
  return (model_flops_per_token(cfg, seq_len) + again / ec.grad_accum) * batch_size * seq_len


def recomputed_flops_per_token(cfg: LlamaConfig, seq_len: int, op, recompute: str) -> float:
  """The FLOPs per token an operation spends running a forward again: a group's
  recomputed input, and a layer's backward that recomputes its forward (all of it
  with recompute "full"; with "dots" the attention scores and weighted values;
  with a feed-forward in chunks, those chunks, in every mode but "full", whose
  forward holds them).

  Args:
    cfg: the model.
    seq_len: tokens per sequence.
    op: an operation of a step's program.
    recompute: `EngineConfig.recompute`.

  Returns:
    The FLOPs (0 for an operation that recomputes nothing).
  """
  if isinstance(op, ops.Recompute) or (
      isinstance(op, ops.BlockBackward) and not op.kept):
    return layer_forward_flops_per_token(cfg, seq_len, op.layer)
  if not isinstance(op, ops.BlockBackward):
    return 0.0
  ff = 6.0 * cfg.d_model * cfg.d_ff if cfg.mlp_chunk else 0.0
  attention = 4.0 * seq_len * cfg.n_heads * cfg.head_dim if recompute == "dots" else 0.0
  return attention + ff


def collective_s(grad_bytes: float, hw: Hardware, devices: int, hosts: int) -> float:
  """The gradient all-reduce of one micro-batch (see the module docstring).

  Args:
    grad_bytes: the model's gradient, in the compute dtype.
    hw: the hardware profile (its interconnect and network rates).
    devices: devices per host.
    hosts: hosts.

  Returns:
    Seconds; 0 for one device.
  """
  inside = 2 * (devices - 1) / devices * grad_bytes / hw.interconnect_bytes_per_s
  between = 2 * (hosts - 1) / hosts * grad_bytes / devices / hw.network_bytes_per_s
  return inside + between


def times(cfg, ec, hw: Hardware, batch_size: int, seq_len: int, hosts: int = 1
           ) -> dict[str, float]:
  """Each resource's time for one step of one device's share of the batch.

  Args:
    cfg: the model.
    ec: the engine config.
    hw: the hardware profile.
    batch_size: the global batch.
    seq_len: tokens per sequence.
    hosts: hosts.

  Returns:
    Seconds of "compute", "h2d", "d2h", "host_opt" and "collectives"; with
    `state_tier="disk"`, also "disk": reading and then writing every unit's master
    and AdamW moments (12 bytes per parameter each way) over the drives, and the
    copies' files with them (`disk_step_bytes`); with the copies on disk, "h2d"
    includes reading each fetch's copy and "host_opt" writing each new copy.

  Raises:
    ValueError: the disk tier on a profile that states no drives.
  """
  devices = max(ec.data_parallel, 1)
  batch_size //= devices * hosts
  # Checkpoints sent to host memory cross the link once each way per micro-batch.
  moved = ec.grad_accum * memory.step_plan(cfg, ec, batch_size, seq_len).host_checkpoint_bytes
  flops = step_flops(cfg, ec, batch_size, seq_len)
  calls = step_program(cfg, ec).template_calls()
  b = step_bytes(cfg, ec)
  out = {
      "compute": flops / hw.flops_at(cfg.d_model) + calls * hw.call_overhead_s,
      "h2d": (b["h2d"] + moved) / hw.h2d_bytes_per_s,
      "d2h": (b["d2h"] + moved) / hw.d2h_bytes_per_s,
      "host_opt": b["host_opt"] / hw.host_opt_bytes_per_s,
      "collectives": collective_s(b["d2h"], hw, devices, hosts),
  }
  if ec.state_tier == "disk":
    if not hw.disk_drives:
      raise ValueError(f"The hardware profile {hw.name!r} states no NVMe drives, so the "
                       "disk tier's time is unknown: choose a profile with drives "
                       "(workstation) or state_tier='host'.")
    read, written = disk_step_bytes(cfg, ec)
    rate_r = hw.disk_drives * hw.disk_read_bytes_per_s
    rate_w = hw.disk_drives * hw.disk_write_bytes_per_s
    out["disk"] = read / rate_r + written / rate_w
    if disk_copy_bytes(cfg, ec):  # a fetch reads its copy, then sends it; an update
      out["h2d"] += b["h2d"] / rate_r  # writes its new copy after it: each in turn,
      out["host_opt"] += disk_copy_bytes(cfg, ec) / rate_w  # on the same thread
  return out
