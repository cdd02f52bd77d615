"""What one GRPO iteration costs: generation, two log-prob passes, policy steps.

An iteration samples `group_size` completions of each of `prompts` prompts (R rows
of `prompt_len` + `completion_len` tokens), scores the old policy's and the
reference's log-probabilities (forward-only streamed passes), and takes
`policy_steps` optimizer steps on the R rows (the step's plan, `plan.plan`, with the
fewest micro-batches that fit). Generation is modelled as `mt.generate` runs it, all
`generate_rows` rows per call (all of them by default), with
`models.decode.placement` choosing where the weights and the
KV cache live on the device:

- resident weights: a decode step reads every weight from device memory
  (`Hardware.memory_bytes_per_s`);
- streamed weights: a decode step moves every layer over the host link;
- the cache on the device is read whole at each step (the attention scores every
  slot of its capacity, masking the ones not yet written); a cache in host memory
  also crosses the link both ways at each step.

A step takes the longest of its link time, its memory time and its matmuls. The
prompt's prefill is a forward over R x prompt_len tokens. Dispatch overheads,
sampling and rewards are left out: at these sizes they are small against the rest.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import optax

from megatrain_jax.metrics import model_flops_per_token
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.decode import placement
from megatrain_jax.planner.hardware import Hardware
from megatrain_jax.planner.plan import largest_batch, plan


@dataclasses.dataclass(frozen=True)
class GrpoEstimate:
  """One iteration's predicted times (seconds) and how generation runs.

  Attributes:
    rows: completions per iteration.
    generation: where the weights and the KV cache are while it runs.
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
                   completion_len: int, policy_steps: int = 1, reference: bool = True,
                   generate_rows: int | None = None) -> GrpoEstimate:
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
    generate_rows: rows per `mt.generate` call (`GrpoConfig.generate_rows`; None:
      all of them in one).

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
  batch = min(generate_rows or rows, rows)
  calls = math.ceil(rows / batch)
  flops = hw.flops_at(cfg.d_model)
  weights = cfg.param_count() * jnp.dtype(ec.compute_dtype).itemsize
  cache = batch * seq_len * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * \
      jnp.dtype(ec.compute_dtype).itemsize
  streamed, kv_cache = placement(cfg, ec.compute_dtype, batch, seq_len, hw.device_bytes)
  h2d = (weights if streamed else 0.0) + (cache if kv_cache == "host" else 0.0)
  d2h = cache if kv_cache == "host" else 0.0
  memory = (0.0 if streamed else weights) + cache
  link = max(h2d / hw.h2d_bytes_per_s, d2h / hw.d2h_bytes_per_s, memory / hw.memory_bytes_per_s)
  decode = calls * sum(max(link, batch * model_flops_per_token(cfg, t) / 3 / flops)
                       for t in range(prompt_len, seq_len))
  prefill = _forward_s(cfg, hw, rows * prompt_len, prompt_len, weights, streamed)
  passes = 2 if reference else 1
  logprobs = passes * _forward_s(cfg, hw, rows * seq_len, seq_len, weights, True)
  micro = largest_batch(cfg, ec, hw.device_bytes, seq_len, hw.flash_attention)
  if micro == 0:
    raise ValueError(f"Not one {seq_len}-token row of a policy step fits the device.")
  grad_accum = next(a for a in range(math.ceil(rows / micro), rows + 1) if rows % a == 0)
  step = plan(cfg, optimizer, dataclasses.replace(ec, grad_accum=grad_accum), hw, rows,
              seq_len)
  how = (f"{calls} call(s) of {batch} rows; {'streamed' if streamed else 'resident'} "
         f"weights, KV cache in {kv_cache} memory")
  return GrpoEstimate(rows, how, prefill + decode,
                      logprobs, policy_steps * step.step_s, grad_accum, step.bottleneck)
