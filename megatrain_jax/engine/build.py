"""Building a streaming trainer's parts from a config and the model's unit trees."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import nnx

from megatrain_jax.engine.host import malloc
from megatrain_jax.engine.plan import memory, preflight, sizes
from megatrain_jax.engine.config import EngineConfig
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.engine.host.disk_store import DiskStore
from megatrain_jax.engine.host.store import HostStore
from megatrain_jax.engine.host.probe import FAST_PATH, resolve_for_config
from megatrain_jax.engine.runtime import Runtime
from megatrain_jax.engine.plan.schedule import Schedule
from megatrain_jax.engine.device.templates import Templates
from megatrain_jax.engine.device.mesh import MeshTransport, mesh_devices
from megatrain_jax.engine.device.transport import DeviceTransport, Transport
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.policy import PolicyLoss


def host_units(cfg: LlamaConfig, key: jax.Array) -> Iterator[Any]:
  """Every unit's initial parameters, built one at a time on the host CPU backend.

  With the same key they equal `Llama(cfg, rngs=nnx.Rngs(params=key))`'s.

  Args:
    cfg: the model.
    key: the PRNG key.

  Yields:
    The unit trees: embed, each block, head.
  """
  host = jax.local_devices(backend="cpu")[0]
  base = nnx.Rngs(params=key).params()  # the base key `Llama.__init__` draws
  init_block = jax.jit(lambda k, moe: llama.init_block(cfg, k, moe), static_argnums=1,
                       device=host)
  with jax.default_device(host):
    yield jax.jit(lambda k: llama.init_embed(cfg, k))(llama.unit_key(base, "embed"))
    for i in range(cfg.n_layers):
      yield init_block(llama.unit_key(base, "block", i), cfg.layer_is_moe(i))
    yield jax.jit(lambda k: llama.init_head(cfg, k))(llama.unit_key(base, "head"))


def build(cfg: LlamaConfig, optimizer: optax.GradientTransformation, ec: EngineConfig,
          unit_trees: Iterable[Any], grad_hook: Callable | None = None,
          masks: list[Any] | None = None, policy: PolicyLoss | None = None
          ) -> tuple[Schedule, Templates, Runtime]:
  """The schedule, templates and running runtime of a streaming trainer.

  The unit trees are flattened into the host store one at a time (each becomes
  the unit's fp32 master, and its frozen elements' copy), so the whole model never
  exists twice.

  Args:
    cfg: the model.
    optimizer: any Optax transform.
    ec: the engine config.
    unit_trees: embed, each block, head (numpy or host arrays), consumed lazily.
    grad_hook: see `GradientPipeline`.
    masks: per unit, a tree of bools: which leaves train (None: all of them;
      `models.trainable.unit_masks`).
    policy: a policy-gradient loss (`models.policy`), or None for cross-entropy.

  Returns:
    (schedule, templates, runtime).

  Raises:
    ValueError: the parameters in flight alone exceed the device budget, the
      transform cannot run as `optimizer_mode` asks, the wrong number of units, or
      a load-balancing loss with grad_accum > 1.
  """
  if ec.grad_accum > 1 and cfg.router_aux_loss_coef and cfg.n_experts:
    raise ValueError(
        f"router_aux_loss_coef={cfg.router_aux_loss_coef} with grad_accum={ec.grad_accum}: "
        "the load-balancing loss counts every token of the batch in every MoE layer, "
        "which a micro-batch's backward cannot know before the later micro-batches "
        "have run. Use grad_accum=1 (a smaller batch, or more memory), or "
        "router_aux_loss_coef=0.")
  if ec.return_freed_memory:
    malloc.return_freed_memory()
  schedule = Schedule.build(cfg, ec)
  transport = _transport(ec)
  trains = None if masks is None else tuple(tuple(jax.tree.leaves(m)) for m in masks)
  resolution = resolve_for_config(optimizer, cfg, ec.optimizer_mode, trains)
  if resolution.mode == "whole_tree" and ec.optimizer_mode == "auto":
    logging.info("optimizer_mode auto: whole_tree, because %s. Each step's update then "
                 "waits for the whole backward. %s", resolution.reason, FAST_PATH)
  static = memory.static_device_bytes(cfg, ec)
  if ec.device_budget_bytes is not None and static > ec.device_budget_bytes:
    raise preflight.device_budget_error("Holding the parameters in flight alone", {"total": static},
                                     ec.device_budget_bytes, unit=2**20)
  frozen_dtype, kinds = jnp.dtype(ec.frozen_dtype_name), {}

  def spec_of(u, tree):  # blocks of one structure share one spec
    spec = FlatSpec(tree, None if masks is None else masks[u])
    return kinds.setdefault(spec, spec) if 1 <= u <= cfg.n_layers else spec

  if ec.state_tier == "disk":
    # Each unit goes to its file as it comes, so the layouts come from the config.
    specs = [spec_of(u, t) for u, t in enumerate(abstract_units(cfg))]
    masters = _flat_masters(unit_trees, specs, spec_of, frozen_dtype)
  else:
    specs, masters = [], []
    for u, tree in enumerate(unit_trees):
      specs.append(spec_of(u, tree))
      # Frozen leaves go straight to the frozen dtype: no fp32 copy of a frozen base.
      masters.append(specs[-1].split_np(tree, frozen_dtype))
      del tree
    _check_count(len(specs), cfg.n_layers)
  # The disk tier's "auto": in RAM where they fit it (the launcher decides it first,
  # knowing the batch; here, without it).
  on_disk = preflight.resolve_stream_copy(cfg, optimizer, ec).stream_copy == "disk"
  keep = on_disk or sizes.keeps_stream_copy(ec, on_cpu=transport.device.platform == "cpu")
  updater = resolution.make(transport.host_device, ec.host_threads, ec.host_chunk)
  if ec.state_tier == "disk":
    store = DiskStore(updater, specs, masters, transport.host_device, ec.frozen_dtype_name,
                      ec.state_dir, depth=ec.state_in_flight,
                      piece=sizes.piece_elements(ec),
                      copy_dtype=ec.compute_dtype, copy_files=on_disk)
  else:
    store = HostStore(updater, specs, masters, transport.host_device, ec.frozen_dtype_name)
  host_opt = HostOptimizer(store, updater, jnp.dtype(ec.compute_dtype),
                           transport.stream_sharding())
  n, frozen = sum(s.size for s in specs), sum(s.frozen_size for s in specs)
  logging.info("StreamingTrainer: %d units, %.1fM parameters%s, optimizer %s%s, compute %s, "
               "streaming copies %s%s.", len(specs), n / 1e6,
               f" ({frozen / 1e6:.1f}M frozen, in {ec.frozen_dtype_name})" if frozen else "",
               updater.mode, updater.describe(), ec.dtype_name,
               "on disk" if on_disk else "kept" if keep else "made at each fetch",
               f", state on disk in {ec.state_dir} ({store.disk_bytes() / 2**30:.2f} GiB)"
               if ec.state_tier == "disk" else "")
  templates = Templates(cfg, specs[0], specs[1:-1], specs[-1],
                        ec.compute_dtype, ec.loss_chunk_tokens, ec.recompute, policy)
  return schedule, templates, Runtime(ec, schedule, host_opt, transport, keep, grad_hook)


def abstract_units(cfg: LlamaConfig) -> list[Any]:
  """Every unit's parameter tree as shapes and dtypes (nothing allocated).

  Args:
    cfg: the model.

  Returns:
    The trees: embed, each block, head.
  """
  key = jax.random.key(0)
  return [jax.eval_shape(lambda k: llama.init_embed(cfg, k), key),
          *[jax.eval_shape(lambda k, m=cfg.layer_is_moe(i): llama.init_block(cfg, k, m), key)
            for i in range(cfg.n_layers)],
          jax.eval_shape(lambda k: llama.init_head(cfg, k), key)]


def _flat_masters(unit_trees: Iterable[Any], specs: list[FlatSpec], spec_of: Callable,
                  frozen_dtype) -> Iterator[Any]:
  """Each unit's flat master as its tree comes (`FlatSpec.split_np`), checked against
  the layout the config gives it."""
  n = 0
  for u, tree in enumerate(unit_trees):
    if u >= len(specs):
      _check_count(u + 1, len(specs) - 2)
    if spec_of(u, tree) != specs[u]:
      raise ValueError(f"Unit {u}'s parameters do not have the layout the model config "
                       "gives it: the units must be the config's (embed, each block, "
                       "head), with its shapes.")
    yield specs[u].split_np(tree, frozen_dtype)
    n = u + 1
    del tree
  _check_count(n, len(specs) - 2)


def _check_count(n: int, layers: int) -> None:
  """Refuses a number of unit trees that is not the model's."""
  if n != layers + 2:
    raise ValueError(f"Expected {layers + 2} units (embed, {layers} blocks, head), got "
                     f"{'more' if n > layers + 2 else n}.")


def _transport(ec: EngineConfig) -> Transport:
  """The config's transport: its own, or one device's, or a mesh of
  `data_parallel` devices; a given transport must span that many devices.

  Args:
    ec: the engine config.

  Returns:
    The transport.

  Raises:
    ValueError: fewer local devices than `data_parallel`, or a given transport
      over another number of devices.
  """
  devices = mesh_devices(ec.data_parallel)
  n = len(devices)
  if ec.transport is None:
    return MeshTransport(devices) if n > 1 else DeviceTransport()
  spans = getattr(getattr(ec.transport, "base", ec.transport), "n_devices", 1)
  if spans != n:
    raise ValueError(f"EngineConfig.data_parallel={ec.data_parallel} ({n} device(s) in the "
                     f"run) but its transport spans {spans}: give a MeshTransport over "
                     f"{n} devices "
                     "(or SimulatedLink(gb_per_s, base=MeshTransport(...))), or set "
                     "data_parallel to match.")
  return ec.transport
