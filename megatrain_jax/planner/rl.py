"""What one GRPO iteration costs: generation, two log-prob passes, policy steps.

An iteration samples `group_size` completions of each of `prompts` prompts (R rows
of `prompt_len` + `completion_len` tokens), scores the old policy's and the
reference's log-probabilities (forward-only streamed passes), and takes
`policy_steps` optimizer steps on the R rows (the step's plan, `plan.plan`, with the
fewest micro-batches that fit). Generation is modelled as `mt.generate` runs it:

- resident when the compute-dtype weights fit the device (with 10% to spare): a
  decode step reads every weight and the cache from device memory once
  (`Hardware.memory_bytes_per_s`) or is bound by its matmuls, whichever is slower;
  the rows are decoded in as few batches as the memory left for their KV cache
  allows (each batch reads the weights again);
- streamed otherwise: every decode step moves the weights over the host link once
  for the whole batch of rows, with the KV cache on the device when it fits there,
  else in host memory (then it crosses the link at every step too).

The prompt's prefill is a forward over R x prompt_len tokens. Dispatch overheads,
sampling and rewards are left out: at these sizes they are small against the rest.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import optax

from megatrain_jax.metrics import model_flops_per_token
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.planner.hardware import Hardware
from megatrain_jax.planner.plan import largest_batch, plan


@dataclasses.dataclass(frozen=True)
class GrpoEstimate:
  """One iteration's predicted times (seconds) and how generation runs.

  Attributes:
    rows: completions per iteration.
    generation: how it runs: resident (in how many batches) or streamed (and where
      the KV cache is).
    generate_s: prefill and decoding.
    logprobs_s: the old policy's and the reference's forward passes.
    train_s: the policy steps.
    grad_accum: micro-batches per policy step.
    bottleneck: the policy step's bottleneck (`Plan.bottleneck`).
  """

  rows: int
  generation: str
  generate_s: float
  logprobs_s: float
  train_s: float
  grad_accum: int
  bottleneck: str

  @property
  def total_s(self) -> float:
    """The iteration."""
    return self.generate_s + self.logprobs_s + self.train_s

  def table(self) -> str:
    """The estimate as text rows.

    Returns:
      One line per figure.
    """
    rows = [("completions", str(self.rows)), ("generation", self.generation),
            ("generate", f"{self.generate_s:,.1f} s"),
            ("old + reference log-probs", f"{self.logprobs_s:,.1f} s"),
            ("policy steps", f"{self.train_s:,.1f} s (grad_accum {self.grad_accum}, "
             f"{self.bottleneck}-bound)"), ("iteration", f"{self.total_s:,.1f} s")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _forward_s(cfg: LlamaConfig, hw: Hardware, tokens: int, seq_len: int,
               weight_bytes: float, streamed: bool) -> float:
  """A forward pass over `tokens` tokens: its matmuls, or the weights' trip over
  the link when streamed, whichever is slower."""
  compute = tokens * model_flops_per_token(cfg, seq_len) / 3 / hw.flops_at(cfg.d_model)
  return max(compute, weight_bytes / hw.h2d_bytes_per_s if streamed else 0.0)


def grpo_iteration(cfg: LlamaConfig, optimizer: optax.GradientTransformation, ec,
                   hw: Hardware, prompts: int, group_size: int, prompt_len: int,
                   completion_len: int, policy_steps: int = 1, reference: bool = True
                   ) -> GrpoEstimate:
  """Predicts one GRPO iteration (see the module docstring).

  Args:
    cfg: the model.
    optimizer: the policy's transform (its state counts in the plan's host bytes).
    ec: the engine config of the policy steps (its grad_accum is chosen here).
    hw: the hardware.
    prompts: prompts per iteration.
    group_size: completions per prompt.
    prompt_len: tokens per prompt.
    completion_len: tokens per completion.
    policy_steps: optimizer steps per iteration.
    reference: score a reference model too (a KL penalty).

  Returns:
    The `GrpoEstimate`.

  Raises:
    ValueError: a profile without its device memory bandwidth, or rows of which not
      even one fits a policy step.
  """
  if not hw.memory_bytes_per_s:
    raise ValueError(f"The hardware profile {hw.name!r} states no device memory "
                     "bandwidth, which bounds decoding: choose one that does (h200, ...).")
  rows, seq_len = prompts * group_size, prompt_len + completion_len
  flops = hw.flops_at(cfg.d_model)
  itemsize = jnp.dtype(ec.compute_dtype).itemsize
  weights = cfg.param_count() * itemsize
  kv_row = seq_len * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize
  room = 0.9 * hw.device_bytes - weights  # for the KV cache beside resident weights
  resident = room > kv_row
  # Rows decoded together: as many as the cache's room holds (resident), or all.
  batch = min(rows, int(room // kv_row)) if resident else rows
  host_cache = not resident and rows * kv_row > 0.9 * hw.device_bytes
  decode = 0.0
  for t in range(prompt_len, seq_len):  # each new token reads the cache so far
    cache = batch * kv_row * t / seq_len
    if resident:
      link = (weights + cache) / hw.memory_bytes_per_s
    else:
      link = max(weights / hw.h2d_bytes_per_s + (cache / hw.h2d_bytes_per_s if host_cache
                                                 else 0.0), cache / hw.memory_bytes_per_s)
    decode += max(link, batch * model_flops_per_token(cfg, t) / 3 / flops)
  decode *= math.ceil(rows / batch)
  prefill = _forward_s(cfg, hw, rows * prompt_len, prompt_len, weights, not resident)
  passes = 2 if reference else 1
  logprobs = passes * _forward_s(cfg, hw, rows * seq_len, seq_len, weights, True)
  micro = largest_batch(cfg, ec, hw.device_bytes, seq_len, hw.flash_attention)
  if micro == 0:
    raise ValueError(f"Not one {seq_len}-token row of a policy step fits the device.")
  grad_accum = next(a for a in range(math.ceil(rows / micro), rows + 1) if rows % a == 0)
  step = plan(cfg, optimizer, dataclasses.replace(ec, grad_accum=grad_accum), hw, rows,
              seq_len)
  how = (f"resident, {math.ceil(rows / batch)} batch(es) of up to {batch} rows" if resident
         else f"streamed, KV cache in {'host memory' if host_cache else 'device memory'}")
  return GrpoEstimate(rows, how, prefill + decode,
                      logprobs, policy_steps * step.step_s, grad_accum, step.bottleneck)
