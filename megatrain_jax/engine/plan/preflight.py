"""Will a run fit? The check made before anything is built.

`check_fits` compares `memory.host_bytes` and `memory.device_bytes` with the host
memory available and the device budget (or the accelerator's memory), and refuses a
run that cannot fit with the numbers by kind and what to change. The trainer's own
budget check raises the same message (`device_budget_error`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import optax
from absl import logging

from megatrain_jax.engine.plan import pinned
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.plan.memory import (GiB, StepPlan, device_bytes, host_bytes,
                                         resident_device_bytes, step_plan)
from megatrain_jax.engine.platform import (accelerator_bytes, available_host_bytes,
                                           on_cpu_backend, on_gpu)
from megatrain_jax.models.batch import check_batch
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.policy import PolicyLoss, check_keys


def describe(kinds: dict[str, int], unit: int = GiB) -> str:
  """Bytes by kind in words.

  Args:
    kinds: bytes by kind ("total" is left out).
    unit: GiB or MiB.

  Returns:
    "GiB: kind 1.23, kind 0.50".
  """
  name = {GiB: "GiB", 2**20: "MiB"}.get(unit, "bytes")
  return f"{name}: " + ", ".join(f"{k} {v / unit:.2f}" for k, v in kinds.items()
                                 if k != "total")


def device_budget_error(where: str, need: dict[str, int], limit: int,
                        unit: int = GiB) -> ValueError:
  """The one message for a step over the device budget.

  Args:
    where: what needs the memory ("A step on batch [8, 4096]").
    need: its bytes by kind, with "total".
    limit: the budget or the accelerator's memory.
    unit: GiB or MiB, for the numbers.

  Returns:
    A ValueError giving the need by kind, the limit, and what to change.
  """
  scale = {GiB: "GiB", 2**20: "MiB"}.get(unit, "bytes")
  return ValueError(
      f"{where} needs about {need['total'] / unit:.3f} {scale} of device memory "
      f"({describe(need, unit)}), over the device limit of {limit / unit:.3f} {scale}. "
      "Lower the batch size or sequence length (or raise grad_accum), send the "
      "checkpoints to host memory (activations='host' or 'auto'), keep fewer "
      "residuals (recompute='dots' or 'full'), lower prefetch_depth or "
      "checkpoint_every, stream the embedding and head, or raise the budget "
      "(device_budget_bytes).")


def resolve_stream_copy(cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                        ec: EngineConfig, host_limit: int | None = None,
                        batch_size: int | None = None, seq_len: int | None = None,
                        trainable=None, on_cpu: bool | None = None) -> EngineConfig:
  """`ec` with the disk tier's `stream_copy="auto"` decided: "keep" (the copies in
  RAM) where the run fits the host with them, else "disk" (logged). Other configs
  come back as they are.

  Args:
    cfg: the model.
    optimizer: the transform the run uses.
    ec: the engine config.
    host_limit: host bytes available (default: `available_host_bytes()`).
    batch_size: sequences per step; with `seq_len`, the activation checkpoints sent
      to host memory count too.
    seq_len: tokens per sequence.
    trainable: as `check_fits`.
    on_cpu: the device's memory is the host's (default: this process's backend).

  Returns:
    The engine config.
  """
  if ec.state_tier != "disk" or ec.stream_copy != "auto":
    return ec
  kept = dataclasses.replace(ec, stream_copy="keep")
  need = host_bytes(cfg, optimizer, kept, batch_size=batch_size, seq_len=seq_len,
                    trainable=trainable)["total"]
  if batch_size is not None and (on_cpu_backend() if on_cpu is None else on_cpu):
    need += device_bytes(cfg, kept, batch_size, seq_len)["total"]  # host memory too
  limit = available_host_bytes() if host_limit is None else host_limit
  if need <= limit:
    return kept
  logging.warning("stream_copy auto: with the compute-dtype copies in RAM the run needs "
                  "%.1f GiB and %.1f GiB are available, so they go to files beside the "
                  "state (stream_copy='disk'; each fetch reads one). Set "
                  "stream_copy='keep' to keep them in RAM.", need / GiB, limit / GiB)
  return dataclasses.replace(ec, stream_copy="disk")


def check_fits(cfg: LlamaConfig, optimizer: optax.GradientTransformation,
               ec: EngineConfig | None, batch_size: int, seq_len: int,
               host_limit: int | None = None, device_limit: int | None = None,
               resident: bool = False, trainable=None) -> dict[str, dict[str, int]]:
  """Refuses a run that cannot fit, before anything is allocated.

  On the CPU backend the "device" is host memory, so device bytes count against
  the host limit too.

  Args:
    cfg: the model.
    optimizer: the transform the run uses.
    ec: the engine config (None with `resident=True`).
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    host_limit: host bytes available (default: `available_host_bytes()`).
    device_limit: device bytes available (default: the config's budget, else the
      accelerator's memory).
    resident: plan a `ResidentTrainer` (everything on the device) instead.
    trainable: which parameters train, as the trainers' `trainable=` (None: all):
      frozen ones have no master, optimizer state or gradient on the host.

  Returns:
    {"host": bytes by kind, "device": bytes by kind}, and for a streaming run
    "pinned": the host bytes in pinned memory (`engine.pinned`). The host's
    include the activation checkpoints sent there (`EngineConfig.activations`).

  Raises:
    ValueError: the run needs more host or device memory than there is, or more
      pinned memory than XLA's GPU client allows, with the numbers by kind and
      what to change.
  """
  if resident:
    host, dev = {"total": 0}, resident_device_bytes(cfg, optimizer)
  else:
    host = host_bytes(cfg, optimizer, ec, batch_size=batch_size, seq_len=seq_len,
                      trainable=trainable)
    dev = device_bytes(cfg, ec, batch_size, seq_len)
  host_limit = available_host_bytes() if host_limit is None else host_limit
  on_cpu = on_cpu_backend()
  host_need = host["total"] + (dev["total"] if on_cpu else 0)
  if host_need > host_limit:
    raise ValueError(
        f"This run needs about {host_need / GiB:.2f} GiB of host memory ({describe(host)}"
        + (f", device-side arrays on the CPU backend {dev['total'] / GiB:.2f}" if on_cpu
           else "")
        + f"), but only {host_limit / GiB:.2f} GiB is available. Train a smaller model, "
        "use bfloat16 compute (halves the pinned copies) or EngineConfig(stream_copy="
        + ("'disk') (the copies in files too)" if ec is not None and ec.state_tier == "disk"
           else "'on_fetch') (none kept)") + ", keep grad_accum=1 with an "
        "element-wise optimizer such as AdamW (no gradient accumulators), or use a "
        "machine with more RAM.")
  limit = (ec.device_budget_bytes if ec is not None else None) or device_limit \
      or accelerator_bytes()
  if limit is not None and dev["total"] > limit:
    raise device_budget_error(f"A step on batch [{batch_size}, {seq_len}]", dev, limit)
  out = {"host": host, "device": dev}
  if not resident:
    out["pinned"] = pinned.pinned_bytes(cfg, ec, batch_size, seq_len, on_cpu)
    if on_gpu():
      pinned.check(out["pinned"])
  return out


def check_step(cfg: LlamaConfig, ec: EngineConfig, batch: Any,
               global_sum: Callable[[float], float] = float, deferred: bool | None = None,
               trains: tuple[int, ...] | None = None, policy: PolicyLoss | None = None
               ) -> tuple[dict[str, Any], float, float, StepPlan]:
  """Checks a batch for a streaming step, and its shape against the device budget.

  Args:
    cfg: the model.
    ec: the engine config.
    batch: {"input_ids", "labels", "loss_mask"}: this process's rows.
    global_sum: sums a number over the run's processes (`Transport.global_sum`).
    deferred: the trainer's updates wait for the sweep (`step_plan`).
    trains: each unit's elements that train (`step_plan`; None: all of them).
    policy: the trainer's policy-gradient loss (`models.policy`), or None for
      cross-entropy.

  Returns:
    (the batch as host numpy arrays, the loss's normalizer over every process's rows
    (cross-entropy's: the mask sum), the mask sum over them, its shape's
    `StepPlan`).

  Raises:
    ValueError: a bad batch (see `check_batch`, `models.policy.check_keys`), a batch
      size grad_accum (times the
      data-parallel devices) does not divide, an all-zero mask, or a shape over
      `ec.device_budget_bytes`.
  """
  batch = check_batch(cfg, batch)
  check_keys(policy, batch)
  b, t = batch["input_ids"].shape
  if b % ec.grad_accum:
    raise ValueError(f"Batch size {b} is not divisible by grad_accum={ec.grad_accum}.")
  n = ec.data_parallel or jax.local_device_count()
  if b % (ec.grad_accum * n):
    raise ValueError(f"Batch size {b} does not split into grad_accum={ec.grad_accum} "
                     f"micro-batches over data_parallel={n} devices: make it a multiple "
                     f"of {ec.grad_accum * n}.")
  tokens = global_sum(float(batch["loss_mask"].sum()))
  if tokens <= 0:
    raise ValueError("The batch's loss_mask is all zero: no token to train on.")
  total = global_sum(float(policy.normalizer(batch["loss_mask"]))) if policy else tokens
  packed = "segment_ids" in batch or "positions" in batch
  plan = step_plan(cfg, ec, b, t, deferred=deferred, packed=packed, trains=trains)
  need = device_bytes(cfg, ec, b, t, deferred=deferred, plan=plan)
  if ec.device_budget_bytes is not None and need["total"] > ec.device_budget_bytes:
    raise device_budget_error(f"A step on batch [{b}, {t}]", need, ec.device_budget_bytes,
                              2**20)
  return batch, total, tokens, plan
