"""Side-by-side measurements behind `experiments/bench.py`.

Every figure is a ratio of two things timed in the same process, alternating between
them, and reported as the ratio of their medians after warm-up (the first, compiling
call is never timed).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from megatrain_jax.engine import EngineConfig, SimulatedLink, StreamingTrainer
from megatrain_jax.engine import host_memory as malloc
from megatrain_jax.engine.flat import FlatSpec
from megatrain_jax.engine.host_optimizer import CHUNK, HostOptimizer
from megatrain_jax.metrics import model_flops_per_token
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models import llama
from megatrain_jax.models.llama import Llama
from megatrain_jax.optim import adamw, fused_adamw_update
from megatrain_jax.resident import ResidentTrainer

# The model the step-time ratios use: it fits on any device, and its layers are big
# enough on 2 CPU cores that per-layer overheads are visible but not dominant.
BENCH_MODEL = LlamaConfig(vocab_size=260, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4,
                          d_ff=1536, max_seq_len=2048)
# The goals each figure must meet on a 2-core CPU machine: (comparison, bound).
GOALS = {
    "stream_over_resident_remat": ("<=", 1.05),
    "stream_over_resident": ("report", None),
    "overlap_efficiency": (">=", 0.90),
    "no_prefetch_over_prefetch": (">=", 1.6),
    "host_opt_bw_ratio": (">=", 0.80),
    "host_bytes_per_param": ("<=", 14.5),
}
ADAMW_BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (fp32)
TRIAD_BYTES_PER_ELEMENT = 12  # read b, c; write a (fp32)


@dataclasses.dataclass
class Suite:
  """Sizes of one benchmark suite."""
  model: LlamaConfig = BENCH_MODEL
  batch_size: int = 4
  seq_len: int = 512
  warmup: int = 2
  reps: int = 7
  opt_params: int = 32 * 2**20
  opt_slab: int = 2**20  # the host-optimizer profile's cache-sized pieces
  host_chunk: int = CHUNK  # elements per step of the host AdamW's in-place loop
  rss_model: str = "300m"


def synthetic_batch(cfg: LlamaConfig, batch_size: int, seq_len: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
  return {"input_ids": ids[:, :-1], "labels": ids[:, 1:],
          "loss_mask": np.ones((batch_size, seq_len), np.float32)}


def median_times(fns: dict[str, Callable[[], Any]], warmup: int, reps: int
                 ) -> dict[str, float]:
  """Median wall time of each fn, calls interleaved so drift hits all alike."""
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def step_ratios(s: Suite) -> dict[str, Any]:
  """Streaming vs resident step time on a model that fits, fp32."""
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  opt = lambda: optax.adamw(1e-4)
  model = lambda: Llama(cfg, rngs=nnx.Rngs(0))
  remat = ResidentTrainer(model(), opt(), remat=True)
  plain = ResidentTrainer(model(), opt())
  with StreamingTrainer(model(), adamw(1e-4), EngineConfig()) as eng:
    # The streaming step's last updates are waited for inside its timing (a step
    # alone, not overlapping the next one), so it is charged all of its work.
    t = median_times({"stream": lambda: (eng.step(batch), eng.wait()),
                      "remat": lambda: remat.step(batch),
                      "plain": lambda: plain.step(batch)}, s.warmup, s.reps)
    st = eng.stats()
  tokens = s.batch_size * s.seq_len
  return {
      "stream_over_resident_remat": t["stream"] / t["remat"],
      "stream_over_resident": t["stream"] / t["plain"],
      "step_time_s": t["stream"],
      "resident_remat_step_time_s": t["remat"],
      "resident_step_time_s": t["plain"],
      "tokens_per_s": tokens / t["stream"],
      "model_tflops_per_s": model_flops_per_token(cfg, s.seq_len) * tokens / t["stream"] / 1e12,
      "device_peak_bytes": st["device_peak_bytes"],
      "layer_bytes": st["layer_bytes"],
      "param_bytes": st["param_count"] * 4,
      "param_count": st["param_count"],
      "h2d_bytes_per_step": st["last_step"].get("h2d_bytes"),
      "d2h_bytes_per_step": st["last_step"].get("d2h_bytes"),
  }


def steady_step_times(trainers: dict[str, Any], batch, warmup: int, reps: int
                      ) -> dict[str, float]:
  """Median step time of each trainer in steady state: the timed step starts as the
  same trainer's previous step returns, so it overlaps that step's last updates as
  in a training loop. The trainers take turns (one untimed step, one timed, then
  `wait()` so the next trainer starts on a quiet machine)."""
  times = {k: [] for k in trainers}
  for r in range(warmup + reps):
    for k, eng in trainers.items():
      eng.step(batch)
      t0 = time.perf_counter()
      eng.step(batch)
      dt = time.perf_counter() - t0
      eng.wait()
      if r >= warmup:
        times[k].append(dt)
  return {k: statistics.median(v) for k, v in times.items()}


def layer_backward_time(cfg: LlamaConfig, batch_size: int, seq_len: int, warmup: int,
                        reps: int) -> float:
  """Median time of one block's backward (vjp with its forward recomputed), jitted."""
  p = llama.init_block(cfg, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (batch_size, seq_len, cfg.d_model))

  @jax.jit
  def bwd(p, x, g):
    _, vjp = jax.vjp(lambda p, x: llama.block_apply(cfg, p, x), p, x)
    return vjp(g)

  return median_times({"b": lambda: bwd(p, x, x)}, warmup, reps)["b"]


def link_ratios(s: Suite) -> dict[str, Any]:
  """Overlap and the double-buffering ablation under a `SimulatedLink`.

  The link is set so one layer's transfer takes as long as that layer's backward
  compute, the longest per-layer phase (the forward is about a third of it). Then a
  step moves 2 x L layers, so total transfer exceeds total compute, and perfect
  overlap would make the step as long as the transfers.
  """
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  model = lambda: Llama(cfg, rngs=nnx.Rngs(0))
  t_layer = layer_backward_time(cfg, s.batch_size, s.seq_len, s.warmup, s.reps)
  with StreamingTrainer(model(), adamw(1e-4), EngineConfig()) as eng:
    compute = median_times({"c": lambda: eng.step(batch)}, s.warmup, s.reps)["c"]
    h2d, layer = eng.stats()["last_step"]["h2d_bytes"], eng.stats()["layer_bytes"]
  gbps = layer / t_layer / 1e9
  transfer = h2d / (gbps * 1e9)
  link = lambda: SimulatedLink(gbps)
  # Reported beside the default: one more buffer in flight, which covers the wait
  # at a step's start (docs/performance.md, "Where the link waits").
  deeper = EngineConfig().prefetch_depth + 1
  with StreamingTrainer(model(), adamw(1e-4), EngineConfig(transport=link())) as a, \
       StreamingTrainer(model(), adamw(1e-4),
                        EngineConfig(transport=link(), prefetch_depth=0)) as b, \
       StreamingTrainer(model(), adamw(1e-4),
                        EngineConfig(transport=link(), prefetch_depth=deeper)) as c:
    t = steady_step_times({"prefetch": a, "none": b, "deeper": c}, batch, 1,
                          max(3, s.reps // 2))
  return {
      "overlap_efficiency": max(compute, transfer) / t["prefetch"],
      "no_prefetch_over_prefetch": t["none"] / t["prefetch"],
      "overlap_efficiency_deeper_prefetch": max(compute, transfer) / t["deeper"],
      "link_deeper_prefetch_depth": deeper,
      "link_deeper_prefetch_step_time_s": t["deeper"],
      "link_gb_per_s": gbps,
      "link_layer_backward_s": t_layer,
      "link_compute_s": compute,
      "link_transfer_s": transfer,
      "link_step_time_s": t["prefetch"],
      "link_no_prefetch_step_time_s": t["none"],
  }


@functools.lru_cache(maxsize=None)
def _normal_fill(size: int) -> Callable:
  return jax.jit(lambda key: jax.random.normal(key, (size,), jnp.float32),
                 device=jax.devices("cpu")[0])


def host_normal(size: int, seed: int) -> jax.Array:
  """`size` fp32 normals on the CPU backend, in a buffer XLA made itself (a numpy
  source may be aliased, and an aliased buffer cannot be donated, which would time
  page faults instead of bandwidth)."""
  return _normal_fill(size)(jax.random.key(seed))


def donated_triad() -> Callable:
  """The reference for host bandwidth: `a = b + s*c`, jitted, with b donated, so it
  is written in place (TRIAD_BYTES_PER_ELEMENT per element)."""
  return jax.jit(lambda b, c: b + jnp.float32(0.5) * c, donate_argnums=(0,))


def host_optimizer_bandwidth(s: Suite) -> dict[str, Any]:
  """Host AdamW bytes/s against a donated triad's, both jitted on the CPU backend."""
  n = s.opt_params
  host = jax.devices("cpu")[0]
  spec = FlatSpec({"w": np.zeros((n,), np.float32)})
  opt = HostOptimizer(adamw(1e-4), [spec], [host_normal(n, 0)],
                      assemble=lambda u: u[0], split=lambda t: [t], compute_dtype=jnp.float32,
                      mode="per_unit", host_device=host, chunk=s.host_chunk)
  grad = host_normal(n, 1)
  triad = donated_triad()
  state = {"b": host_normal(n, 2), "c": host_normal(n, 3)}

  def run_triad():
    state["b"] = triad(state["b"], state["c"])
    return state["b"]

  def run_opt():  # the optimizer proper: new master and state
    opt.update_unit(0, grad, stream=False)
    return opt.parts[0], opt.states[0]

  def run_update():  # the engine's whole per-unit update, streaming copy included
    return opt.update_unit(0, grad), opt.parts[0], opt.states[0]

  # Short calls on a shared machine: three times the repetitions for a stable median.
  t = median_times({"opt": run_opt, "update": run_update, "triad": run_triad},
                   s.warmup, 3 * s.reps)
  opt_bw = ADAMW_BYTES_PER_PARAM * n / t["opt"]
  triad_bw = TRIAD_BYTES_PER_ELEMENT * n / t["triad"]
  return {"host_opt_bw_ratio": opt_bw / triad_bw, "host_opt_gb_per_s": opt_bw / 1e9,
          "host_update_with_stream_copy_bw_ratio":
              ADAMW_BYTES_PER_PARAM * n / t["update"] / triad_bw,
          "triad_gb_per_s": triad_bw / 1e9, "host_opt_params": n}


def loop_fusions(compiled_hlo: str, n: int) -> int:
  """Fusions in the entry computation of `compiled_hlo` that write an array of n
  elements: on the CPU backend each is one pass over that array's memory."""
  entry = compiled_hlo[compiled_hlo.index("\nENTRY"):]
  shapes = re.findall(r"= \w+\[([\d,]*)\]\S* fusion\(", entry)
  return sum(1 for dims in shapes
             if math.prod(int(d) for d in dims.split(",") if d) == n)


def host_optimizer_profile(s: Suite) -> dict[str, Any]:
  """Where the host AdamW's time goes, against the same donated triad: the fused
  AdamW expression (`fused_adamw_update`) and stock `optax.adamw` on one whole
  buffer; the fused expression over
  `s.opt_slab`-sized buffers, small enough that what one pass writes is still in
  the last-level cache when the next reads it; one such buffer updated over and
  over (no DRAM traffic: the arithmetic's own ceiling); and the engine's in-place,
  chunked update on a single thread (`host_opt_bw_ratio` runs it on one thread per
  CPU). Also the number of passes XLA makes over a buffer, and the bytes per
  parameter the fused update moves if it runs at the triad's bandwidth."""
  n, slab = s.opt_params, s.opt_slab
  if not 0 < slab <= n:
    raise ValueError(f"opt_slab={slab} must be between 1 and opt_params={n}.")
  k = n // slab
  tx, stock_tx = adamw(1e-4), optax.adamw(1e-4)
  init = jax.jit(tx.init)

  def stock_update(p, state, g):
    updates, state = stock_tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  fused = jax.jit(lambda p, state, g: fused_adamw_update(tx.hyper, p, g, state),
                  donate_argnums=(0, 1))
  stock = jax.jit(stock_update, donate_argnums=(0, 1))
  triad = donated_triad()
  grad = host_normal(n, 1)
  whole = {name: [p, init(p)]
           for name, p in (("fused", host_normal(n, 2)), ("stock", host_normal(n, 3)))}
  pieces = []  # [master, state, gradient] of each piece
  for i in range(k):
    p = host_normal(slab, 100 + i)
    pieces.append([p, init(p), host_normal(slab, 200 + i)])
  p = host_normal(slab, 4)
  cached = [p, init(p), host_normal(slab, 5)]
  tri = {"b": host_normal(n, 6), "c": host_normal(n, 7)}
  one = HostOptimizer(tx, [FlatSpec({"w": np.zeros((n,), np.float32)})], [host_normal(n, 8)],
                      assemble=lambda u: u[0], split=lambda t: [t], compute_dtype=jnp.float32,
                      mode="per_unit", host_device=jax.devices("cpu")[0], threads=1,
                      chunk=s.host_chunk)
  passes = loop_fusions(fused.lower(*whole["fused"], grad).compile().as_text(), n)

  def run_whole(name, fn):
    def run():
      box = whole[name]
      box[0], box[1] = fn(box[0], box[1], grad)
      return box
    return run

  def run_pieces():
    for box in pieces:
      box[0], box[1] = fused(*box)
    return pieces

  def run_cached():
    for _ in range(k):
      cached[0], cached[1] = fused(*cached)
    return cached

  def run_one_thread():
    one.update_unit(0, grad, stream=False)
    return one.parts[0], one.states[0]

  def run_triad():
    tri["b"] = triad(tri["b"], tri["c"])
    return tri["b"]

  t = median_times({"fused": run_whole("fused", fused), "stock": run_whole("stock", stock),
                    "slabs": run_pieces, "in_cache": run_cached,
                    "one_thread": run_one_thread, "triad": run_triad},
                   s.warmup, 3 * s.reps)
  triad_bw = TRIAD_BYTES_PER_ELEMENT * n / t["triad"]
  ratio = lambda key: ADAMW_BYTES_PER_PARAM * k * slab / t[key] / triad_bw
  return {"host_opt_profile_passes": passes,
          "host_opt_profile_bytes_per_param_at_triad_bw": t["fused"] * triad_bw / n,
          "host_opt_profile_fused_bw_ratio": ADAMW_BYTES_PER_PARAM * n / t["fused"] / triad_bw,
          "host_opt_profile_stock_bw_ratio": ADAMW_BYTES_PER_PARAM * n / t["stock"] / triad_bw,
          "host_opt_profile_slabs_bw_ratio": ratio("slabs"),
          "host_opt_profile_in_cache_bw_ratio": ratio("in_cache"),
          "host_opt_profile_one_thread_bw_ratio":
              ADAMW_BYTES_PER_PARAM * n / t["one_thread"] / triad_bw,
          "host_opt_profile_slab_params": slab,
          "host_opt_profile_triad_gb_per_s": triad_bw / 1e9}


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_memory_child(model_name: str, steps: int = 2, stream_copy: str = "auto"
                      ) -> dict[str, Any]:
  """Run in a fresh process: peak RSS of training `model_name`, per parameter."""
  from megatrain_jax.models.config import preset
  cfg = preset(model_name)
  batch = synthetic_batch(cfg, 1, 64)
  jax.block_until_ready(jnp.zeros(1) + 1)  # backend up before the baseline
  base = _rss_bytes()
  ec = EngineConfig(compute_dtype=jnp.bfloat16, stream_copy=stream_copy)
  with StreamingTrainer.from_config(cfg, adamw(1e-4), ec, jax.random.key(0)) as eng:
    for _ in range(steps):
      eng.step(batch)
    n = eng.stats()["param_count"]
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"host_bytes_per_param": (peak - base) / n, "rss_model": model_name,
          "rss_param_count": n, "rss_peak_bytes": peak, "rss_baseline_bytes": base}


def _host_memory_run(model_name: str, stream_copy: str) -> dict[str, Any]:
  code = ("import json, sys; from megatrain_jax import benchmark as b; print('RESULT ' + "
          f"json.dumps(b.host_memory_child({model_name!r}, stream_copy={stream_copy!r})))")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
  if r.returncode != 0 or not lines:
    raise RuntimeError(f"host-memory measurement failed:\n{r.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


def host_memory(s: Suite) -> dict[str, Any]:
  """Host bytes per parameter with the engine's defaults (on the CPU backend each
  fetch casts the master), and with the compute-dtype copies kept, as the default
  does on an accelerator."""
  out = _host_memory_run(s.rss_model, "auto")
  out["host_bytes_per_param_kept_copies"] = _host_memory_run(
      s.rss_model, "keep")["host_bytes_per_param"]
  return out


def machine() -> dict[str, Any]:
  d = jax.devices()[0]
  return {"platform": d.platform, "device": str(d.device_kind), "cpus": os.cpu_count(),
          "python": platform.python_version(), "jax": jax.__version__,
          "machine": platform.machine(),
          # malloc's page size decides what each per-layer call's scratch costs
          # (see engine/host_memory.py): the run's setting, stated.
          "transparent_huge_pages": malloc.thp_mode(),
          "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}


def template_times(s: Suite) -> dict[str, Any]:
  """What the per-layer calls cost by themselves: the streaming templates called one
  after another on units already on the device (no engine threads, transfers or
  updates) against the resident remat step, and each block template's XLA scratch
  (allocated afresh by every call on the CPU backend)."""
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  remat = ResidentTrainer(Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-4), remat=True)
  with StreamingTrainer(Llama(cfg, rngs=nnx.Rngs(0)), adamw(1e-4), EngineConfig()) as eng:
    n = cfg.n_layers
    ids, labels, mask = (eng.transport.to_device(batch[k])
                         for k in ("input_ids", "labels", "loss_mask"))
    units = [eng._to_device(u) for u in range(n + 2)]  # pylint: disable=protected-access
    tied = units[0] if cfg.tie_embeddings else None
    scale = jnp.float32(1.0 / batch["loss_mask"].sum())

    def templates():
      x, inputs = eng._embed_fwd(units[0], ids), []
      for i in range(n):
        inputs.append(x)
        x = eng._block_fwd(units[1 + i], x)
      _, g, _, g_e, _ = eng._head(units[n + 1], tied, x, labels, mask, scale)
      for i in reversed(range(n)):
        g, _, _ = eng._block_bwd(units[1 + i], inputs[i], g)
      return eng._embed_bwd(ids, g, g_e)

    t = median_times({"templates": templates, "remat": lambda: remat.step(batch)},
                     s.warmup, s.reps)
    x = eng._embed_fwd(units[0], ids)
    scratch = {name: fn.lower(*args).compile().memory_analysis()
               for name, fn, args in (("block_fwd", eng._block_fwd, (units[1], x)),
                                      ("block_bwd", eng._block_bwd, (units[1], x, x)))}
  return {"templates_step_time_s": t["templates"],
          "templates_over_resident_remat": t["templates"] / t["remat"],
          "templates_resident_remat_step_time_s": t["remat"],
          **{f"{k}_scratch_bytes": getattr(m, "temp_size_in_bytes", None)
             for k, m in scratch.items()}}


PARTS = {"steps": step_ratios, "link": link_ratios,
         "host_optimizer": host_optimizer_bandwidth, "host_memory": host_memory,
         "templates": template_times, "host_optimizer_profile": host_optimizer_profile}
# The parts behind the goals; "templates" and "host_optimizer_profile" are
# profiles, run on request.
DEFAULT_PARTS = ("steps", "link", "host_optimizer", "host_memory")


def run_suite(s: Suite, parts: tuple[str, ...] = DEFAULT_PARTS) -> dict[str, Any]:
  """Runs the named parts of the suite (the goals' parts by default) and merges
  their figures."""
  unknown = [p for p in parts if p not in PARTS]
  if unknown:
    raise ValueError(f"Unknown benchmark parts {unknown}; choose from {list(PARTS)}.")
  out: dict[str, Any] = {"machine": machine(),
                         "model": dataclasses.asdict(s.model),
                         "batch_size": s.batch_size, "seq_len": s.seq_len,
                         "reps": s.reps, "warmup": s.warmup, "parts": list(parts)}
  for name in parts:
    fn = PARTS[name]
    t0 = time.perf_counter()
    out.update(fn(s))
    logging.info("bench %s done in %.0f s", name, time.perf_counter() - t0)
  return out
