"""GRPO: generate a group of completions per prompt, reward them, and take clipped
policy-gradient steps on them, with any trainer built with `loss=PolicyLoss(...)`.

`rollout` generates and rewards (with `mt.generate`); `train_on` takes one
iteration's steps on rollouts, wherever they came from (this process, or a file an
inference server wrote: `rollouts.read_jsonl`). The old policy's log-probs are the
trainer's own (`trainer.logprobs` before the first step of an iteration), the
reference's come from a second model (`ref`, e.g. the supervised start), so that
the KL penalty keeps the policy near it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from megatrain_jax.generation import generate
from megatrain_jax.rollouts import Rollout, policy_batch


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """One GRPO iteration's shape.

  Attributes:
    group_size: completions per prompt.
    max_new_tokens: the longest completion.
    temperature: sampling temperature of the rollouts.
    top_p: nucleus sampling of the rollouts.
    policy_steps: optimizer steps on each iteration's rollouts (1: on-policy; more
      reuse them, and the ratio to the old policy starts to clip).
    seq_len: tokens per training row (prompt + completion - 1, padded).
    eos_id: the token that ends a completion.
    pad_id: what pads a training row.
    scale_advantages: divide by each group's reward spread (GRPO; Dr. GRPO does not).
    generate_rows: rows per `mt.generate` call (None: all of an iteration's rows at
      once); fewer rows make a smaller KV cache (`experiments/plan.py --grpo` says
      where it fits).
  """

  group_size: int = 8
  max_new_tokens: int = 8
  temperature: float = 1.0
  top_p: float = 1.0
  policy_steps: int = 2
  seq_len: int = 16
  eos_id: int | None = None
  pad_id: int = 0
  scale_advantages: bool = True
  generate_rows: int | None = None


Reward = Callable[[Any, Sequence[int]], float]


def rollout(trainer, prompts: Sequence[Sequence[int]], problems: Sequence[Any],
            reward: Reward, config: GrpoConfig, key: jax.Array, first_group: int = 0
            ) -> list[Rollout]:
  """`group_size` sampled completions of each prompt, each rewarded.

  Args:
    trainer: the policy (any trainer `mt.generate` takes, or an `mt.Llama`).
    prompts: the prompts' token ids.
    problems: what `reward` checks a completion against, one per prompt.
    reward: `reward(problem, completion_ids) -> float`.
    config: the iteration's shape.
    key: the sampling key.
    first_group: the first prompt's group id.

  Returns:
    The rollouts, each prompt's group consecutive (group: first_group + the
    prompt's index).

  Raises:
    ValueError: prompts `mt.generate` refuses (see there).
  """
  rows = [p for p in prompts for _ in range(config.group_size)]
  step = config.generate_rows or len(rows)
  tokens, logprobs = [], []
  for start in range(0, len(rows), step):  # the call from row s draws with fold_in(key, s)
    out = generate(trainer, rows[start:start + step], config.max_new_tokens,
                   temperature=config.temperature, top_p=config.top_p,
                   key=jax.random.fold_in(key, start) if start else key,
                   eos_id=config.eos_id)
    tokens += out.tokens
    logprobs += out.logprobs
  g = config.group_size
  return [Rollout(tuple(rows[i]), tuple(toks), reward(problems[i // g], toks),
                  first_group + i // g, tuple(float(x) for x in logprobs[i]))
          for i, toks in enumerate(tokens)]


def train_on(trainer, rollouts: Sequence[Rollout], config: GrpoConfig,
             ref=None) -> dict[str, float]:
  """One iteration's policy-gradient steps on rollouts.

  Args:
    trainer: built with `loss=mt.rl.PolicyLoss(...)`.
    rollouts: the iteration's rollouts, in groups.
    config: the iteration's shape.
    ref: the reference for the KL penalty: a trainer (its `logprobs`), "base" for
      a LoRA policy's own frozen base (`trainer.logprobs(batch, adapters=False)`:
      no second copy of the weights), or None.

  Returns:
    The metrics: the rollouts' "reward_mean", "reward_std" and "response_length",
    and the steps' mean "loss", "clip_fraction", "entropy" (and "kl" with `ref`).

  Raises:
    ValueError: rollouts `rollouts.policy_batch` refuses, or a batch the trainer
      refuses (a trainer without a policy loss, a batch size grad_accum does not
      divide).
    FloatingPointError: a non-finite step (as `trainer.step`).
  """
  batch = policy_batch(rollouts, config.seq_len, config.pad_id, config.scale_advantages)
  batch["old_logprobs"] = trainer.logprobs(batch)
  if ref is not None:
    batch["ref_logprobs"] = (trainer.logprobs(batch, adapters=False) if ref == "base"
                             else ref.logprobs(batch))
  steps = [trainer.step(batch) for _ in range(config.policy_steps)]
  keys = [k for k in ("loss", "clip_fraction", "entropy", "kl") if k in steps[0]]
  rewards = np.array([r.reward for r in rollouts])
  return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
          "response_length": float(np.mean([len(r.completion_ids) for r in rollouts])),
          **{k: float(np.mean([s[k] for s in steps])) for k in keys}}


def evaluate(policy, prompts: Sequence[Sequence[int]], problems: Sequence[Any],
             reward: Reward, max_new_tokens: int, eos_id: int | None,
             key: jax.Array) -> dict[str, float]:
  """The policy's mean reward on held-out prompts: greedy, and one sample each.

  Args:
    policy: a trainer or model `mt.generate` takes.
    prompts: the prompts.
    problems: one per prompt, for `reward`.
    reward: as `rollout`.
    max_new_tokens: the longest completion.
    eos_id: the end token.
    key: the sampling key (fixed across evaluations: the same draws).

  Returns:
    {"eval_greedy_reward", "eval_sampled_reward"}.
  """
  out = {}
  for name, temperature in (("eval_greedy_reward", 0.0), ("eval_sampled_reward", 1.0)):
    gen = generate(policy, prompts, max_new_tokens, temperature=temperature, key=key,
                   eos_id=eos_id)
    out[name] = float(np.mean([reward(p, t) for p, t in zip(problems, gen.tokens)]))
  return out
