"""Where generation's weights and KV caches live, and the calls that run the model.

`source` says where a model's or trainer's weights come from (host unit trees, or the
`StreamingTrainer`'s own fetch, which makes no host copy of the model);
`ResidentRunner` keeps the weights and caches on the device and runs one jitted call
per step; `StreamedRunner` moves each layer to the device for every step (or once,
beside caches kept in host memory). `megatrain_jax.generation` drives them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine import StreamingTrainer
from megatrain_jax.engine.platform import accelerator_bytes
from megatrain_jax.models import decode, llama
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.resident import ResidentTrainer

Params = dict[str, Any]


class Source(NamedTuple):
  """Where the weights come from: the model, its compute dtype, and either its fp32
  host unit trees or a fetch of each unit's compute-dtype copy onto the device."""

  cfg: LlamaConfig
  compute_dtype: Any
  host_units: Callable[[], Iterable[Params]] | None  # fp32 unit trees, one at a time
  fetch: Callable[[int, Any], Params] | None  # (unit, dtype) -> its tree on the device
  streams: bool  # streamed by default
  budget: int | None  # device bytes generation may use (None: unknown)


# A unit's flat device copy as its tree in a dtype (compiled once per layout).
_unflatten = jax.jit(lambda flat, spec, dtype: jax.tree.map(
    lambda a: a.astype(dtype), spec.unflatten(flat)), static_argnums=(1, 2))


def engine_fetch(trainer: StreamingTrainer) -> Callable[[int, Any], Params]:
  """Fetches a unit as the trainer's own steps do (its streaming copy, or its master
  cast on the way): no copy of the model is made on the host.

  Args:
    trainer: the trainer (its last step's updates are waited for).

  Returns:
    `fetch(unit, dtype)`: the unit's tree on the device.
  """
  trainer.wait()  # the last step's updates are in the copies
  store, specs = trainer.runtime.store, trainer.host_optimizer.store.specs
  return lambda u, dtype: _unflatten(store.to_device(u), specs[u], jnp.dtype(dtype))


def source(model_or_trainer) -> Source:
  """Where a model's or a trainer's weights come from.

  Args:
    model_or_trainer: an `mt.Llama`, a `ResidentTrainer` or a `StreamingTrainer`.

  Returns:
    The `Source`.

  Raises:
    TypeError: anything else.
  """
  obj = model_or_trainer
  if isinstance(obj, StreamingTrainer):
    units = range(obj.cfg.n_layers + 2)  # a closed trainer's masters, read one at a time
    host = (lambda: (obj.unit_params(u) for u in units)) if obj.closed else None
    return Source(obj.cfg, obj.config.compute_dtype, host,
                  None if obj.closed else engine_fetch(obj), True,
                  obj.config.device_budget_bytes or accelerator_bytes())
  if isinstance(obj, ResidentTrainer):
    return Source(obj.cfg, obj.compute_dtype, lambda: llama.split_units(obj.params()), None,
                   False, accelerator_bytes())
  if isinstance(obj, llama.Llama):
    return Source(obj.cfg, obj.compute_dtype, lambda: llama.split_units(obj.param_tree()),
                   None, False, accelerator_bytes())
  raise TypeError(f"generate needs an mt.Llama, a ResidentTrainer or a StreamingTrainer, "
                  f"got {type(obj).__name__}.")


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def _resident_call(cfg, params, ids_BxS, positions_BxS, caches, lengths_B, index_B):
  x, caches = decode.model_decode(cfg, params, ids_BxS, positions_BxS, caches, lengths_B,
                                  params["embed"]["embedding"].dtype)
  return decode.last_logits(cfg, params["head"], params["embed"], x, index_B), caches


# One decoder block: compiled once per layer structure (its tree, window and shapes).
_layer_call = jax.jit(decode.block_decode, static_argnums=(0, 6), donate_argnums=(4,))
_head_call = jax.jit(decode.last_logits, static_argnums=(0,))


def _nbytes(tree) -> int:
  return sum(a.nbytes for a in jax.tree.leaves(tree))


def device_units(src: Source, dtype) -> Iterable[Params]:
  """Every unit's compute-dtype tree on the device, one at a time.

  Args:
    src: the weights' source.
    dtype: the compute dtype.

  Returns:
    A generator of the trees, embedding first.
  """
  if src.fetch is not None:
    return (src.fetch(u, dtype) for u in range(src.cfg.n_layers + 2))
  return (jax.tree.map(lambda a: jnp.asarray(a).astype(dtype), u) for u in src.host_units())


class ResidentRunner:
  """The compute-dtype weights and the caches on the device; one jitted call."""

  def __init__(self, cfg, units, dtype, batch, capacity):
    self.cfg = cfg
    self.params = llama.assemble_units(list(units))
    self.h2d_bytes = _nbytes(self.params)
    self.caches = [decode.empty_cache(cfg, batch, capacity, dtype)
                   for _ in range(cfg.n_layers)]

  def __call__(self, ids_BxS, positions_BxS, lengths_B, index_B):
    """One model call over new tokens (see `StreamedRunner.__call__`).

    Args:
      ids_BxS: the new tokens.
      positions_BxS: their positions.
      lengths_B: each row's valid slots after the call.
      index_B: which new token's logits each row returns.

    Returns:
      The logits [B, V].
    """
    logits, self.caches = _resident_call(self.cfg, self.params, ids_BxS, positions_BxS,
                                         self.caches, lengths_B, index_B)
    return logits


class StreamedRunner:
  """Each call streams every layer once (or, with `keep_weights`, moves them once and
  keeps them: resident weights beside a cache in host memory). A unit comes from the
  trainer's own fetch, or from host copies of the compute-dtype units, each cast as it
  is read (one fp32 unit at a time). The embedding stays on the host."""

  def __init__(self, cfg, src: Source, dtype, batch, capacity, kv_cache, keep_weights=False):
    self.cfg, self.dtype = cfg, dtype
    self.kept = {} if keep_weights else None
    device = jax.local_devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    sharding = jax.sharding.SingleDeviceSharding
    self.on_device = sharding(device, memory_kind="device" if "device" in kinds else None)
    self.host_units = None if src.host_units is None else [
        jax.tree.map(lambda a: np.asarray(a).astype(dtype), u) for u in src.host_units()]
    self.fetch = src.fetch
    self.embedding = (self.host_units[0]["embedding"] if self.fetch is None
                      else np.asarray(self.fetch(0, dtype)["embedding"]))
    self.on_host = None
    if kv_cache == "host":
      self.on_host = (sharding(device, memory_kind="pinned_host") if "pinned_host" in kinds
                      else sharding(jax.local_devices(backend="cpu")[0]))
    empty = lambda: jax.device_put(decode.empty_cache(cfg, batch, capacity, dtype),
                                   self.on_host or self.on_device)
    self.caches = [empty() for _ in range(cfg.n_layers)]
    self.h2d_bytes = 0

  def _put(self, tree):
    self.h2d_bytes += _nbytes(tree)
    return jax.device_put(tree, self.on_device)

  def _one(self, u: int):
    if self.fetch is None:
      return self._put(self.host_units[u])
    tree = self.fetch(u, self.dtype)
    self.h2d_bytes += _nbytes(tree)
    return tree

  def _unit(self, u: int):
    """Unit u on the device (the head with a tied embedding, for u = L + 1)."""
    if self.kept is not None and u in self.kept:
      return self.kept[u]
    n = self.cfg.n_layers
    out = self._one(u) if u <= n else {
        "head": self._one(n + 1), "embed": self._one(0) if self.cfg.tie_embeddings else None}
    if self.kept is not None:
      self.kept[u] = out
    return out

  def __call__(self, ids_BxS, positions_BxS, lengths_B, index_B):
    """One model call over new tokens: each layer in turn, with its cache.

    Args:
      ids_BxS: the new tokens.
      positions_BxS: their positions (= their cache slots).
      lengths_B: each row's valid slots after the call.
      index_B: which new token's logits each row returns.

    Returns:
      The logits [B, V].
    """
    cfg, n = self.cfg, self.cfg.n_layers
    # The embedding stays on the host: only the new tokens' rows move.
    x = self._put(self.embedding[ids_BxS])
    positions, lengths = jax.device_put((positions_BxS, lengths_B), self.on_device)
    upcoming = self._unit(1)
    for i in range(n):
      p, upcoming = upcoming, self._unit(i + 2)
      cache = self.caches[i]
      if self.on_host is not None:
        cache = jax.device_put(cache, self.on_device)
      x, cache = _layer_call(cfg, p, x, positions, cache, lengths, cfg.layer_window(i))
      del p  # the layer's weights leave the device once its step is done
      self.caches[i] = cache if self.on_host is None else jax.device_put(cache, self.on_host)
    head = upcoming
    return _head_call(cfg, head["head"], head["embed"], x,
                      jax.device_put(index_B, self.on_device))


# -- sampling ------------------------------------------------------------------------
