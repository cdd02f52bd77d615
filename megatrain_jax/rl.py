"""Reinforcement-learning fine-tuning: GRPO's loss, advantages and rollouts.

`PolicyLoss` goes to a trainer as `loss=` (both trainers take it); its batch adds
"advantages", "old_logprobs" and "ref_logprobs" ([B, T]) to the usual keys
(`models.policy` has the formulas). `group_advantages` normalizes rewards within
each prompt's group. docs/rl.md walks through a whole GRPO loop
(experiments/grpo.py).
"""

from megatrain_jax.models.policy import (AGGREGATIONS, POLICY_KEYS, PolicyLoss, batch_loss,
                                         group_advantages)

__all__ = ["AGGREGATIONS", "POLICY_KEYS", "PolicyLoss", "batch_loss", "group_advantages"]
