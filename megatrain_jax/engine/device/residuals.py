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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from megatrain_jax.engine.host.flat import FlatSpec
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


def _layer_fn(cfg: LlamaConfig, window, pos, seg, keys):
  def f(params, x):
    y, stats = llama.block_apply_stats(cfg, params, x, pos, window, seg, keys)
    return (y, None if stats is None else stats.probs), stats
  return f


def forward(cfg: LlamaConfig, spec: FlatSpec, window, recompute: str, flat, x, pos, seg,
            keys=None) -> tuple[jax.Array, Any, list, Layout]:
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
    keys: the layer's LoRA dropout keys or None.

  Returns:
    (its output, its router stats or None, the kept residuals, their `Layout`).
  """
  params, treedef = jax.tree.flatten(spec.unflatten(flat))
  layer = _layer_fn(cfg, window, pos, seg, keys)
  trained = [i for i, t in enumerate(spec.trains) if t]

  def f(tp, x):  # differentiated in the leaves that train only: no frozen weight gradient
    leaves = list(params)
    for i, leaf in zip(trained, tp):
      leaves[i] = leaf
    return layer(treedef.unflatten(leaves), x)
  if policy(recompute) is not None:
    f = jax.checkpoint(f, policy=policy(recompute))
  (y, _), vjp, stats = jax.vjp(f, [params[i] for i in trained], x, has_aux=True)
  leaves, treedef = jax.tree.flatten(vjp)
  where = {id(p): i for i, p in enumerate(params)}
  where[id(x)] = _INPUT
  slots = tuple(where.get(id(leaf)) for leaf in leaves)
  kept = [leaf for leaf, s in zip(leaves, slots) if s is None]
  shapes = tuple((k.shape, jax.numpy.dtype(k.dtype)) for k in kept)
  return y, stats, kept, Layout(treedef, slots, shapes)


def layout(cfg: LlamaConfig, spec: FlatSpec, window, recompute: str, flat, x, pos, seg,
           keys=None) -> Layout:
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
    keys: the layer's LoRA dropout keys or None.

  Returns:
    The layout.
  """
  box = []

  def kept_only(flat, x, pos, seg, keys):
    *_, kept, lay = forward(cfg, spec, window, recompute, flat, x, pos, seg, keys)
    box.append(lay)
    return kept

  S = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)
  jax.eval_shape(kept_only, S(flat), S(x), S(pos), S(seg), S(keys))
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
    (the gradient of its flat parameters that train, `spec.train_size` elements; of
    its input).

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
  g_trained, g_x = jax.tree.unflatten(layout.treedef, leaves)((g, g_probs))
  if not g_trained:  # a layer with nothing that trains
    return jnp.zeros((0,), jnp.float32), g_x
  return jnp.concatenate([a.reshape(-1) for a in g_trained]), g_x
