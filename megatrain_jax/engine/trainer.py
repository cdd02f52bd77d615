"""StreamingTrainer: host-resident state, one unit on the accelerator at a time.

One step, for each micro-batch:
  forward   embed, then every block through its jitted template, keeping the
            block input every `checkpoint_every` layers; the prefetcher moves the
            next units to the device while the current one computes;
  head      final norm + LM head + chunked CE, value and gradient in one call;
  backward  blocks in reverse groups of `checkpoint_every`: recompute the group's
            inputs from its checkpoint, then `jax.vjp` layer by layer (each
            layer's forward is recomputed inside its backward template); a
            group's parameters are fetched once and kept until its backward ends;
  gradients every unit's gradient goes to the gradient thread as soon as it
            exists: device -> host, then the host optimizer (per unit as it
            arrives, or once after the sweep when the transform needs the tree).
So each unit crosses host -> device at most twice per step and its gradient
crosses device -> host once.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from megatrain_jax.batch import check_batch
from megatrain_jax.checkpoint import Snapshot
from megatrain_jax.engine import host_memory, memory
from megatrain_jax.engine.flat import FlatSpec
from megatrain_jax.engine.host_optimizer import CHUNK, MODES, HostOptimizer
from megatrain_jax.engine.transport import DeviceTransport, Transport
from megatrain_jax.engine.workers import GradWorker, Ledger, Prefetcher
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.loss import head_loss_sum

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
NONFINITE = ("raise", "skip")
STREAM_COPIES = ("auto", "keep", "on_fetch")
# Trainers with threads: closed at exit, so the last step's updates finish before
# the interpreter tears JAX down under them.
_OPEN: "weakref.WeakSet[StreamingTrainer]" = weakref.WeakSet()


@atexit.register
def _close_open_trainers() -> None:
  for trainer in list(_OPEN):
    trainer.close()


@dataclasses.dataclass
class _StepGuard:
  """One step's per-unit updates, as the optimizer thread finds them.

  Every gradient job carries its step's guard: a step returns once its backward
  is done, and its last updates run on while the next step starts.
  """
  step: int
  prev: "_StepGuard | None" = None  # the step before (read once, then dropped)
  loss_parts: list = dataclasses.field(default_factory=list)
  loss: float = math.nan
  loss_checked: bool = False
  # ("loss", []), ("grads", [unit]) or ("previous", []): an earlier step went bad.
  bad: tuple[str, list[int]] | None = None
  updated: list[int] = dataclasses.field(default_factory=list)
  first_done: threading.Event = dataclasses.field(default_factory=threading.Event)
  reported: bool = False


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How the streaming engine runs.

  prefetch_depth: units fetched ahead of the one computing (0: fetch on demand,
    after the previous unit's compute is done, i.e. no overlap).
  checkpoint_every: keep a block's input every this many layers; backward
    recomputes a group of this many layers and keeps their parameters on the
    device for the group's backward.
  compute_dtype: jnp.float32 or jnp.bfloat16; masters and optimizer state stay fp32.
  grad_accum: micro-batches per step (the batch size must divide by it).
  stream_embed_head: fetch embedding and head when used (True) or keep their
    compute copies on the device, refreshed after each update (False).
  optimizer_mode: "auto" (probe the transform), "per_unit" or "whole_tree".
  device_budget_bytes: refuse configs whose estimated device bytes exceed this.
  loss_chunk_tokens: tokens per logits chunk (None: fit 256 MiB of fp32 logits).
  transport: how bytes move (default: `DeviceTransport()`).
  timeout_s: longest wait on an engine thread before raising.
  return_freed_memory: set glibc's mmap threshold so freed unit buffers go back
    to the system (process-wide; see `engine/host_memory.py`).
  nonfinite: what a NaN or infinite loss or gradient does. "raise": the step
    raises FloatingPointError (see `step`). "skip": the step is skipped and
    counted in `stats()["skipped_steps"]`; every update then waits for the whole
    sweep, so per-unit updates no longer overlap the backward.
  stream_copy: where the compute-dtype copy a fetch moves comes from. "keep":
    every unit's copy stays in pinned host memory, rewritten after each update,
    and the fetch is one DMA from it (compute-dtype bytes per parameter of host
    memory: 2 for bf16). "on_fetch": each fetch casts the fp32 master (no host
    memory beyond masters and optimizer state; a host-side cast per fetch on an
    accelerator). "auto": "on_fetch" on the CPU backend, where device memory is
    host memory and a kept copy would only duplicate it; "keep" on an accelerator.
  host_threads: threads that run the fused AdamW update (`mt.optim.adamw`), each
    on its own part of every unit (None: one per CPU this process may use).
  host_chunk: elements each of those threads updates at a time; p, g, m and v of
    one chunk (16 bytes per element) should fit in a core's L2 cache.
  """

  prefetch_depth: int = 2
  checkpoint_every: int = 1
  compute_dtype: Any = jnp.float32
  grad_accum: int = 1
  stream_embed_head: bool = True
  optimizer_mode: str = "auto"
  device_budget_bytes: int | None = None
  loss_chunk_tokens: int | None = None
  transport: Transport | None = None
  timeout_s: float = 600.0
  return_freed_memory: bool = True
  nonfinite: str = "raise"
  stream_copy: str = "auto"
  host_threads: int | None = None
  host_chunk: int = CHUNK

  def __post_init__(self):
    if isinstance(self.compute_dtype, str):
      if self.compute_dtype not in DTYPES:
        raise ValueError(f"EngineConfig.compute_dtype={self.compute_dtype!r} is not one "
                         f"of {sorted(DTYPES)}.")
      object.__setattr__(self, "compute_dtype", DTYPES[self.compute_dtype])
    if jnp.dtype(self.compute_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise ValueError(f"EngineConfig.compute_dtype must be float32 or bfloat16, got "
                       f"{self.compute_dtype}.")
    for name, low in (("prefetch_depth", 0), ("checkpoint_every", 1), ("grad_accum", 1),
                      ("host_threads", 1), ("host_chunk", 1)):
      v = getattr(self, name)
      if name == "host_threads" and v is None:
        continue
      if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"EngineConfig.{name} must be an integer >= {low}, got {v!r}.")
    if self.optimizer_mode not in MODES:
      raise ValueError(f"EngineConfig.optimizer_mode={self.optimizer_mode!r} is not one "
                       f"of {MODES}.")
    if self.device_budget_bytes is not None and self.device_budget_bytes <= 0:
      raise ValueError("EngineConfig.device_budget_bytes must be positive or None.")
    if self.nonfinite not in NONFINITE:
      raise ValueError(f"EngineConfig.nonfinite={self.nonfinite!r} is not one of "
                       f"{NONFINITE}.")
    if self.stream_copy not in STREAM_COPIES:
      raise ValueError(f"EngineConfig.stream_copy={self.stream_copy!r} is not one of "
                       f"{STREAM_COPIES}.")


class _Counter:
  """Counts traces of a template (one trace = one compilation per signature)."""

  def __init__(self):
    self.counts: dict[str, int] = {}

  def wrap(self, name, fn):
    def traced(*args):
      self.counts[name] = self.counts.get(name, 0) + 1
      return fn(*args)
    return traced


class StreamingTrainer:
  """Trains a Llama-family model whose parameters and optimizer state live on the host.

  Build it from an NNX model (`StreamingTrainer(model, optimizer, config)`) or,
  for a model bigger than the device, unit by unit on the host
  (`StreamingTrainer.from_config(cfg, optimizer, config, key)`). Use `close()`
  or a `with` block to stop its threads.
  """

  def __init__(self, model: llama.Llama, optimizer: optax.GradientTransformation,
               config: EngineConfig | None = None):
    def units():
      yield model.embed.tree()
      for block in model.blocks:
        yield block.tree()
      yield model.head.tree()
    self._setup(model.cfg, optimizer, config or EngineConfig(), units())

  @classmethod
  def from_config(cls, cfg: LlamaConfig, optimizer: optax.GradientTransformation,
                  config: EngineConfig | None = None, key: jax.Array | None = None
                  ) -> "StreamingTrainer":
    """Initialises every unit on the host CPU backend, one at a time.

    With the same key, the parameters equal `Llama(cfg, rngs=nnx.Rngs(params=key))`.
    """
    if key is None:
      raise ValueError("from_config needs an explicit PRNG key, e.g. jax.random.key(0).")
    host = jax.devices("cpu")[0]
    key = nnx.Rngs(params=key).params()  # the base key `Llama.__init__` draws
    init_block = jax.jit(lambda k: llama.init_block(cfg, k), device=host)

    def units():
      with jax.default_device(host):
        yield jax.jit(lambda k: llama.init_embed(cfg, k))(llama.unit_key(key, "embed"))
        for i in range(cfg.n_layers):
          yield init_block(llama.unit_key(key, "block", i))
        yield jax.jit(lambda k: llama.init_head(cfg, k))(llama.unit_key(key, "head"))

    self = cls.__new__(cls)
    self._setup(cfg, optimizer, config or EngineConfig(), units())
    return self

  @classmethod
  def from_pretrained(cls, local_dir: str, optimizer: optax.GradientTransformation,
                      config: EngineConfig | None = None) -> "StreamingTrainer":
    """Loads a Hugging Face Llama / Qwen2 / Mistral checkpoint directory unit by unit
    into the host store (see `megatrain_jax.hf`); the model is never whole on the device."""
    from megatrain_jax import hf  # pylint: disable=import-outside-toplevel
    cfg, _, _ = hf.read_config(local_dir)
    self = cls.__new__(cls)
    self._setup(cfg, optimizer, config or EngineConfig(), hf.load_units(local_dir, cfg))
    return self

  # --------------------------------------------------------------------------
  # Construction.
  # --------------------------------------------------------------------------

  def _setup(self, cfg: LlamaConfig, optimizer, ec: EngineConfig, unit_trees: Iterable):
    self.cfg, self.config, self.optimizer = cfg, ec, optimizer
    if ec.return_freed_memory:
      host_memory.return_freed_memory()
    self._threads_open = False
    self.transport = ec.transport or DeviceTransport()
    self.cd = jnp.dtype(ec.compute_dtype)
    L = cfg.n_layers
    self.n_units = L + 2
    self.EMBED, self.HEAD = 0, L + 1
    self._invalid: BaseException | None = None

    specs, masters = [], []  # masters: flat fp32 numpy, until the host optimizer has them
    for u, tree in enumerate(unit_trees):
      spec = FlatSpec(tree)
      if specs and u not in (self.HEAD,) and spec == specs[-1]:
        spec = specs[-1]  # blocks share one spec object, hence one template
      specs.append(spec)
      masters.append(spec.flatten_np(tree))
    if len(specs) != self.n_units:
      raise ValueError(f"Expected {self.n_units} units (embed, {L} blocks, head), "
                       f"got {len(specs)}.")
    self.specs = specs
    self._keep_copy = memory.keeps_stream_copy(
        ec, on_cpu=self.transport.device.platform == "cpu")
    self.host_opt = HostOptimizer(
        optimizer, specs, masters, assemble=self._assemble, split=self._split,
        compute_dtype=self.cd, mode=ec.optimizer_mode,
        host_device=self.transport.host_device,
        stream_sharding=self.transport.stream_sharding(), threads=ec.host_threads,
        chunk=ec.host_chunk)
    logging.info("StreamingTrainer: %d units, %.1fM parameters, optimizer %s%s, compute %s, "
                 "streaming copies %s.", self.n_units, sum(s.size for s in specs) / 1e6,
                 self.host_opt.mode,
                 f" (fused AdamW on {self.host_opt.threads} threads)" if self.host_opt.fused
                 else "",
                 self.cd.name, "kept" if self._keep_copy else "made at each fetch")
    # Updates wait for the whole sweep when the transform needs every gradient, or
    # when a non-finite step must be skippable.
    self._defer = self.host_opt.updates_after_sweep or ec.nonfinite == "skip"
    self._guard = _StepGuard(step=0)
    self._guard.first_done.set()
    self._late = self._guard  # the last step returned; its updates may still run
    # The last step whose update of each unit is done (applied or refused): a fetch
    # for step s waits until its unit's entry reaches s - 1.
    self._done = [0] * self.n_units
    self._done_cond = threading.Condition()
    self._acc_ok: list[list[jax.Array]] = [[] for _ in specs]  # optimizer thread
    # The compute-dtype copy of each unit, kept in pinned host memory (None: each
    # fetch casts the master instead).
    self._stream = ([self.transport.stage(self.host_opt.stream_copy(u))
                     for u in range(self.n_units)] if self._keep_copy else None)
    self.unit_bytes = [s.size * self.cd.itemsize for s in specs]
    # Gradients leave in the compute dtype, but the embedding's (a scatter-add) in fp32.
    self.grad_bytes = [s.size * (4 if u == self.EMBED else self.cd.itemsize)
                       for u, s in enumerate(specs)]
    self._tied = cfg.tie_embeddings
    self._slots = memory.prefetch_slots(cfg, ec)
    self._check_static_budget(ec)

    self.ledger = Ledger()
    self._resident: dict[int, jax.Array] = {}
    self._resident_h2d_bytes = 0
    self._counter = _Counter()
    self._build_templates()
    self._stats = {"steps": 0, "skipped_steps": 0, "h2d_bytes": 0, "d2h_bytes": 0,
                   "device_peak_bytes": 0}
    self._last: dict[str, float] = {}
    self.prefetcher = Prefetcher(self._fetch, ec.prefetch_depth, self._slots, self.ledger,
                                 ec.timeout_s, ready=self._updated_for,
                                 hold=memory.held_units(cfg, ec))
    self.grad_worker = GradWorker(self._handle_grad, ec.timeout_s, name="grads")
    # Host-side gradients wait here for the optimizer, two at most.
    self.opt_worker = GradWorker(self._handle_update, ec.timeout_s, name="optimizer")
    self._threads_open = True
    self._next_started = False
    _OPEN.add(self)
    self._budget_ok: set = set()
    self._d2h_bytes = 0
    self._d2h_s = 0.0
    self._opt_s = 0.0
    if not ec.stream_embed_head:
      for u in (self.EMBED, self.HEAD):
        self._refresh_resident(u)

  def _check_static_budget(self, ec: EngineConfig) -> None:
    need = self._slots * max(self.unit_bytes)
    if not ec.stream_embed_head:
      need += self.unit_bytes[self.EMBED] + self.unit_bytes[self.HEAD]
    if ec.device_budget_bytes is not None and need > ec.device_budget_bytes:
      raise ValueError(
          f"The parameters in flight alone need {need / 2**20:.2f} MiB "
          f"({self._slots} buffers of the largest unit, "
          f"{max(self.unit_bytes) / 2**20:.2f} MiB), over the device budget of "
          f"{ec.device_budget_bytes / 2**20:.2f} MiB. Lower prefetch_depth or "
          "checkpoint_every, stream the embedding and head, or raise the budget.")

  def _assemble(self, units):
    units = list(units)
    return {"embed": units[0], "blocks": units[1:-1], "head": units[-1]}

  def _split(self, tree):
    return [tree["embed"], *tree["blocks"], tree["head"]]

  def _build_templates(self):
    cfg, cd, chunk = self.cfg, self.cd, self.config.loss_chunk_tokens
    se, sb, sh = self.specs[self.EMBED], self.specs[1] if self.cfg.n_layers else None, \
        self.specs[self.HEAD]
    tied = self._tied
    wrap = self._counter.wrap

    def embed_fwd(flat, ids):
      return llama.embed_apply(se.unflatten(flat), ids, cd)

    def block_fwd(flat, x):
      return llama.block_apply(cfg, sb.unflatten(flat), x)

    # Each gradient template also says whether its gradient is finite: checked
    # where the gradient is made, the host update needs no check of its own.
    finite = lambda g: jnp.all(jnp.isfinite(g))

    def block_bwd(flat, x, g):
      _, vjp = jax.vjp(lambda f, x: llama.block_apply(cfg, sb.unflatten(f), x), flat, x)
      g_flat, g_x = vjp(g)
      return g_x, g_flat, finite(g_flat)

    def head_fwd_bwd(flat_h, flat_e, x, labels, mask, scale):
      def f(fh, fe, x):
        return head_loss_sum(cfg, sh.unflatten(fh), se.unflatten(fe) if tied else None,
                             x, labels, mask, chunk)
      loss_sum, vjp = jax.vjp(f, flat_h, flat_e, x)
      g_h, g_e, g_x = vjp(scale)
      return loss_sum, g_x, g_h, g_e, finite(g_h)

    def embed_bwd(ids, g_x, g_e_head):
      v, d = cfg.vocab_size, cfg.d_model
      table = jnp.zeros((v, d), jnp.float32).at[ids.reshape(-1)].add(
          g_x.reshape(-1, d).astype(jnp.float32))
      g = table.reshape(-1)
      if tied:
        g = g + g_e_head.astype(jnp.float32)
      return g, finite(g)

    self._embed_fwd = jax.jit(wrap("embed_fwd", embed_fwd))
    self._block_fwd = jax.jit(wrap("block_fwd", block_fwd))
    self._block_bwd = jax.jit(wrap("block_bwd", block_bwd))
    self._head = jax.jit(wrap("head_fwd_bwd", head_fwd_bwd))
    self._embed_bwd = jax.jit(wrap("embed_bwd", embed_bwd))

  # --------------------------------------------------------------------------
  # Transport and gradients (worker threads).
  # --------------------------------------------------------------------------

  def _fetch(self, u: int, step: int) -> jax.Array:
    self._await_update(u, step)
    return self._to_device(u)

  def _to_device(self, u: int) -> jax.Array:
    """Unit u's compute-dtype copy in device memory: from its kept streaming
    copy, or cast from its master."""
    if self._keep_copy:
      return self.transport.h2d(self._stream[u])
    return self.transport.h2d_cast(self.host_opt.parts[u], self.cd)

  def _updated_for(self, u: int, step: int) -> bool:
    """Whether unit u's copy is the one step `step` computes with (every earlier
    step's update of it is done). Raises what stopped an engine thread."""
    if self._done[u] >= step - 1:
      return True
    self.grad_worker.check()
    self.opt_worker.check()
    if not self._threads_open:
      raise RuntimeError("The StreamingTrainer was closed during a fetch.")
    return False

  def _await_update(self, u: int, step: int) -> None:
    """Blocks until unit u's updates from the steps before `step` are done."""
    deadline = time.monotonic() + self.config.timeout_s
    with self._done_cond:
      while not self._updated_for(u, step):
        if time.monotonic() > deadline:
          raise TimeoutError(f"The update of {self.unit_name(u)} took over "
                             f"{self.config.timeout_s:.0f} s.")
        self._done_cond.wait(0.05)

  def _mark_done(self, units, step: int) -> None:
    with self._done_cond:
      for u in units:
        self._done[u] = max(self._done[u], step)
      self._done_cond.notify_all()

  def _refresh_resident(self, u: int) -> None:
    arr = self._to_device(u)
    self._resident[u] = arr
    self.ledger.add(("resident", u), arr.nbytes)
    self._resident_h2d_bytes += arr.nbytes  # optimizer thread; folded in at step end

  def _handle_grad(self, job) -> None:
    """Gradient thread: device -> host, then hand over to the optimizer thread."""
    u, g_dev, ok, last, guard = job
    t0 = time.perf_counter()
    g = self.transport.d2h(g_dev)
    self._d2h_s += time.perf_counter() - t0
    self.ledger.remove(("grad", u))
    self.opt_worker.submit((u, g, ok, last, guard))

  def _handle_update(self, job) -> None:
    """Optimizer thread: update the unit now, or accumulate its gradient (or,
    after a deferred sweep, update every unit)."""
    if job[0] == "update_all":
      self._update_all(job[1])
      return
    u, g, ok, last, guard = job
    t1 = time.perf_counter()
    try:
      if last and not self._defer:
        self._update_now(u, g, [*self._acc_ok[u], ok], guard)
        self._acc_ok[u] = []
      else:
        self.host_opt.accumulate(u, g)
        if not self._defer:  # deferred updates check the accumulated sums instead
          self._acc_ok[u].append(ok)
        self.host_opt.accum[u].block_until_ready()
    finally:
      if last and not self._defer:
        self._mark_done([u], guard.step)
    self._opt_s += time.perf_counter() - t1

  def _update_all(self, step: int) -> None:
    """Optimizer thread, after a deferred sweep whose gradients are all finite:
    every unit's update, each unit's copies refreshed as its update is done."""
    t1 = time.perf_counter()

    def done(u, new):
      self._set_stream(u, new)
      self._mark_done([u], step)

    try:
      self.host_opt.update_all(stream=self._keep_copy, on_unit=done)
    finally:
      self._mark_done(range(self.n_units), step)
      self._opt_s += time.perf_counter() - t1

  def _update_now(self, u: int, g, oks: list[jax.Array], guard: _StepGuard) -> None:
    """A per-unit update during the backward, after the step's loss is known finite.

    The first update of a step waits for the loss (its head is computed before
    any gradient exists, so this costs no device time). A non-finite loss, a
    non-finite gradient (as the gradient templates report it; the unit stays as
    it was), or an earlier step that went bad after some of its updates stops
    every further update of the step; `step` or the next call then raises.
    """
    try:
      if guard.bad is None and not guard.loss_checked:
        guard.loss_checked = True
        prev, guard.prev = guard.prev, None  # final: its jobs ran before this one
        if prev is not None and prev.bad is not None and prev.updated:
          guard.bad = ("previous", [])
        elif not math.isfinite(sum(float(x) for x in guard.loss_parts)):
          guard.bad = ("loss", [])
      if guard.bad is None and not all(bool(ok) for ok in oks):
        guard.bad = ("grads", [u])
      if guard.bad is not None:
        self.host_opt.accum[u] = None
        return
      new = self.host_opt.update_unit(u, g, stream=self._keep_copy)
      guard.updated.append(u)
      # Done before the unit's next fetch is allowed (it reads the result).
      jax.block_until_ready(new if new is not None else self.host_opt.parts[u])
      self._set_stream(u, new)
    finally:
      guard.first_done.set()

  def _wait_workers(self) -> None:
    """Waits for every queued gradient and update; raises what they found."""
    self.grad_worker.wait()
    self.opt_worker.wait()
    self._check_late()

  def wait(self) -> None:
    """Blocks until the last step's updates are done (`step` returns before its
    last units are updated). Raises a failure or non-finite gradient they met."""
    if self._threads_open:
      self._wait_workers()

  def _cancel_prefetch(self) -> None:
    """Drops fetches started for the next step (the host state is about to change
    outside a step, so what they fetched would be stale)."""
    if self._next_started:
      self.prefetcher.cancel()
      self._next_started = False

  def _set_stream(self, u: int, new_flat: jax.Array | None) -> None:
    """After unit u's master changed: keep its new streaming copy (None when
    none is kept) and refresh its resident device copy, if any."""
    if new_flat is not None:
      self._stream[u] = self.transport.stage(new_flat)
    if u in self._resident:
      self._refresh_resident(u)

  def _master_changed(self, u: int) -> None:
    """Unit u's master was set outside an update (restore): remakes its copies."""
    self._set_stream(u, self.host_opt.stream_copy(u) if self._keep_copy else None)

  def _send_grad(self, u: int, g: jax.Array, ok: jax.Array, last: bool) -> None:
    """Queues unit u's gradient (already in the ledger) for the link and the update."""
    self._d2h_bytes += g.nbytes
    self.grad_worker.submit((u, g, ok, last, self._guard))

  def _get(self, u: int):
    """(array, key) of unit u on the device: resident, or the prefetcher's next."""
    if u in self._resident:
      self._await_update(u, self._guard.step)
      return self._resident[u], None
    return self.prefetcher.get(u)

  def _release(self, key, token) -> None:
    if key is not None:
      self.prefetcher.release(key, token)

  # --------------------------------------------------------------------------
  # The step.
  # --------------------------------------------------------------------------

  def _micro_step(self, batch, scale, last: bool):
    """Forward, head and backward of one micro-batch; returns its loss sum."""
    L, ledger, tp = self.cfg.n_layers, self.ledger, self.transport
    ids = tp.to_device(batch["input_ids"])
    labels = tp.to_device(batch["labels"])
    mask = tp.to_device(batch["loss_mask"])
    self._stats["h2d_bytes"] += ids.nbytes + labels.nbytes + mask.nbytes
    schedule = memory.schedule(self.cfg, self.config)
    if not self._next_started:
      self.prefetcher.start(schedule, self._guard.step)
    self._next_started = last
    if last:
      # The next step's fetches, queued behind this step's: each waits for its
      # unit's update, and the ones ready go first, so the link has work while
      # this step's last layers compute and their updates finish.
      self.prefetcher.start(schedule, self._guard.step + 1)

    p, key = self._get(self.EMBED)
    x = self._embed_fwd(p, ids)
    self._release(key, x)
    act_bytes = x.nbytes
    ckpts = {}
    for i in range(L):
      if i % self.config.checkpoint_every == 0:
        ckpts[i] = x
        ledger.add(("ckpt", i), act_bytes)
      p, key = self._get(1 + i)
      x = self._block_fwd(p, x)
      ledger.add("x", act_bytes)
      self._release(key, x)

    p_h, key_h = self._get(self.HEAD)
    p_e, key_e = self._get(self.EMBED) if self._tied else (None, None)
    loss_sum, g, g_h, g_e, ok = self._head(p_h, p_e, x, labels, mask, scale)
    self._release(key_h, g)
    self._release(key_e, g)
    ledger.add("g", act_bytes)
    self._guard.loss_parts.append(loss_sum)  # before any gradient: updates wait for it
    ledger.add(("grad", self.HEAD), g_h.nbytes)
    self._send_grad(self.HEAD, g_h, ok, last)

    for s, e in reversed(memory.checkpoint_groups(self.cfg, self.config)):
      params = [self._get(1 + i) for i in range(s, e)]
      xs = [ckpts.pop(s)]
      for j, i in enumerate(range(s, e - 1)):
        xs.append(self._block_fwd(params[j][0], xs[-1]))
        ledger.add(("recompute", j), act_bytes)
      for j in reversed(range(e - s)):
        g, g_p, ok = self._block_bwd(params[j][0], xs[j], g)
        self._release(params[j][1], g)
        ledger.add(("grad", 1 + s + j), g_p.nbytes)
        if s + j:
          self._send_grad(1 + s + j, g_p, ok, last)
        else:
          first_layer = (g_p, ok)
        ledger.remove(("recompute", j))
      ledger.remove(("ckpt", s))
    g_e_embed, ok = self._embed_bwd(ids, g, g_e)
    ledger.remove("x")
    ledger.remove("g")
    # The embedding's gradient leaves before layer 0's: the next forward needs it first.
    ledger.add(("grad", self.EMBED), g_e_embed.nbytes)
    self._send_grad(self.EMBED, g_e_embed, ok, last)
    if L:
      self._send_grad(1, *first_layer, last)
    return loss_sum

  def estimate_device_bytes(self, batch_size: int, seq_len: int) -> dict[str, int]:
    """Device bytes the engine will hold for batches of this shape, by kind
    (see `engine.memory.device_bytes`; XLA's scratch inside a template is not counted)."""
    return memory.device_bytes(self.cfg, self.config, batch_size, seq_len)

  def _check_budget(self, batch_size: int, seq_len: int) -> None:
    budget = self.config.device_budget_bytes
    if budget is None or (batch_size, seq_len) in self._budget_ok:
      return
    est = self.estimate_device_bytes(batch_size, seq_len)
    if est["total"] > budget:
      parts = ", ".join(f"{k}={v / 2**20:.2f} MiB" for k, v in est.items() if k != "total")
      raise ValueError(
          f"A step on batch [{batch_size}, {seq_len}] needs about "
          f"{est['total'] / 2**20:.2f} MiB of device memory ({parts}), over the device "
          f"budget of {budget / 2**20:.2f} MiB. Lower prefetch_depth, checkpoint_every "
          "or the batch (or raise grad_accum), or raise device_budget_bytes.")
    self._budget_ok.add((batch_size, seq_len))

  def _prepare(self, batch):
    if self._invalid is not None:
      raise RuntimeError(
          "This StreamingTrainer is invalid after an earlier failure "
          f"({type(self._invalid).__name__}: {self._invalid}); its host state may be "
          "half-updated. Build a new trainer or resume from the last checkpoint.")
    if not self._threads_open:
      raise RuntimeError("This StreamingTrainer is closed.")
    batch = check_batch(self.cfg, batch)
    n = self.config.grad_accum
    b, t = batch["input_ids"].shape
    if b % n:
      raise ValueError(f"Batch size {b} is not divisible by grad_accum={n}.")
    total = float(batch["loss_mask"].sum())
    if total <= 0:
      raise ValueError("The batch's loss_mask is all zero: no token to train on.")
    self._check_budget(b, t)
    return batch, total

  def _sweep(self, batch, total: float, update: bool) -> float:
    """Every micro-batch's forward and backward; gradients go to the worker."""
    self.grad_worker.check()  # a failure after the last step returned
    self.opt_worker.check()
    self._check_late()
    n = self.config.grad_accum
    b = batch["input_ids"].shape[0]
    scale = jnp.float32(1.0 / total)
    sums = []
    for m in range(n):
      micro = {k: v[m * b // n:(m + 1) * b // n] for k, v in batch.items()}
      sums.append(self._micro_step(micro, scale, last=update and m == n - 1))
    return float(sum(float(s) for s in sums)) / total

  def step(self, batch: dict[str, Any]) -> dict[str, Any]:
    """One optimizer step on `batch`; returns {"loss", "tokens", "step_time_s"}.

    The step returns once its backward is done: the last units' gradients and
    updates finish while the next step starts, and each unit's next fetch waits
    for its new copy. `params()`, `snapshot()` and `wait()` wait for them.

    A NaN or infinite loss or gradient: with `nonfinite="skip"` the step changes
    nothing and returns with "skipped": True. With "raise" (the default) it
    raises FloatingPointError naming the step and, for gradients, the first unit
    found non-finite. A non-finite loss, or a non-finite gradient in the first
    unit updated (the head), leaves the host state as before the step. Per-unit
    updates run during the backward, so a non-finite gradient found after some
    units were updated leaves the trainer invalid (it refuses further steps;
    resume from the last checkpoint); that error is raised by this step or, when
    found after it returned, by the next call.
    """
    batch, total = self._prepare(batch)
    h2d0, d2h0 = self._stats["h2d_bytes"], self._d2h_bytes
    busy0, d2h_s0, opt_s0 = self.prefetcher.busy_s, self._d2h_s, self._opt_s
    self.ledger.reset_peak()
    # Per-unit updates read the step before's verdict once, at their first update.
    guard = self._guard = _StepGuard(step=self._stats["steps"] + 1,
                                     prev=None if self._defer else self._late)
    t0 = time.perf_counter()
    try:
      loss = guard.loss = self._sweep(batch, total, update=True)
      t_compute = time.perf_counter()
      if self._defer:
        self._wait_workers()
        bad = self._find_nonfinite(loss)
        if bad is None:
          # On the optimizer thread, while the next step starts: each unit's next
          # fetch waits for its update.
          self.opt_worker.submit(("update_all", guard.step))
        else:
          self._mark_done(range(self.n_units), guard.step)
      else:
        bad = self._first_verdict(guard, loss)
      self.prefetcher.drain()
    except BaseException as e:
      self._fail(e)
      raise
    t_end = time.perf_counter()
    self._stats["steps"] += 1
    # Fetches for this step, some made during the step before.
    self._stats["h2d_bytes"] += (self.prefetcher.bytes_for.pop(guard.step, 0)
                                 + self._resident_h2d_bytes)
    self._resident_h2d_bytes = 0
    self._stats["d2h_bytes"] = self._d2h_bytes
    self._stats["device_peak_bytes"] = max(self._stats["device_peak_bytes"], self.ledger.peak)
    self._last = {
        "step_time_s": t_end - t0,
        "wait_optimizer_s": t_end - t_compute,
        "h2d_s": self.prefetcher.busy_s - busy0,
        "d2h_s": self._d2h_s - d2h_s0,
        "host_opt_s": self._opt_s - opt_s0,
        "h2d_bytes": self._stats["h2d_bytes"] - h2d0,
        "d2h_bytes": self._d2h_bytes - d2h0,
        "device_peak_bytes": self.ledger.peak,
    }
    out = {"loss": loss, "tokens": total, "step_time_s": self._last["step_time_s"]}
    if bad is not None:
      self._nonfinite_step(bad, guard)
      out["skipped"] = True
    self._late = guard
    return out

  def _first_verdict(self, guard: _StepGuard, loss: float):
    """What this step's per-unit updates found so far, once the first one decided.

    That decision (the head's, made before most of the backward ran) settles the
    clean cases; when the step went bad, every job of it is waited for, so the
    state is final before the step reports.
    """
    deadline = time.monotonic() + self.config.timeout_s
    while not guard.first_done.wait(0.05):
      self.grad_worker.check()
      self.opt_worker.check()
      if time.monotonic() > deadline:
        raise TimeoutError(f"The first update took over {self.config.timeout_s:.0f} s.")
    self.grad_worker.check()
    self.opt_worker.check()
    if guard.bad is None and math.isfinite(loss):
      return None
    self.grad_worker.wait()
    self.opt_worker.wait()
    return guard.bad or ("loss", [])

  def unit_name(self, u: int) -> str:
    """"embed", "layer i" (0-based) or "head"."""
    return {self.EMBED: "embed", self.HEAD: "head"}.get(u, f"layer {u - 1}")

  def _find_nonfinite(self, loss: float) -> tuple[str, list[int]] | None:
    """("loss", []) or ("grads", units) when this step's loss or gradients are not
    finite (the updates wait for the sweep, so every gradient is on the host)."""
    if not math.isfinite(loss):
      return ("loss", [])
    units = self.host_opt.nonfinite_units()
    if units:
      order = [self.HEAD, *range(self.cfg.n_layers, 0, -1), self.EMBED]
      return ("grads", sorted(units, key=order.index))
    return None

  def _drop_gradients(self) -> None:
    self.host_opt.drop_gradients()
    self._acc_ok = [[] for _ in self.specs]

  def _nonfinite_what(self, guard: _StepGuard) -> str:
    kind, units = guard.bad
    if kind == "loss":
      return f"Non-finite loss {guard.loss} at step {guard.step}"
    names = [self.unit_name(u) for u in units]
    return (f"Non-finite gradient at step {guard.step} (loss {guard.loss:.6g}): first "
            f"found in {names[0]}" + (f"; also in {', '.join(names[1:])}" if names[1:] else ""))

  def _nonfinite_error(self, guard: _StepGuard, late: bool = False) -> FloatingPointError:
    what = self._nonfinite_what(guard)
    if not guard.updated:
      return FloatingPointError(
          f"{what}. No parameter or optimizer state was changed: the trainer is as it "
          "was before this step. Lower the learning rate, check the data, or set "
          "EngineConfig(nonfinite='skip') to skip such steps.")
    return FloatingPointError(
        f"{what}{' (found after the step returned)' if late else ''}. The per-unit "
        f"updates of {', '.join(self.unit_name(u) for u in guard.updated)} had already "
        "run during the backward, so the host state is half-updated and this trainer is "
        "now invalid: resume from the last checkpoint. (With "
        "EngineConfig(nonfinite='skip') every gradient is checked before any update.)")

  def _nonfinite_step(self, bad: tuple[str, list[int]], guard: _StepGuard) -> None:
    """Skips the step (counted) or raises, as `config.nonfinite` says."""
    self._drop_gradients()
    if bad[0] == "previous":
      self._check_late()  # the step before went bad after it returned
    guard.bad, guard.reported = bad, True
    if self.config.nonfinite == "skip":
      self._stats["skipped_steps"] += 1
      logging.warning("%s; step skipped (%d skipped so far), no parameter changed.",
                      self._nonfinite_what(guard), self._stats["skipped_steps"])
      return
    err = self._nonfinite_error(guard)
    if guard.updated:
      self._fail(err)
      raise err
    self._stats["steps"] -= 1  # nothing was applied
    self._cancel_prefetch()  # the caller may change the state before the next try
    raise err

  def _check_late(self) -> None:
    """Raises a non-finite gradient the last step's updates found after it returned."""
    guard = self._late
    if guard.bad is not None and guard.updated and not guard.reported:
      guard.reported = True
      err = self._nonfinite_error(guard, late=True)
      self._fail(err)
      raise err

  def loss_and_grads(self, batch: dict[str, Any]):
    """(loss, gradient tree of numpy fp32) at the current parameters; no update."""
    batch, total = self._prepare(batch)
    self._guard = _StepGuard(step=self._stats["steps"] + 1)
    try:
      loss = self._sweep(batch, total, update=False)
      self._wait_workers()
      self.prefetcher.drain()
      self._stats["h2d_bytes"] += self.prefetcher.bytes_for.pop(self._guard.step, 0)
    except BaseException as e:
      self._fail(e)
      raise
    grads = [s.unflatten(np.asarray(a)) for s, a in zip(self.specs, self.host_opt.accum)]
    self._drop_gradients()
    return loss, self._assemble([jax.tree.map(np.array, g) for g in grads])

  def _fail(self, e: BaseException) -> None:
    """Marks the trainer invalid and stops its threads after a failed sweep."""
    self._invalid = e
    if isinstance(e, Exception) and not isinstance(e, FloatingPointError):
      e.add_note("The StreamingTrainer failed during a step; its host state may be "
                 "half-updated, so it is now invalid: resume from the last checkpoint.")
    self.close()

  # --------------------------------------------------------------------------
  # State.
  # --------------------------------------------------------------------------

  def params(self) -> dict[str, Any]:
    """The fp32 master parameters as a tree of numpy arrays (same as the model's)."""
    if self._threads_open:
      self._wait_workers()
    # Each unit's leaves are views of its own fresh copy.
    return self._assemble([s.unflatten(self.host_opt.master(u))
                           for u, s in enumerate(self.specs)])

  @property
  def step_count(self) -> int:
    """Steps taken (skipped ones included), restored from a checkpoint."""
    return self._stats["steps"]

  def _state_key(self, name) -> str:
    if name == "optimizer":
      return "optimizer"
    return {self.EMBED: "embed", self.HEAD: "head"}.get(name, f"block_{name - 1:04d}")

  def state_layout(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """What `snapshot` holds: for each part, the (shape, dtype) of its arrays."""
    self._wait_workers()
    return {self._state_key(n): self.host_opt.state_layout(n)
            for n in self.host_opt.state_names()}

  def snapshot(self) -> Snapshot:
    """The host state at this step boundary, copied unit by unit as it is read.

    Training may go on while a checkpoint writer reads the snapshot: an update
    about to change a unit the writer has not read yet copies it first, so the
    snapshot stays the state of this step while costing about one unit of extra
    host memory (all of it in whole-tree mode, whose single update changes every
    unit at once). Units come in the order the next backward updates them.
    """
    if self._invalid is not None:
      raise RuntimeError("Cannot snapshot an invalid trainer; its state may be "
                         f"half-updated ({self._invalid}).")
    self._wait_workers()
    names = self.host_opt.state_names()
    order = [self.HEAD, *range(self.cfg.n_layers, 0, -1), self.EMBED]
    order += [n for n in names if n not in order]
    keys = {n: self._state_key(n) for n in names}
    snap = Snapshot([keys[n] for n in order],
                    {keys[n]: (lambda n=n: self.host_opt.copy_state(n)) for n in names})
    self.host_opt.before_donate = lambda ns: snap.before_change([keys[n] for n in ns])
    return snap

  def restore(self, read: Callable[[str], dict[str, np.ndarray]], step_count: int) -> None:
    """Loads every part of `state_layout()` from `read(key)`, one unit at a time.

    The caller checks the layout first. If `read` fails partway, the trainer holds
    a mix of states: restore again (e.g. from an older checkpoint) before training.
    """
    self._wait_workers()
    self._cancel_prefetch()
    for n in self.host_opt.state_names():
      self.host_opt.load_state(n, read(self._state_key(n)))
    self._drop_gradients()
    for u in range(self.n_units):
      self._master_changed(u)
    self._stats["steps"] = int(step_count)
    with self._done_cond:  # every unit is now as of that step
      self._done = [int(step_count)] * self.n_units

  def unit_params(self, u: int) -> dict[str, Any]:
    """Unit u's fp32 master parameters as a tree of numpy arrays (a copy)."""
    if self._threads_open:
      self._wait_workers()
    return self.specs[u].unflatten(self.host_opt.master(u))

  def stats(self) -> dict[str, Any]:
    """Counters since construction, plus the last step's bytes and phase times."""
    out = dict(self._stats)
    out["compiles"] = dict(self._counter.counts)
    out["last_step"] = dict(self._last)
    out["param_count"] = int(sum(s.size for s in self.specs))
    out["layer_bytes"] = int(self.unit_bytes[1]) if self.cfg.n_layers else 0
    # Host bytes of the kept streaming copies (none when each fetch casts the master).
    out["stream_bytes"] = int(sum(self.unit_bytes)) if self._keep_copy else 0
    out["prefetch_slots"] = self._slots
    out["optimizer_mode"] = self.host_opt.mode
    out["fused_optimizer"] = self.host_opt.fused
    out["stream_copy"] = "keep" if self._keep_copy else "on_fetch"
    return out

  def close(self) -> None:
    """Stops the engine threads. Idempotent."""
    if not getattr(self, "_threads_open", False):
      return
    self._threads_open = False
    self.prefetcher.close()
    self.grad_worker.close()
    self.opt_worker.close()
    self.host_opt.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass
