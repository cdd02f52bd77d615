"""What a layer's backward keeps from its forward (`EngineConfig.recompute`).

  full  the block input only; the backward runs the layer's forward again inside
        its vjp (the least memory, one more forward per layer);
  dots  the block input and every matmul output without batch dimensions (the
        q/k/v/o projections and the feed-forward's gate, up and down:
        `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); the backward
        recomputes the norms, rotary, the attention scores and the activations;
  none  every residual of the layer's vjp; the backward runs no forward at all.

For "dots" and "none" the forward template returns the layer's vjp residuals
beside its output. A vjp's residuals would include the layer's weights, which the
backward has anyway (its parameters are fetched for it): the vjp is taken with
respect to the unflattened parameter tree, the residual leaves that are those
parameters (or the input) are recognised by identity while tracing and left out,
and the backward template puts its own parameters back in their places. So what
a layer keeps is activations only, and no weight crosses the link twice.

The layout of the residuals (the vjp's tree and which leaves are parameters) is
static per layer structure and input shapes: the backward template rebuilds it in
its own trace from an abstract trace of the forward (`layout`, no computation), and
checks that the residuals it was given have the shapes and dtypes that layout says.

What "dots" and "none" do not keep: `jax.checkpoint` regions inside the layer stay
recomputed in its backward (the feed-forward chunks of `LlamaConfig.mlp_chunk`), as
do the kernels with their own VJP (blockwise and cuDNN attention recompute their
scores), and "dots" does not keep an MoE layer's expert matmuls (`ragged_dot`, not
a `dot_general`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.flat import FlatSpec
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig

_INPUT = -1  # a residual leaf that is the block input


def policy(recompute: str):
  """The `jax.checkpoint` policy of a recompute mode (None: keep every residual).

  Args:
    recompute: "dots" or "none".

  Returns:
    A `jax.checkpoint_policies` policy, or None for "none".

  Raises:
    KeyError: another mode ("full" keeps no residual).
  """
  return {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          "none": None}[recompute]


class Layout(NamedTuple):
  """Where a layer's kept residuals go back in its vjp.

  Attributes:
    treedef: the vjp function's tree.
    slots: one per leaf: the index of a parameter leaf, `_INPUT` for the block
      input, or None for a kept residual (taken in order).
    kept: the kept residuals' shapes and dtypes, in order.
  """
  treedef: Any
  slots: tuple
  kept: tuple = ()


def _layer_fn(cfg: LlamaConfig, window, pos, seg):
  def f(params, x):
    y, stats = llama.block_apply_stats(cfg, params, x, pos, window, seg)
    return (y, None if stats is None else stats.probs), stats
  return f


def forward(cfg: LlamaConfig, spec: FlatSpec, window, recompute: str, flat, x, pos, seg
            ) -> tuple[jax.Array, Any, list, Layout]:
  """A layer's forward that keeps its residuals (traceable).

  Args:
    cfg: the model.
    spec: the layer's flat layout.
    window: its attention window.
    recompute: "dots" or "none".
    flat: its flat compute-dtype parameters.
    x: its input.
    pos: positions or None.
    seg: segment ids or None.

  Returns:
    (its output, its router stats or None, the kept residuals, their `Layout`).
  """
  params = spec.unflatten(flat)
  f = _layer_fn(cfg, window, pos, seg)
  if policy(recompute) is not None:
    f = jax.checkpoint(f, policy=policy(recompute))
  (y, _), vjp, stats = jax.vjp(f, params, x, has_aux=True)
  leaves, treedef = jax.tree.flatten(vjp)
  where = {id(p): i for i, p in enumerate(jax.tree.leaves(params))}
  where[id(x)] = _INPUT
  slots = tuple(where.get(id(leaf)) for leaf in leaves)
  kept = [leaf for leaf, s in zip(leaves, slots) if s is None]
  shapes = tuple((k.shape, jax.numpy.dtype(k.dtype)) for k in kept)
  return y, stats, kept, Layout(treedef, slots, shapes)


def layout(cfg: LlamaConfig, spec: FlatSpec, window, recompute: str, flat, x, pos, seg
           ) -> Layout:
  """The `Layout` of `forward` for these arguments, from an abstract trace of it (no
  computation), so that a backward rebuilds it in its own trace.

  Args:
    cfg: the model.
    spec: the layer's flat layout.
    window: its attention window.
    recompute: "dots" or "none".
    flat: its flat parameters (an array, a tracer or a ShapeDtypeStruct).
    x: its input (likewise).
    pos: positions or None.
    seg: segment ids or None.

  Returns:
    The layout.
  """
  box = []

  def kept_only(flat, x, pos, seg):
    *_, kept, lay = forward(cfg, spec, window, recompute, flat, x, pos, seg)
    box.append(lay)
    return kept

  S = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)
  jax.eval_shape(kept_only, S(flat), S(x), S(pos), S(seg))
  return box[0]


def backward(spec: FlatSpec, layout: Layout, flat, x, kept, g, g_probs
             ) -> tuple[jax.Array, jax.Array]:
  """A layer's backward from its kept residuals: no forward runs (traceable).

  Args:
    spec: the layer's flat layout.
    layout: what `forward` returned for this structure and shape.
    flat: its flat compute-dtype parameters.
    x: its input.
    kept: the residuals `forward` kept.
    g: the gradient of its output.
    g_probs: the gradient of its router probabilities (None for a dense layer).

  Returns:
    (the gradient of its flat parameters, of its input).

  Raises:
    ValueError: `kept` does not have the shapes and dtypes `layout` says.
  """
  got = tuple((k.shape, jax.numpy.dtype(k.dtype)) for k in kept)
  if got != layout.kept:
    raise ValueError(f"A layer's kept residuals ({len(got)} arrays) do not match what its "
                     f"forward keeps for these inputs ({len(layout.kept)}): the forward and "
                     "backward templates ran on different shapes or dtypes. Use "
                     "EngineConfig(recompute='full') and report this.")
  params = jax.tree.leaves(spec.unflatten(flat))
  rest = iter(kept)
  leaves = [next(rest) if s is None else x if s == _INPUT else params[s]
            for s in layout.slots]
  g_tree, g_x = jax.tree.unflatten(layout.treedef, leaves)((g, g_probs))
  return spec.flatten(g_tree), g_x


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
  out = jax.eval_shape(
      lambda flat, x, pos, seg: forward(cfg, spec, cfg.layer_window(layer), recompute,
                                        flat, x, pos, seg)[2],
      S((spec.size,), dtype), S((batch, seq_len, cfg.d_model), dtype), ids, ids)
  return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(out))


def checkpoint_bytes(cfg: LlamaConfig, ec: EngineConfig, batch_size: int,
                     seq_len: int) -> int:
  """Bytes of one activation checkpoint: the block input, plus with recompute "dots"
  or "none" the residuals the layer keeps (a bound: the largest over the layer
  structures, with or without packed-document ids).

  Args:
    cfg: the model.
    ec: the engine config.
    batch_size: sequences per step.
    seq_len: tokens per sequence.

  Returns:
    The bytes.
  """
  b = batch_size // ec.grad_accum
  first = {}  # one layer per structure (its parameter shapes and window)
  for i, unit in enumerate(llama.abstract_units(cfg)[1:-1]):
    first.setdefault((FlatSpec(unit), cfg.layer_window(i)), i)
  # Traced for one sequence and scaled: every residual but a few small ones (rotary
  # tables, broadcast norm scales) has the batch dimension, so this bounds it.
  kept = max((b * kept_bytes(cfg, i, ec.recompute, 1, seq_len, ec.dtype_name, packed)
              for i in first.values() for packed in (False, True)), default=0)
  return b * seq_len * cfg.d_model * jnp.dtype(ec.compute_dtype).itemsize + kept


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


class BufferPool:
  """A layer's input and residual buffers, from its backward to the next forward.

  On the CPU backend every device buffer is a fresh allocation, and one over
  malloc's mmap threshold (`host_memory.MMAP_THRESHOLD`) a fresh mapping whose
  pages are faulted in again: with recompute "none" that was every kept residual
  of every layer, every step. So once a layer's backward has used its input and
  residuals, their buffers wait here, and a later `block_fwd_keep` of the same
  shapes gets them donated and writes into them. The device then holds every
  layer's residuals between steps too, which the step's peak holds anyway (its
  backward starts with all of them); the ledger counts them under "pool".
  """

  def __init__(self, ledger):
    """An empty pool.

    Args:
      ledger: the runtime's device-memory ledger.
    """
    self._ledger = ledger
    self._free: dict[tuple, list] = {}
    self._count = 0

  def give(self, arrays: tuple) -> None:
    """Keeps buffers no computation needs any more.

    Args:
      arrays: a layer's input and kept residuals, in `kept_shapes` order.
    """
    self._count += 1
    key = ("pool", self._count)
    self._ledger.add(key, sum(a.nbytes for a in arrays))
    self._free.setdefault(_shapes(arrays), []).append((key, tuple(arrays)))

  def take(self, shapes: tuple) -> tuple | None:
    """Buffers of these shapes, to donate, or None when the pool has none.

    Args:
      shapes: `Templates.kept_shapes` of the forward they are for.

    Returns:
      The arrays (no longer counted here), or None.
    """
    free = self._free.get(tuple((s.shape, jnp.dtype(s.dtype)) for s in shapes), [])
    while free:
      key, arrays = free.pop()
      self._ledger.remove(key)
      if not any(a.is_deleted() for a in arrays):
        return arrays
    return None

  def clear(self) -> None:
    """Drops every buffer (the runtime is shut down, or a step failed)."""
    for entries in self._free.values():
      for key, _ in entries:
        self._ledger.remove(key)
    self._free.clear()


def _shapes(arrays) -> tuple:
  return tuple((a.shape, jnp.dtype(a.dtype)) for a in arrays)
