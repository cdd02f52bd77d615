"""The host AdamW's bandwidth against a donated triad's, and where its time goes."""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import optax

from megatrain_jax.bench.suite import Suite
from megatrain_jax.bench.timing import (ADAMW_BYTES_PER_PARAM, TRIAD_BYTES_PER_ELEMENT,
                                        donated_triad, host_normal, median_times)
from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.optim import adamw, fused_adamw_update


def host_optimizer_bandwidth(s: Suite) -> dict[str, Any]:
  """Host AdamW bytes/s against a donated triad's, both jitted on the CPU backend.

  Times the optimizer alone, the engine's whole per-unit update (its streaming copy
  included) and the triad, on `s.opt_params` elements each.

  Args:
    s: the sizes.

  Returns:
    The bandwidth ratios of the optimizer and of the whole update to the triad, both
    bandwidths in GB/s, and the parameter count.
  """
  n = s.opt_params
  opt = HostOptimizer.of_buffers(adamw(1e-4), [host_normal(n, 0)], mode="per_unit",
                                 chunk=s.host_chunk)
  grad = host_normal(n, 1)
  triad = donated_triad()
  state = {"b": host_normal(n, 2), "c": host_normal(n, 3)}

  def run_triad():
    state["b"] = triad(state["b"], state["c"])
    return state["b"]

  def run_opt():  # the optimizer proper: new master and state
    opt.update_unit(0, grad, stream=False)
    return opt.store.parts[0], opt.store.states[0]

  def run_update():  # the engine's whole per-unit update, streaming copy included
    return opt.update_unit(0, grad), opt.store.parts[0], opt.store.states[0]

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
  elements: on the CPU backend each is one pass over that array's memory.

  Args:
    compiled_hlo: the text of a compiled computation.
    n: the array's element count.

  Returns:
    The number of such fusions.
  """
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
  parameter the fused update moves if it runs at the triad's bandwidth.

  Args:
    s: the sizes (`opt_params`, `opt_slab`, `host_chunk`, `warmup`, `reps`).

  Returns:
    The "host_opt_profile_*" figures: the passes, the bytes per parameter at the
    triad's bandwidth, each variant's bandwidth ratio to the triad, the slab size and
    the triad's GB/s.

  Raises:
    ValueError: `s.opt_slab` is not between 1 and `s.opt_params`.
  """
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
  one = HostOptimizer.of_buffers(tx, [host_normal(n, 8)], mode="per_unit", threads=1,
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
    return one.store.parts[0], one.store.states[0]

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
