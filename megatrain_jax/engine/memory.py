"""What a streaming run holds in host and device memory, by kind, before it is built.

Everything here is arithmetic over the model's unit shapes (`jax.eval_shape`,
no allocation), so a launcher can refuse a run that cannot fit before it spends
anything. `StreamingTrainer.estimate_device_bytes` uses the same functions.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax

from megatrain_jax.engine.host_optimizer import resolve_mode
from megatrain_jax.engine.workers import MAX_PENDING
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.loss import default_chunk_tokens

GiB = 2**30


@functools.lru_cache(maxsize=256)
def unit_trees(cfg: LlamaConfig) -> tuple[Any, ...]:
  """Abstract parameter trees of [embed, one block, head] (ShapeDtypeStructs)."""
  key = jax.random.key(0)
  return (jax.eval_shape(lambda: llama.init_embed(cfg, key)),
          jax.eval_shape(lambda: llama.init_block(cfg, key)),
          jax.eval_shape(lambda: llama.init_head(cfg, key)))


def _size(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def _nbytes(tree) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=256)
def _sizes(cfg: LlamaConfig) -> tuple[int, ...]:
  e, b, h = (_size(t) for t in unit_trees(cfg))
  return (e,) + (b,) * cfg.n_layers + (h,)


def unit_sizes(cfg: LlamaConfig) -> list[int]:
  """Parameters of every unit: embed, each block, head."""
  return list(_sizes(cfg))


def checkpoint_groups(cfg: LlamaConfig, ec) -> list[tuple[int, int]]:
  """Layer ranges [start, end) whose input is an activation checkpoint."""
  c, n = ec.checkpoint_every, cfg.n_layers
  return [(s, min(s + c, n)) for s in range(0, n, c)]


def schedule(cfg: LlamaConfig, ec) -> list[int]:
  """Units in the order one micro-batch fetches them (0 = embed, 1..L = blocks,
  L + 1 = head): the forward, the head (with the tied embedding), then the
  backward's checkpoint groups from the top. Resident units are not fetched."""
  head = cfg.n_layers + 1
  streamed = lambda u: ec.stream_embed_head or u not in (0, head)
  order = [0] + list(range(1, head)) + [head] + ([0] if cfg.tie_embeddings else [])
  for s, e in reversed(checkpoint_groups(cfg, ec)):
    order += [1 + i for i in range(s, e)]
  return [u for u in order if streamed(u)]


def held_units(cfg: LlamaConfig, ec) -> int:
  """Parameter buffers the compute holds at once: a checkpoint group's layers in
  its backward, or the head with the tied embedding."""
  return max(ec.checkpoint_every, 2 if cfg.tie_embeddings and ec.stream_embed_head else 1)


def prefetch_slots(cfg: LlamaConfig, ec) -> int:
  """Parameter buffers in flight at once: the held ones plus the prefetched."""
  return held_units(cfg, ec) + ec.prefetch_depth


def on_cpu_backend() -> bool:
  """Whether the engine computes on the CPU backend (device memory is host RAM)."""
  return jax.devices()[0].platform == "cpu"


def keeps_stream_copy(ec, on_cpu: bool | None = None) -> bool:
  """Whether a run keeps a compute-dtype copy of every unit in host memory
  (`EngineConfig.stream_copy`; "auto" keeps it only on an accelerator)."""
  if ec.stream_copy != "auto":
    return ec.stream_copy == "keep"
  return not (on_cpu_backend() if on_cpu is None else on_cpu)


def optimizer_mode(cfg: LlamaConfig, optimizer: optax.GradientTransformation, ec) -> str:
  """The host optimizer mode the engine will run (see `resolve_mode`)."""
  trees = unit_trees(cfg)
  assemble = lambda u: {"embed": u[0], "blocks": list(u[1:-1]), "head": u[-1]}
  return resolve_mode(optimizer, trees, assemble, ec.optimizer_mode)[0]


def host_bytes(cfg: LlamaConfig, optimizer: optax.GradientTransformation, ec,
               on_cpu: bool | None = None) -> dict[str, int]:
  """Host bytes of a streaming run by kind, and their total.

  masters: fp32 parameters. optimizer_state: the transform's state (from
  `optimizer.init` traced on the unit shapes). gradient_buffers: fp32
  accumulators of the whole model when updates wait for the sweep (a transform
  needing the whole tree, nonfinite="skip") or grad_accum > 1; otherwise the
  gradients queued between the transfer and optimizer threads. pinned_copies:
  the compute-dtype streaming copy of every unit, plus one unit being replaced,
  when the run keeps them (`keeps_stream_copy`; on_cpu: whether it runs on the
  CPU backend, default this process's backend).
  """
  trees = unit_trees(cfg)
  sizes = unit_sizes(cfg)
  n = sum(sizes)
  cd = jnp.dtype(ec.compute_dtype).itemsize
  mode, inner, _, _ = resolve_mode(
      optimizer, trees, lambda u: {"embed": u[0], "blocks": list(u[1:-1]), "head": u[-1]},
      ec.optimizer_mode)
  e, b, h = (_nbytes(jax.eval_shape(inner.init, t)) for t in trees)
  deferred = mode in ("whole_tree", "clipped") or ec.nonfinite == "skip"
  queued = (2 * MAX_PENDING + 1) * 4 * max(sizes)
  out = {
      "masters": 4 * n,
      "optimizer_state": e + cfg.n_layers * b + h,
      "gradient_buffers": (4 * n if deferred or ec.grad_accum > 1 else 0) + queued,
      "pinned_copies": cd * (n + max(sizes)) if keeps_stream_copy(ec, on_cpu) else 0,
  }
  out["total"] = sum(out.values())
  return out


def device_bytes(cfg: LlamaConfig, ec, batch_size: int, seq_len: int) -> dict[str, int]:
  """Device bytes the engine holds for batches of this shape, by kind, and their total.

  Parameter buffers in flight (prefetch slots), resident units (embedding and
  head with stream_embed_head=False), gradients waiting for the link, activation
  checkpoints, a group's recomputed inputs with the running activation and
  gradient, and one chunk of fp32 logits with its gradient. XLA's scratch space
  inside one template is not included.
  """
  cd = jnp.dtype(ec.compute_dtype).itemsize
  sizes = unit_sizes(cfg)
  embed_head = (0, len(sizes) - 1)
  streamed = [s for u, s in enumerate(sizes) if ec.stream_embed_head or u not in embed_head]
  grad_bytes = [s * (4 if u == 0 else cd) for u, s in enumerate(sizes)]
  b = batch_size // ec.grad_accum
  act = b * seq_len * cfg.d_model * cd
  chunk = ec.loss_chunk_tokens or default_chunk_tokens(cfg.vocab_size, b * seq_len)
  out = {
      "params_in_flight": prefetch_slots(cfg, ec) * cd * max(streamed or [0]),
      "resident_units": 0 if ec.stream_embed_head else cd * (sizes[0] + sizes[-1]),
      # One more than the queue holds: the next gradient exists while it waits to enter.
      "gradients_in_flight": (MAX_PENDING + 1) * max(grad_bytes),
      "activation_checkpoints": -(-cfg.n_layers // ec.checkpoint_every) * act,
      "activations": (ec.checkpoint_every + 3) * act,
      "logits_chunk": 2 * min(chunk, b * seq_len) * cfg.vocab_size * 4,
  }
  out["total"] = sum(out.values())
  return out


def resident_device_bytes(cfg: LlamaConfig, optimizer: optax.GradientTransformation
                          ) -> dict[str, int]:
  """Device bytes of `ResidentTrainer`'s state: fp32 parameters, gradients and
  optimizer state (activations are not counted)."""
  trees = unit_trees(cfg)
  n = sum(unit_sizes(cfg))
  e, b, h = (_nbytes(jax.eval_shape(optimizer.init, t)) for t in trees)
  out = {"params": 4 * n, "gradients": 4 * n, "optimizer_state": e + cfg.n_layers * b + h}
  out["total"] = sum(out.values())
  return out


def available_host_bytes() -> int:
  """Host memory the kernel says a new allocation can get (MemAvailable)."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def accelerator_bytes() -> int | None:
  """The accelerator's memory limit, or None on the CPU backend (host memory)."""
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return None
  stats = dev.memory_stats() or {}
  return stats.get("bytes_limit")


def _parts(d: dict[str, int]) -> str:
  return ", ".join(f"{k} {v / GiB:.2f}" for k, v in d.items() if k != "total")


def check_fits(cfg: LlamaConfig, optimizer: optax.GradientTransformation, ec,
               batch_size: int, seq_len: int, host_limit: int | None = None,
               device_limit: int | None = None, resident: bool = False
               ) -> dict[str, dict[str, int]]:
  """Refuses (ValueError, with the numbers and what to change) a run that cannot fit.

  host_limit defaults to `available_host_bytes()`; device_limit to the
  EngineConfig's budget, else the accelerator's memory. On the CPU backend the
  "device" is host memory, so device bytes count against the host limit too.
  `resident=True` plans a `ResidentTrainer` (everything on the device).
  Returns {"host": ..., "device": ...}.
  """
  if resident:
    host, dev = {"total": 0}, resident_device_bytes(cfg, optimizer)
  else:
    host = host_bytes(cfg, optimizer, ec)
    dev = device_bytes(cfg, ec, batch_size, seq_len)
  host_limit = available_host_bytes() if host_limit is None else host_limit
  on_cpu = on_cpu_backend()
  host_need = host["total"] + (dev["total"] if on_cpu else 0)
  if host_need > host_limit:
    raise ValueError(
        f"This run needs about {host_need / GiB:.2f} GiB of host memory (GiB: "
        f"{_parts(host)}" + (f", device-side arrays on the CPU backend "
                             f"{dev['total'] / GiB:.2f}" if on_cpu else "")
        + f"), but only {host_limit / GiB:.2f} GiB is available. Train a smaller model, "
        "use bfloat16 compute (halves the pinned copies) or EngineConfig(stream_copy="
        "'on_fetch') (none kept), keep grad_accum=1 with an "
        "element-wise optimizer such as AdamW (no gradient accumulators), or use a "
        "machine with more RAM.")
  limit = (ec.device_budget_bytes if ec is not None else None) or device_limit \
      or accelerator_bytes()
  if limit is not None and dev["total"] > limit:
    raise ValueError(
        f"A step on batch [{batch_size}, {seq_len}] needs about "
        f"{dev['total'] / GiB:.3f} GiB of device memory (GiB: {_parts(dev)}), over the "
        f"device limit of {limit / GiB:.3f} GiB. Lower the batch size or sequence "
        "length (or raise grad_accum), lower prefetch_depth or checkpoint_every, or "
        "raise the budget.")
  return {"host": host, "device": dev}
