"""The per-unit jitted functions ("templates") a streaming step calls.

Each distinct unit structure has one stateless template: the unit's flat
compute-dtype parameters and the activations are arguments, nothing is baked in,
so one compiled block serves every layer of a structure however deep the model.
A layer's structure is what changes its compiled code: its parameter layout (dense
or mixture-of-experts) and its attention window (`LlamaConfig.layer_window`), so a
stack that mixes sliding and full attention, or dense and MoE layers, has one block
template per kind. `compiles` counts traces (one per structure and signature).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from megatrain_jax.engine.device import residuals
from megatrain_jax.engine.device.head import head_functions, sum_squares
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.lora import layer_keys, strip_adapters
from megatrain_jax.models.policy import POLICY_KEYS, PolicyLoss


# The largest of byte counts, leaving out the unknown ones (None if none is known).
_largest = lambda values: max((v for v in values if v is not None), default=None)


class Templates:
  """The jitted templates of one model: embed, block and head, forward and backward.

  Attributes (each a jitted function; flat arguments are compute-dtype units):
    embed_fwd(flat_e, ids) -> x; head_loss(flat_h, flat_e | None, x, labels, mask,
      rows) -> (loss_sum, metric_sums) and head_logprobs(flat_h, flat_e | None, x,
      labels) -> [B, T]: forward only (`engine.device.head`; `rows`: a policy loss's
      per-token inputs, {} for cross-entropy).
    block_fwd(flat_b, x, layer) -> (x, stats): `layer` picks the layer's structure
      (a method over one jitted function per structure); `stats` is an MoE layer's
      `moe.RouterStats`, None for a dense one.
    block_bwd(flat_b, x, g, layer, g_probs) -> (g_x, g_flat, finite): the layer's
      forward is recomputed inside; `g_probs` is the gradient of an MoE layer's router
      probability sum (the load-balancing loss's; None for a dense layer);
      `finite` is g_flat's `sum_squares` (finite when g_flat is); so in the others.
    block_fwd_keep(flat_b, x, layer, reuse=None) -> (x, stats, kept) and
    block_bwd_kept(flat_b, x, kept, g, layer, g_probs) -> (g_x, g_flat, finite):
      the same with `recompute` "dots" or "none": the forward returns the residuals
      its backward needs (`engine.residuals`), and the backward runs no forward;
      `reuse` (donated) gives the forward buffers to write its output and residuals
      into (`pool.BufferPool`).
    head(flat_h, flat_e | None, x, labels, mask, scale, rows) -> (loss_sum, g_x, g_h,
      g_e, finite, metric_sums): final norm, LM head and the chunked loss, value and
      gradient; the vjp is seeded with `scale` (1 / the step's normalizer); g_e: the
      tied embedding's gradient from the head (None when untied).
    tail(flat_b, flat_h, flat_e | None, x, labels, mask, scale, rows) -> (loss_sum,
      g_x, g_h, g_e, finite_h, g_flat, finite, metric_sums): the last layer and the
      head in one vjp (`EngineConfig.last_layer_in_head`), so that layer's forward
      runs once.
    embed_bwd(ids, g_x, g_e_head) -> (g_flat_fp32, finite): the embedding's
      scatter-add, in fp32, plus the head's part when tied.
  """

  def __init__(self, cfg: LlamaConfig, embed: FlatSpec, blocks: list[FlatSpec],
               head: FlatSpec, compute_dtype: Any, loss_chunk_tokens: int | None = None,
               recompute: str = "full", policy: PolicyLoss | None = None,
               base_only: bool = False):
    """Builds (does not yet compile) the templates.

    Args:
      cfg: the model.
      embed: the embedding's flat layout.
      blocks: each block's flat layout (blocks of one structure may share one).
      head: the head's flat layout.
      compute_dtype: the dtype units and activations compute in.
      loss_chunk_tokens: tokens per chunk of logits (None: the loss's default).
      recompute: what a layer's backward recomputes (`EngineConfig.recompute`).
      policy: a policy-gradient loss (`models.policy`), or None for cross-entropy.
      base_only: leave LoRA adapters out of the forward (`without_adapters`).
    """
    self._counts, self._scratch, self._kept_shapes = {}, {}, {}  # by name, shape, key
    self._args = (embed, blocks, head, compute_dtype, loss_chunk_tokens, recompute, policy)
    self._last_shape: tuple | None = None  # (x's shape, dtype, packed) of the last block
    self._specs = (embed, head)
    self.cfg = cfg
    self.recompute = recompute
    self.policy = policy
    # An MoE layer's router gradient when no load-balancing loss is trained.
    self._no_g_probs = jnp.zeros((cfg.n_experts,), jnp.float32) if cfg.n_experts else None
    cd, tied = jnp.dtype(compute_dtype), cfg.tie_embeddings

    def embed_fwd(flat, ids):
      return llama.embed_apply(embed.unflatten(flat), ids, cd)

    # Each layer's structure: (its flat layout, its window), static in the templates.
    self._kinds = tuple((blocks[i], cfg.layer_window(i)) for i in range(cfg.n_layers))

    def block_fwd(flat, x, pos, seg, keys, spec, window):
      p = strip_adapters(spec.unflatten(flat)) if base_only else spec.unflatten(flat)
      return llama.block_apply_stats(cfg, p, x, pos, window, seg, keys)

    def block_bwd(flat, x, g, g_probs, pos, seg, keys, spec, window):
      def f(ft, x):  # differentiated in the elements that train only
        p = spec.unflatten_split(ft, flat[spec.train_size:])
        y, stats = llama.block_apply_stats(cfg, p, x, pos, window, seg, keys)
        return y, None if stats is None else stats.probs
      _, vjp = jax.vjp(f, flat[:spec.train_size], x)
      g_flat, g_x = vjp((g, g_probs))
      return g_x, g_flat, sum_squares(g_flat)

    def block_fwd_keep(flat, x, pos, seg, keys, reuse, spec, window):
      del reuse  # donated: XLA writes the outputs of its shapes into it
      return residuals.forward(cfg, spec, window, recompute, flat, x, pos, seg, keys)[:3]

    def block_bwd_kept(flat, x, kept, g, g_probs, pos, seg, keys, spec, window):
      layout = residuals.layout(cfg, spec, window, recompute, flat, x, pos, seg, keys)
      g_flat, g_x = residuals.backward(spec, layout, flat, x, kept, g, g_probs)
      return g_x, g_flat, sum_squares(g_flat)

    hf = head_functions(cfg, embed, head, loss_chunk_tokens, policy)

    def embed_bwd(ids, g_x, g_e_head):
      v, d = cfg.vocab_size, cfg.d_model
      table = jnp.zeros((v, d), jnp.float32).at[ids.reshape(-1)].add(
          g_x.reshape(-1, d).astype(jnp.float32))
      g = table.reshape(-1)
      if tied:
        g = g + g_e_head.astype(jnp.float32)
      return g, sum_squares(g)

    self.embed_fwd = jax.jit(self._counted("embed_fwd", embed_fwd))
    self._block_fwd = jax.jit(self._counted("block_fwd", block_fwd), static_argnums=(5, 6))
    self._block_bwd = jax.jit(self._counted("block_bwd", block_bwd), static_argnums=(7, 8))
    # keep_unused: an argument that is not read is otherwise dropped, its donation too.
    self._block_fwd_keep = jax.jit(self._counted("block_fwd_keep", block_fwd_keep),
                                   static_argnums=(6, 7), donate_argnums=(5,),
                                   keep_unused=True)
    self._block_bwd_kept = jax.jit(self._counted("block_bwd_kept", block_bwd_kept),
                                   static_argnums=(8, 9))
    self.head = jax.jit(self._counted("head_fwd_bwd", hf.fwd_bwd))
    self.head_loss = jax.jit(self._counted("head_loss", hf.loss))
    self.head_logprobs = jax.jit(self._counted("head_logprobs", hf.logprobs))
    self._tail = jax.jit(self._counted("tail_fwd_bwd", hf.tail), static_argnums=(11, 12))
    self.embed_bwd = jax.jit(self._counted("embed_bwd", embed_bwd))

  def without_adapters(self) -> "Templates":
    """Templates over the same units that leave LoRA adapters out: the frozen base's
    forward (a policy's reference), with no second copy of the weights.

    Returns:
      New templates (compiled on first use).
    """
    return Templates(self.cfg.replace(lora=None), *self._args, base_only=True)

  def block_fwd(self, flat: jax.Array, x: jax.Array, layer: int, positions=None,
                segment_ids=None, dropout_keys=None) -> tuple[jax.Array, Any]:
    """Layer `layer`'s forward.

    Args:
      flat: the layer's flat compute-dtype parameters.
      x: its input.
      layer: its index (0-based), which picks its structure's template.
      positions: the batch's int [B, T] positions (None: 0..T-1).
      segment_ids: the batch's int [B, T] segment ids (None: one per row).
      dropout_keys: LoRA dropout's per-sequence keys (None: no dropout).

    Returns:
      (its output, its `moe.RouterStats` or None for a dense layer).
    """
    self._last_shape = (x.shape, x.dtype, positions is not None, segment_ids is not None)
    return self._block_fwd(flat, x, positions, segment_ids, layer_keys(dropout_keys, layer),
                           *self._kinds[layer])

  def block_fwd_keep(self, flat: jax.Array, x: jax.Array, layer: int, positions=None,
                     segment_ids=None, dropout_keys=None, reuse: tuple | None = None
                     ) -> tuple[jax.Array, Any, list]:
    """Layer `layer`'s forward, keeping what its backward needs (recompute "dots"
    or "none").

    Args:
      flat: the layer's flat compute-dtype parameters.
      x: its input.
      layer: its index (0-based).
      positions: as `block_fwd`.
      segment_ids: as `block_fwd`.
      dropout_keys: as `block_fwd`.
      reuse: None, or arrays of the shapes `kept_shapes` gives, which are donated
        (deleted): the output and the residuals are written into them.

    Returns:
      (its output, its `moe.RouterStats` or None, the kept residuals: a list of
      device arrays, no parameter among them).
    """
    self._last_shape = (x.shape, x.dtype, positions is not None, segment_ids is not None)
    return self._block_fwd_keep(flat, x, positions, segment_ids,
                                layer_keys(dropout_keys, layer), reuse, *self._kinds[layer])

  def kept_shapes(self, flat: jax.Array, x: jax.Array, layer: int, **extra
                  ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes `block_fwd_keep` gives back for these arguments: its output's,
    then each kept residual's (no computation; cached per layer structure and shape).

    Args:
      flat: as `block_fwd_keep`.
      x: as `block_fwd_keep`.
      layer: as `block_fwd_keep`.
      **extra: positions, segment_ids and dropout_keys, as `block_fwd_keep`.

    Returns:
      The shapes and dtypes, in the order `reuse` takes them.
    """
    S = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)
    key = (self._kinds[layer], S(flat), S(x), *(S(extra.get(k)) for k in (
        "positions", "segment_ids", "dropout_keys")))  # folded with the layer: one shape
    if key not in self._kept_shapes:
      spec, window = self._kinds[layer]
      lay = residuals.layout(self.cfg, spec, window, self.recompute, *key[1:])
      self._kept_shapes[key] = (key[2], *(jax.ShapeDtypeStruct(s, d) for s, d in lay.kept))
    return self._kept_shapes[key]

  def block_bwd_kept(self, flat: jax.Array, x: jax.Array, kept: list, g: jax.Array,
                     layer: int, g_probs: jax.Array | None = None, positions=None,
                     segment_ids=None, dropout_keys=None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Layer `layer`'s backward from what `block_fwd_keep` kept: no forward runs.

    Args:
      flat: the layer's flat compute-dtype parameters.
      x: its input.
      kept: the residuals its `block_fwd_keep` returned.
      g: the gradient of its output.
      layer: its index (0-based).
      g_probs: as `block_bwd`.
      positions: as `block_fwd`.
      segment_ids: as `block_fwd`.
      dropout_keys: as `block_fwd`.

    Returns:
      As `block_bwd`.
    """
    return self._block_bwd_kept(flat, x, kept, g, self._g_probs(layer, g_probs),
                                positions, segment_ids, layer_keys(dropout_keys, layer),
                                *self._kinds[layer])

  def _g_probs(self, layer: int, g_probs):
    if not self.cfg.layer_is_moe(layer):
      return None
    return self._no_g_probs if g_probs is None else g_probs

  def block_bwd(self, flat: jax.Array, x: jax.Array, g: jax.Array, layer: int,
                g_probs: jax.Array | None = None, positions=None, segment_ids=None,
                dropout_keys=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Layer `layer`'s backward (its forward recomputed inside).

    Args:
      flat: the layer's flat compute-dtype parameters.
      x: its input.
      g: the gradient of its output.
      layer: its index (0-based).
      g_probs: the router-probability gradient of the load-balancing loss (fp32 [E];
        None: zeros); ignored by a dense layer.
      positions: as `block_fwd`.
      segment_ids: as `block_fwd`.
      dropout_keys: as `block_fwd` (its forward's masks).

    Returns:
      (the gradient of its input, of its flat parameters, the latter's
      `sum_squares`).
    """
    return self._block_bwd(flat, x, g, self._g_probs(layer, g_probs), positions,
                           segment_ids, layer_keys(dropout_keys, layer), *self._kinds[layer])

  def tail(self, flat: jax.Array, flat_h: jax.Array, flat_e: jax.Array | None,
           x: jax.Array, labels: jax.Array, mask: jax.Array, scale: jax.Array,
           rows=None, positions=None, segment_ids=None, dropout_keys=None) -> tuple:
    """The last layer (dense) and the head, forward and backward, in one call.

    Args:
      flat: the last layer's flat compute-dtype parameters.
      flat_h: the head's.
      flat_e: the tied embedding's (None when untied).
      x: the last layer's input.
      labels: as `head`.
      mask: as `head`.
      scale: as `head`.
      rows: as `head` (None: {}).
      positions: as `block_fwd`.
      segment_ids: as `block_fwd`.
      dropout_keys: as `block_fwd`.

    Returns:
      (loss_sum, g_x, g_h, g_e, finite_h, g_flat, finite, metric_sums): as `head`,
      with g_x the gradient of the last layer's input, then that layer's as
      `block_bwd`'s.
    """
    layer = self.cfg.n_layers - 1
    self._last_shape = (x.shape, x.dtype, positions is not None, segment_ids is not None)
    return self._tail(flat, flat_h, flat_e, x, labels, mask, scale, rows or {}, positions,
                      segment_ids, layer_keys(dropout_keys, layer), *self._kinds[layer])

  def measure_scratch(self) -> dict[str, int]:
    """XLA's scratch inside each template for the last batch shape a block ran on:
    `memory_analysis().temp_size_in_bytes` of each compiled call, what the ledger
    does not see. Each template is compiled once more per shape (seconds), so this
    runs only when asked; `stats` reports the last result.

    Returns:
      {template: bytes}, the largest over the layer structures (None where XLA
      does not say); {} before a step.
    """
    if self._last_shape is None:
      return {}
    if self._last_shape not in self._scratch:
      self._scratch[self._last_shape] = self._scratch_of(*self._last_shape)
    return self._scratch[self._last_shape]

  def stats(self, device_peak_bytes: int) -> dict[str, Any]:
    """The compile counts, and the scratch `measure_scratch` measured last.

    Args:
      device_peak_bytes: the ledger's peak, to which the largest scratch is added.

    Returns:
      {"compiles", "template_scratch_bytes" ({} until measured for the last batch
      shape), "device_peak_with_scratch_bytes" (None until then)}.
    """
    scratch = self._scratch.get(self._last_shape, {})
    largest = _largest(scratch.values())
    return {"compiles": self.compiles, "template_scratch_bytes": scratch,
            "device_peak_with_scratch_bytes":
                None if largest is None else device_peak_bytes + largest}

  def _scratch_of(self, shape, dtype, packed_pos: bool, packed_seg: bool) -> dict[str, int]:
    S = jax.ShapeDtypeStruct
    b, t, _ = shape
    x, ids = S(shape, dtype), S((b, t), jnp.int32)
    pos, seg = (ids if packed_pos else None), (ids if packed_seg else None)
    embed, head = self._specs
    temp = lambda fn, *args: getattr(fn.lower(*args).compile().memory_analysis(),
                                     "temp_size_in_bytes", None)
    flat_e, f32 = S((embed.size,), dtype), S((b, t), jnp.float32)
    tied_e = flat_e if self.cfg.tie_embeddings else None
    rows = {k: f32 for k in (POLICY_KEYS if self.policy else ())}
    loss_args = (tied_e, x, ids, f32, S((), jnp.float32), rows)
    out = {"embed_fwd": temp(self.embed_fwd, flat_e, ids),
           "embed_bwd": temp(self.embed_bwd, ids, x, tied_e),
           "head": temp(self.head, S((head.size,), dtype), *loss_args)}
    first = {}  # each structure's first layer: one template per structure
    for layer, kind in enumerate(self._kinds):
      first.setdefault(kind, layer)
    fwd, bwd = [], []
    for (spec, window), layer in first.items():
      flat = S((spec.size,), dtype)
      g_probs = (S((self.cfg.n_experts,), jnp.float32) if self.cfg.layer_is_moe(layer)
                 else None)
      if self.recompute == "full":
        fwd.append(temp(self._block_fwd, flat, x, pos, seg, None, spec, window))
        bwd.append(temp(self._block_bwd, flat, x, x, g_probs, pos, seg, None, spec, window))
        continue
      keep = self._block_fwd_keep.lower(flat, x, pos, seg, None, None, spec, window)
      fwd.append(getattr(keep.compile().memory_analysis(), "temp_size_in_bytes", None))
      kept = keep.out_info[2]
      bwd.append(temp(self._block_bwd_kept, flat, x, kept, x, g_probs, pos, seg, None,
                      spec, window))
    out["block_fwd"], out["block_bwd"] = _largest(fwd), _largest(bwd)
    last = self.cfg.n_layers - 1
    if self.recompute == "full" and last >= 0 and not self.cfg.layer_is_moe(last):
      spec, window = self._kinds[last]  # the fused tail's, where the schedule has one
      out["tail"] = temp(self._tail, S((spec.size,), dtype), S((head.size,), dtype),
                         *loss_args, pos, seg, None, spec, window)
    return out

  def _counted(self, name: str, fn):
    def traced(*args):
      self._counts[name] = self._counts.get(name, 0) + 1
      return fn(*args)
    return traced

  @property
  def compiles(self) -> dict[str, int]:
    """Traces of each template so far (one per distinct argument signature)."""
    return dict(self._counts)
