"""Overlap under a simulated link, and the double-buffering ablation."""

from __future__ import annotations

import statistics
from typing import Any, Callable

import jax
from flax import nnx

from megatrain_jax.bench.suite import Suite
from megatrain_jax.bench.timing import median_times, steady_step_samples, synthetic_batch
from megatrain_jax.engine import EngineConfig, SimulatedLink, StreamingTrainer
from megatrain_jax.models import llama
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.llama import Llama
from megatrain_jax.optim import adamw

# Timed calls of the block's backward that set the link before each turn.
LINK_BACKWARD_REPS = 5


def layer_backward_timer(cfg: LlamaConfig, batch_size: int, seq_len: int
                         ) -> Callable[[int, int], float]:
  """A timer of one block's backward (vjp with its forward recomputed), jitted once.

  Args:
    cfg: the model (its block).
    batch_size: sequences.
    seq_len: tokens per sequence.

  Returns:
    (warmup, reps) -> median seconds of one call, after `warmup` untimed calls.
  """
  p = llama.init_block(cfg, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (batch_size, seq_len, cfg.d_model))

  @jax.jit
  def bwd(p, x, g):
    _, vjp = jax.vjp(lambda p, x: llama.block_apply(cfg, p, x), p, x)
    return vjp(g)

  return lambda warmup, reps: median_times({"b": lambda: bwd(p, x, x)}, warmup, reps)["b"]


def layer_backward_time(cfg: LlamaConfig, batch_size: int, seq_len: int, warmup: int,
                        reps: int) -> float:
  """Median time of one block's backward (vjp with its forward recomputed), jitted.

  Args:
    cfg: the model (its block).
    batch_size: sequences.
    seq_len: tokens per sequence.
    warmup: untimed calls first.
    reps: timed calls.

  Returns:
    Median seconds of one call.
  """
  return layer_backward_timer(cfg, batch_size, seq_len)(warmup, reps)


def link_ratios(s: Suite) -> dict[str, Any]:
  """Overlap and the double-buffering ablation under a `SimulatedLink`.

  The link is set so one layer's transfer takes as long as that layer's backward
  compute, the longest per-layer phase (the forward is about a third of it). Then a
  step moves 2 x L - 1 layers (the last one's backward runs in the head's call), so
  total transfer exceeds total compute, and perfect overlap would make the step as
  long as the transfers. The link is set anew before each turn of the timed steps,
  from the block's backward timed alone right then, and each turn's figures are
  taken against its own link (the medians over the turns are returned).

  Args:
    s: the sizes.

  Returns:
    The overlap efficiency with the default prefetch and with one more buffer in
    flight, the no-prefetch over prefetch step-time ratio, the step time with the
    activation checkpoints in host memory over on the device, and the link's speed and
    the times behind them.
  """
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  model = lambda: Llama(cfg, rngs=nnx.Rngs(0))
  backward = layer_backward_timer(cfg, s.batch_size, s.seq_len)
  t_first = backward(s.warmup, s.reps)
  # The step without the link takes its turns beside the linked ones, and the link
  # is set anew before each turn from the block's backward timed then. Timed minutes
  # apart, either one followed this machine's drifting speed (up to 1.4x in a few
  # minutes) rather than the overlap: a link set while the machine ran fast made the
  # backward inside the later steps slower than the link, and the reverse.
  with StreamingTrainer(model(), adamw(1e-4), EngineConfig()) as plain:
    plain.step(batch)
    plain.wait()
    step_h2d, layer = plain.stats()["last_step"]["h2d_bytes"], plain.stats()["layer_bytes"]
    links = []

    def link() -> SimulatedLink:
      links.append(SimulatedLink(layer / t_first / 1e9))
      return links[-1]

    def set_link() -> float:  # before each turn: the link from the backward timed now
      t_layer = backward(1, LINK_BACKWARD_REPS)
      for lk in links:
        lk.gb_per_s = layer / t_layer / 1e9
      return t_layer

    # Reported beside the default: one more buffer in flight throughout, which
    # absorbs a backward slower than the link (docs/performance.md, "The link part").
    deeper = EngineConfig().prefetch_depth + 1
    with StreamingTrainer(model(), adamw(1e-4), EngineConfig(transport=link())) as a, \
         StreamingTrainer(model(), adamw(1e-4),
                          EngineConfig(transport=link(), prefetch_depth=0)) as b, \
         StreamingTrainer(model(), adamw(1e-4),
                          EngineConfig(transport=link(), prefetch_depth=deeper)) as c, \
         StreamingTrainer(model(), adamw(1e-4),
                          EngineConfig(transport=link(), activations="host")) as d:
      t, t_layers = steady_step_samples({"compute": plain, "prefetch": a, "none": b,
                                         "deeper": c, "host": d}, batch, 1,
                                        max(3, s.reps // 2), before_turn=set_link)
      last = {k: e.stats()["last_step"] for k, e in (("device", a), ("host", d))}
  # Each turn's figures against its own link; the medians over the turns.
  transfers = [step_h2d * t_layer / layer for t_layer in t_layers]
  best = [max(c, x) for c, x in zip(t["compute"], transfers)]
  per_turn = lambda num, den: statistics.median(n / d for n, d in zip(num, den))
  med = {k: statistics.median(v) for k, v in t.items()}
  h2d = {k: v["h2d_bytes"] + v.get("activation_bytes", {}).get("h2d", 0)
         for k, v in last.items()}
  t_layer = statistics.median(t_layers)
  return {
      "overlap_efficiency": per_turn(best, t["prefetch"]),
      "no_prefetch_over_prefetch": per_turn(t["none"], t["prefetch"]),
      "overlap_efficiency_deeper_prefetch": per_turn(best, t["deeper"]),
      # Checkpoints in host memory against on the device, same link: the reloads
      # share the host -> device direction with the fetches, so where that direction
      # is the bottleneck their bytes (the second ratio) are the floor.
      "activation_offload_overhead": per_turn(t["host"], t["prefetch"]),
      "activation_offload_h2d_bytes_ratio": h2d["host"] / h2d["device"],
      "link_host_activations_step_time_s": med["host"],
      "link_deeper_prefetch_depth": deeper,
      "link_deeper_prefetch_step_time_s": med["deeper"],
      "link_gb_per_s": layer / t_layer / 1e9,
      "link_layer_backward_s": t_layer,
      "link_layer_backward_first_s": t_first,
      # Each turn's own, to tell a drifting machine from a steady shortfall.
      "link_layer_backward_turns_s": list(t_layers),
      "overlap_efficiency_turns": [b / p for b, p in zip(best, t["prefetch"])],
      "link_compute_s": med["compute"],
      "link_transfer_s": statistics.median(transfers),
      "link_step_time_s": med["prefetch"],
      "link_no_prefetch_step_time_s": med["none"],
  }
