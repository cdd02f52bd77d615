"""The byte rules of a step: each unit's size as fetched and as its gradient, one
activation, one checkpoint with the residuals its layer keeps.

One source for every byte count: the step program (`plan.program`) attaches these to
its operations, and the memory model, the planner and the preflight read them from
there or from here. Everything is arithmetic over abstract shapes (`jax.eval_shape`),
nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.device import residuals
from megatrain_jax.engine.host.adamw import host_threads
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.platform import on_cpu_backend
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig


def unit_trees(cfg: LlamaConfig) -> tuple[Any, ...]:
  """Every unit's abstract tree, without allocating (`llama.abstract_units`).

  Args:
    cfg: the model.

  Returns:
    ShapeDtypeStruct trees of the embedding, each block and the head.
  """
  return llama.abstract_units(cfg)


def _size(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def nbytes(tree) -> int:
  """Bytes of every leaf of an (abstract) tree.

  Args:
    tree: arrays or ShapeDtypeStructs.

  Returns:
    Their total.
  """
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=256)
def _sizes(cfg: LlamaConfig) -> tuple[int, ...]:
  return tuple(_size(t) for t in unit_trees(cfg))


def unit_sizes(cfg: LlamaConfig) -> list[int]:
  """Parameters of every unit.

  Args:
    cfg: the model.

  Returns:
    One count per unit: embed, each block, head.
  """
  return list(_sizes(cfg))


def unit_param_bytes(cfg: LlamaConfig, ec: EngineConfig) -> list[int]:
  """Bytes of each unit's compute-dtype copy (what a fetch moves).

  Args:
    cfg: the model.
    ec: the engine config (its compute dtype).

  Returns:
    One size per unit, in unit order.
  """
  cd = jnp.dtype(ec.compute_dtype).itemsize
  return [cd * s for s in _sizes(cfg)]


def unit_grad_bytes(cfg: LlamaConfig, ec: EngineConfig,
                    trains: tuple[int, ...] | None = None) -> list[int]:
  """Bytes of each unit's gradient as it leaves the device.

  Args:
    cfg: the model.
    ec: the engine config (its compute dtype).
    trains: each unit's elements that train (None: all of them).

  Returns:
    One size per unit, its elements that train: the compute dtype, but fp32 for
    the embedding (its scatter-add is done in fp32).
  """
  cd = jnp.dtype(ec.compute_dtype).itemsize
  counts = _sizes(cfg) if trains is None else trains
  return [s * (4 if u == 0 else cd) for u, s in enumerate(counts)]


def keeps_stream_copy(ec: EngineConfig, on_cpu: bool | None = None) -> bool:
  """Whether a run keeps a compute-dtype copy of every unit in host memory (RAM).

  Args:
    ec: the engine config (`stream_copy`; "auto" keeps it only on an accelerator).
    on_cpu: whether the run is on the CPU backend (default: this process's).

  Returns:
    The answer.
  """
  if ec.stream_copy == "disk":  # in files: RAM holds only the units in flight
    return False
  if ec.state_tier == "disk":  # the fp32 masters are on disk: fetches read the copies
    return True
  if ec.stream_copy != "auto":
    return ec.stream_copy == "keep"
  return not (on_cpu_backend() if on_cpu is None else on_cpu)


def activation_bytes(cfg: LlamaConfig, ec: EngineConfig, batch_size: int,
                     seq_len: int) -> int:
  """Bytes of one block input of a micro-batch (a checkpoint, or the running one).

  Args:
    cfg: the model.
    ec: the engine config (compute dtype, grad_accum).
    batch_size: sequences per step.
    seq_len: tokens per sequence.

  Returns:
    micro-batch x seq_len x d_model x the compute dtype's size.
  """
  return (batch_size // ec.grad_accum) * seq_len * cfg.d_model * jnp.dtype(
      ec.compute_dtype).itemsize


@functools.lru_cache(maxsize=256)
def kept_bytes(cfg: LlamaConfig, layer: int, recompute: str, batch: int, seq_len: int,
               dtype_name: str, packed: bool = False) -> int:
  """Bytes a layer keeps for its backward besides its input (no allocation).

  Args:
    cfg: the model.
    layer: the layer's index (its structure).
    recompute: an `EngineConfig.recompute` mode.
    batch: sequences per micro-batch.
    seq_len: tokens per sequence.
    dtype_name: the compute dtype's name.
    packed: whether the batch carries positions and segment ids.

  Returns:
    0 for "full"; else the kept residuals' bytes.
  """
  if recompute == "full":
    return 0
  dtype = jnp.dtype(dtype_name)
  spec = FlatSpec(llama.abstract_units(cfg)[1 + layer])
  S = jax.ShapeDtypeStruct
  ids = S((batch, seq_len), jnp.int32) if packed else None
  # LoRA dropout keeps its masks too: the training step draws them.
  keys = S((batch, 2), jnp.uint32) if cfg.lora is not None and cfg.lora.dropout else None
  out = jax.eval_shape(
      lambda flat, x, pos, seg, keys: residuals.forward(
          cfg, spec, cfg.layer_window(layer), recompute, flat, x, pos, seg, keys)[2],
      S((spec.size,), dtype), S((batch, seq_len, cfg.d_model), dtype), ids, ids, keys)
  return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(out))


@functools.lru_cache(maxsize=64)
def layer_structures(cfg: LlamaConfig) -> tuple[int, ...]:
  """Each layer's structure (its parameter layout and attention window), named by
  the first layer like it.

  Args:
    cfg: the model.

  Returns:
    One index per layer.
  """
  first: dict[Any, int] = {}
  return tuple(first.setdefault((FlatSpec(unit), cfg.layer_window(i)), i)
               for i, unit in enumerate(llama.abstract_units(cfg)[1:-1]))


def layer_checkpoint_bytes(cfg: LlamaConfig, ec: EngineConfig, batch_size: int,
                           seq_len: int, packed: bool | None = None) -> tuple[int, ...]:
  """Bytes of each layer's activation checkpoint: its input, plus with recompute
  "dots" or "none" the residuals it keeps.

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    packed: the batches carry packed-document ids (None: the larger of both).

  Returns:
    One size per layer.
  """
  b = batch_size // ec.grad_accum
  act = activation_bytes(cfg, ec, batch_size, seq_len)
  kinds = (False, True) if packed is None else (packed,)
  kept = {i: max(kept_bytes(cfg, i, ec.recompute, b, seq_len, ec.dtype_name, p)
                 for p in kinds)
          for i in set(layer_structures(cfg))}
  return tuple(act + kept[i] for i in layer_structures(cfg))


def checkpoint_bytes(cfg: LlamaConfig, ec: EngineConfig, batch_size: int,
                     seq_len: int) -> int:
  """Bytes of the largest activation checkpoint (`layer_checkpoint_bytes`).

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.

  Returns:
    The bytes.
  """
  return max(layer_checkpoint_bytes(cfg, ec, batch_size, seq_len),
             default=activation_bytes(cfg, ec, batch_size, seq_len))


def pools_buffers(recompute: str, activations: str, platform: str) -> bool:
  """Whether a step reuses its kept residuals' buffers (`BufferPool`): with
  recompute "dots" or "none" and the residuals on the device, on the CPU backend
  (an accelerator's allocator reuses freed memory itself).

  Args:
    recompute: `EngineConfig.recompute`.
    activations: where the step's checkpoints wait, "device" or "host".
    platform: the JAX platform the step runs on.

  Returns:
    The answer.
  """
  return recompute != "full" and activations == "device" and platform == "cpu"


@dataclasses.dataclass(frozen=True)
class StepBytes:
  """The byte rules of one batch shape (`plan.sizes`).

  Attributes:
    unit: each unit's bytes as fetched.
    grad: each unit's gradient bytes as it leaves the device (0: it does not train).
    tied_grad: the head's gradient for a tied embedding.
    act: one activation (a block's input or output, or its gradient).
    ckpt: each layer's checkpoint: its input, with the residuals it keeps.
  """
  unit: tuple[int, ...]
  grad: tuple[int, ...]
  tied_grad: int
  act: int
  ckpt: tuple[int, ...]


def step_bytes(cfg: LlamaConfig, ec: EngineConfig, batch_size: int, seq_len: int,
               trains: tuple[int, ...] | None = None, packed: bool | None = None
               ) -> StepBytes:
  """The byte rules of a batch shape.

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.
    trains: each unit's elements that train (None: all of them).
    packed: as `layer_checkpoint_bytes`.

  Returns:
    The `StepBytes`.
  """
  unit = unit_param_bytes(cfg, ec)
  grad = unit_grad_bytes(cfg, ec, trains)
  # The head's gradient for a tied embedding: its elements that train, computed as
  # the head computes, in the compute dtype.
  tied = (unit[0] if trains is None else trains[0] * jnp.dtype(ec.compute_dtype).itemsize)
  return StepBytes(tuple(unit), tuple(grad), tied if cfg.tie_embeddings else 0,
                   activation_bytes(cfg, ec, batch_size, seq_len),
                   layer_checkpoint_bytes(cfg, ec, batch_size, seq_len, packed))


def piece_elements(ec: EngineConfig) -> int:
  """The elements of a disk-tier piece, as asked (`EngineConfig.state_piece_mb`).

  Args:
    ec: the engine config.

  Returns:
    At least 1.
  """
  return max(1, int(ec.state_piece_mb * 2**20) // 4)


def disk_state_in_ram(ec: EngineConfig, trained: list[int], states: list[int],
                      pieces: bool) -> tuple[int, int]:
  """Host bytes of the disk tier's unit states in RAM at once, and of its read buffers.

  Args:
    ec: the engine config (`state_in_flight`, `state_piece_mb`, `host_chunk`,
      `host_threads`: None counts this machine's).
    trained: each unit's trained elements.
    states: each unit's optimizer state bytes.
    pieces: whether updates stream the state in pieces (`host.disk_pieces`).

  Returns:
    (in flight, read buffers). In pieces: a wave of `state_in_flight` pieces (at
    least one per update thread)
    updating, the next one read, as many written behind, each piece at most a chunk
    over its size (`part_bounds`), and a read buffer for each piece read at once.
    Whole units: `state_in_flight` read ahead, one updating, as many written behind
    (the largest units' states), and a read buffer for each read ahead.
  """
  depth = ec.state_in_flight
  if pieces:  # at least a piece per update thread at once
    depth = max(depth, ec.host_threads or host_threads())
    per_element = 4 + max(s / t for t, s in zip(trained, states) if t)
    piece = min(max(trained), piece_elements(ec) + ec.host_chunk) * per_element
    return int(3 * depth * piece), int(depth * piece)
  per_unit = sorted((4 * t + s for t, s in zip(trained, states)), reverse=True)
  return sum(per_unit[:2 * depth + 1]), sum(per_unit[:depth])
