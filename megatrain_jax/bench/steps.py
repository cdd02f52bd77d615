"""The streaming step against the resident one, and the templates alone against both."""

from __future__ import annotations

import contextlib
from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx

from megatrain_jax.bench.suite import Suite
from megatrain_jax.bench.timing import median_times, synthetic_batch
from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.engine.plan.schedule import Schedule
from megatrain_jax.metrics import model_flops_per_token
from megatrain_jax.models.llama import Llama
from megatrain_jax.optim import adamw
from megatrain_jax.resident import ResidentTrainer


def pair_reps(s: Suite) -> int:
  """Timed rounds of the streaming step against the resident remat step: half as
  many again as the suite's, since that ratio's goal is the tightest.

  Args:
    s: the sizes.

  Returns:
    The rounds.
  """
  return s.reps * 3 // 2


def step_ratios(s: Suite, kept: tuple[str, ...] = ("none", "dots")) -> dict[str, Any]:
  """Streaming vs resident step time on a model that fits, fp32, in two rounds: the
  streaming step against the resident remat step (`pair_reps` rounds), then the
  `kept` engines against the resident step without remat (the suite's rounds).

  Args:
    s: the sizes.
    kept: the `recompute` modes that keep residuals to time beside (each one's
      residuals must fit the device: "none" keeps the [T, T] attention
      probabilities of every layer).

  Returns:
    The streaming step time over the resident one's (with and without remat; and
    with recompute "none" and "dots" over the resident one without remat), the
    step times, throughput, and the streaming engine's memory and traffic.
  """
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  model = lambda: Llama(cfg, rngs=nnx.Rngs(0))
  resident = lambda **kw: ResidentTrainer(model(), optax.adamw(1e-4), **kw)
  # Two rounds, each with only the trainers it compares alive, as in training (one
  # trainer per process): the streaming step against the resident remat step (the
  # goal, over more rounds), then the steps that keep residuals against the resident
  # step without remat (so `stream_over_resident` divides across the two rounds).
  # Other engines alive in the process slowed the streaming step
  # (docs/performance.md, "The goal's pair timed by itself"). The streaming step's
  # last updates are waited for inside its timing (a step alone, not overlapping the
  # next one), so it is charged all of its work. Each step is timed after two
  # untimed ones of its own trainer (`median_times`).
  timed = lambda e: (lambda: (e.step(batch), e.wait()))
  with StreamingTrainer(model(), adamw(1e-4), EngineConfig()) as eng:
    remat = resident(remat=True)
    t = median_times({"stream": timed(eng), "remat": lambda: remat.step(batch)},
                     s.warmup, pair_reps(s), settle=2)
    stats = {"stream": eng.stats()}
  del remat
  with contextlib.ExitStack() as stack:
    engines = {m: stack.enter_context(
        StreamingTrainer(model(), adamw(1e-4), EngineConfig(recompute=m))) for m in kept}
    plain = resident()
    t.update(median_times({**{k: timed(e) for k, e in engines.items()},
                           "plain": lambda: plain.step(batch)}, s.warmup, s.reps, settle=2))
    stats.update({k: e.stats() for k, e in engines.items()})
  st = stats["stream"]
  tokens = s.batch_size * s.seq_len
  out = {
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
  # recompute="none": no layer's forward runs twice, like the resident step without
  # remat; "dots", the policy between, recomputes the elementwise work only.
  names = {"none": "noremat", "dots": "dots"}
  for m in kept:
    out[f"stream_over_resident_{names[m]}"] = t[m] / t["plain"]
    out[f"{names[m]}_step_time_s"] = t[m]
    out[f"{names[m]}_device_peak_bytes"] = stats[m]["device_peak_bytes"]
  return out


def template_times(s: Suite) -> dict[str, Any]:
  """What the per-layer calls cost by themselves: the streaming templates called one
  after another on units already on the device (no engine threads, transfers or
  updates) against the resident remat step, and each block template's XLA scratch
  (allocated afresh by every call on the CPU backend), and the tail's.

  Args:
    s: the sizes.

  Returns:
    The templates' time, the remat step's time and their ratio, and the block
    templates' scratch bytes (None where XLA does not say).
  """
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  remat = ResidentTrainer(Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-4), remat=True)
  with StreamingTrainer(Llama(cfg, rngs=nnx.Rngs(0)), adamw(1e-4), EngineConfig()) as eng:
    n, tpl, tp = cfg.n_layers, eng.templates, eng.transport
    ids, labels, mask = (tp.to_device(batch[k]) for k in ("input_ids", "labels", "loss_mask"))
    host_opt = eng.host_optimizer
    units = [tp.h2d_cast(host_opt.store.fetch_parts(u), host_opt.compute_dtype)
             for u in range(n + 2)]
    tied = units[0] if cfg.tie_embeddings else None
    scale = jnp.float32(1.0 / batch["loss_mask"].sum())

    before = n - Schedule.build(cfg, EngineConfig()).fused_tail  # layers before the tail

    def templates():  # as the engine's step calls them
      x, inputs = tpl.embed_fwd(units[0], ids), []
      for i in range(before):
        inputs.append(x)
        x = tpl.block_fwd(units[1 + i], x, i)[0]
      if before < n:
        _, g, _, g_e, *_ = tpl.tail(units[n], units[n + 1], tied, x, labels, mask, scale)
      else:
        _, g, _, g_e, *_ = tpl.head(units[n + 1], tied, x, labels, mask, scale, {})
      for i in reversed(range(before)):
        g, _, _ = tpl.block_bwd(units[1 + i], inputs[i], g, i)
      return tpl.embed_bwd(ids, g, g_e)

    t = median_times({"templates": templates, "remat": lambda: remat.step(batch)},
                     s.warmup, s.reps, settle=1)
    scratch = tpl.measure_scratch()  # the shape the templates just ran
  return {"templates_step_time_s": t["templates"],
          "templates_over_resident_remat": t["templates"] / t["remat"],
          "templates_resident_remat_step_time_s": t["remat"],
          **{f"{k}_scratch_bytes": v for k, v in scratch.items()
             if k.startswith("block_") or k == "tail"}}
