"""LoRA against training every weight: the step's time and the host's bytes."""

from __future__ import annotations

from typing import Any

from flax import nnx

from megatrain_jax.bench.host_memory import host_memory_run
from megatrain_jax.bench.suite import Suite
from megatrain_jax.bench.timing import median_times, synthetic_batch
from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.models.lora import LoraConfig
from megatrain_jax.models.llama import Llama
from megatrain_jax.optim import adamw
from megatrain_jax import lora

LORA_RANK = 16  # the common default, on every projection


def lora_ratios(s: Suite) -> dict[str, Any]:
  """The streaming step with LoRA adapters (rank `LORA_RANK`, every projection, the
  base frozen) over the step training every weight, on the benchmark model, timed
  side by side; and the host bytes per base parameter of a LoRA run on the
  host-memory model (bf16 base, peak RSS in a fresh process).

  Args:
    s: the sizes.

  Returns:
    "lora_over_full_step", the two step times, the d2h bytes of each step,
    "host_bytes_per_base_param_lora", and "host_bytes_per_base_param_lora_marginal":
    the peak RSS's growth per base parameter from that model to one with twice its
    layers.
  """
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  adapted = lambda: lora.apply(Llama(cfg, rngs=nnx.Rngs(0)), LoraConfig(rank=LORA_RANK),
                               rngs=nnx.Rngs(1))
  timed = lambda e: (lambda: (e.step(batch), e.wait()))
  with StreamingTrainer(Llama(cfg, rngs=nnx.Rngs(0)), adamw(1e-4), EngineConfig()) as full, \
       StreamingTrainer(adapted(), adamw(1e-4), EngineConfig(),
                        trainable=nnx.LoRAParam) as lo:
    t = median_times({"full": timed(full), "lora": timed(lo)}, s.warmup, s.reps, settle=2)
    d2h = {k: e.stats()["last_step"]["d2h_bytes"] for k, e in (("full", full), ("lora", lo))}
  rss = host_memory_run(s.rss_model, "auto", lora_rank=LORA_RANK)
  # The same with twice the layers: the difference is what each further base
  # parameter costs, without what a process holds whatever the model's size
  # (compiled programs, the allocator's pools).
  big = host_memory_run(s.rss_model, "auto", lora_rank=LORA_RANK, layer_factor=2)
  grown = (big["rss_peak_bytes"] - big["rss_baseline_bytes"]
           - rss["rss_peak_bytes"] + rss["rss_baseline_bytes"])
  return {
      "lora_over_full_step": t["lora"] / t["full"],
      "lora_step_time_s": t["lora"], "lora_full_step_time_s": t["full"],
      "lora_d2h_bytes_per_step": d2h["lora"], "lora_full_d2h_bytes_per_step": d2h["full"],
      "lora_rank": LORA_RANK,
      "host_bytes_per_base_param_lora": rss["host_bytes_per_param"],
      "host_bytes_per_base_param_lora_marginal":
          grown / (big["rss_param_count"] - rss["rss_param_count"]),
      "lora_rss_peak_bytes": rss["rss_peak_bytes"]}
