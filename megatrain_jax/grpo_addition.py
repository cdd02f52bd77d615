"""GRPO on the addition task, start to end: the run experiments/grpo.py launches.

A small model is first taught the task by supervised fine-tuning until its greedy
answers reach `sft_target` exact-match on held-out problems (the supervised start);
then GRPO iterations each sample `group_size` completions of
`prompts_per_iteration` new problems with the streaming trainer, reward them, and
take `policy_steps` clipped policy-gradient steps. Or, with a rollouts file, the
iterations train on the file's groups instead of generating (`rollouts`). Every
`eval_every` iterations the policy answers `eval_problems` held-out problems,
greedily and sampled once; each record goes to metrics.jsonl, and rewards.png
plots them.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np
import optax
from absl import logging

from megatrain_jax import grpo, metrics, rollouts as rollouts_lib
from megatrain_jax.data import addition
from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.models.policy import PolicyLoss


@dataclasses.dataclass(frozen=True)
class AdditionRun:
  """Everything a run depends on (with the seed, it fixes the run).

  Attributes:
    seed: the model's initialization, the problems and the sampling.
    d_model: the model's width (2 layers of it).
    n_layers: its depth.
    sft_lr: the supervised phase's Adam learning rate.
    sft_batch: its batch size.
    sft_target: it stops once the greedy exact-match on 64 held-out problems
      reaches this (checked every 20 steps)...
    sft_max_steps: ... or after this many steps.
    iterations: GRPO iterations.
    prompts_per_iteration: new problems per iteration.
    group_size: completions per problem.
    policy_steps: optimizer steps per iteration.
    lr: the policy's Adam learning rate.
    kl_coef: the KL penalty to the supervised start (0: none, and no reference).
    clip_eps_low: the ratio's lower clip.
    clip_eps_high: its upper clip.
    aggregation: the loss's aggregation (`mt.rl.AGGREGATIONS`).
    temperature: the rollouts' sampling temperature.
    eval_every: iterations between evaluations.
    eval_problems: held-out problems per evaluation.
  """

  seed: int = 0
  d_model: int = 64
  n_layers: int = 2
  sft_lr: float = 3e-3
  sft_batch: int = 64
  sft_target: float = 0.3
  sft_max_steps: int = 3000
  iterations: int = 300
  prompts_per_iteration: int = 16
  group_size: int = 8
  policy_steps: int = 2
  lr: float = 3e-4
  kl_coef: float = 0.0
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.28
  aggregation: str = "sequence_mean"
  temperature: float = 1.0
  eval_every: int = 10
  eval_problems: int = 256

  @property
  def model(self) -> LlamaConfig:
    """The model: the task's 16-token vocabulary, rows of `SEQ_LEN` tokens."""
    return LlamaConfig(vocab_size=addition.VOCAB_SIZE, d_model=self.d_model,
                       n_layers=self.n_layers, n_heads=4, n_kv_heads=4,
                       d_ff=4 * self.d_model, max_seq_len=SEQ_LEN + 1)

  @property
  def grpo(self) -> grpo.GrpoConfig:
    """An iteration's shape."""
    return grpo.GrpoConfig(group_size=self.group_size, max_new_tokens=MAX_NEW_TOKENS,
                           temperature=self.temperature, policy_steps=self.policy_steps,
                           seq_len=SEQ_LEN, eos_id=addition.EOS, pad_id=addition.PAD)


SEQ_LEN = 10  # <bos>99+99= and 891<eos>, shifted
MAX_NEW_TOKENS = 4


class _Problems:
  """A fixed set of held-out problems and their prompts."""

  def __init__(self, seed: int, n: int):
    self.pairs = addition.problems(np.random.default_rng(10_000 + seed), n)
    self.prompts = [addition.prompt(a, b) for a, b in self.pairs]

  def evaluate(self, policy, key) -> dict[str, float]:
    return grpo.evaluate(policy, self.prompts, self.pairs, addition.reward, MAX_NEW_TOKENS,
                         addition.EOS, key)


def supervised_start(run: AdditionRun) -> tuple[StreamingTrainer, int]:
  """Trains a fresh model on the task until `sft_target` (or `sft_max_steps`).

  Args:
    run: the run.

  Returns:
    (the trainer, the steps it took).
  """
  rng, check = np.random.default_rng(run.seed), _Problems(run.seed + 1, 64)
  sft = StreamingTrainer.from_config(run.model, optax.adam(run.sft_lr), EngineConfig(),
                                     key=jax.random.key(run.seed))
  for step in range(1, run.sft_max_steps + 1):
    out = sft.step(addition.sft_batch(rng, run.sft_batch, SEQ_LEN))
    if step % 20 == 0:
      greedy = check.evaluate(sft, jax.random.key(0))["eval_greedy_reward"]
      logging.info("supervised step %d: loss %.3f, greedy exact-match %.3f", step,
                   out["loss"], greedy)
      if greedy >= run.sft_target:
        return sft, step
  logging.warning("The supervised phase ended at sft_max_steps=%d below sft_target=%.2f.",
                  run.sft_max_steps, run.sft_target)
  return sft, run.sft_max_steps


def run(config: AdditionRun, workdir: str, rollouts_path: str | None = None,
        write_rollouts: str | None = None) -> list[dict[str, Any]]:
  """The whole run: supervised start, then GRPO; records to `workdir`.

  Args:
    config: the run.
    workdir: where metrics.jsonl and rewards.png go.
    rollouts_path: train on this rollouts file's groups, `prompts_per_iteration` of
      them per iteration, instead of generating (None: generate).
    write_rollouts: also write every generated rollout to this file.

  Returns:
    The records written: step 0 is the supervised start's evaluation.

  Raises:
    ValueError: a bad rollouts file (`rollouts.read_jsonl`).
  """
  t0 = time.perf_counter()
  from_file = rollouts_lib.read_jsonl(rollouts_path) if rollouts_path else None
  sft, sft_steps = supervised_start(config)
  policy_loss = PolicyLoss(config.clip_eps_low, config.clip_eps_high, config.kl_coef,
                           config.aggregation, max_tokens=MAX_NEW_TOKENS)
  policy = StreamingTrainer.from_units(
      config.model, optax.adam(config.lr), EngineConfig(),
      (sft.unit_params(u) for u in range(config.n_layers + 2)), loss=policy_loss)
  ref = sft if config.kl_coef else None
  if ref is None:
    sft.close()
  held_out, key = _Problems(config.seed, config.eval_problems), jax.random.key(config.seed)
  rng = np.random.default_rng(config.seed + 2)
  batches = _file_batches(from_file, config.prompts_per_iteration) if from_file else None
  iterations = len(batches) if batches else config.iterations
  written = []
  with metrics.MetricsWriter(workdir) as out:
    def record(rec):
      rec["time_s"] = time.perf_counter() - t0
      out.write(rec)
      written.append(rec)

    record({"step": 0, "sft_steps": sft_steps, **held_out.evaluate(policy, key)})
    logging.info("supervised start after %d steps: %s", sft_steps, written[-1])
    for it in range(1, iterations + 1):
      if batches:
        batch = batches[it - 1]
      else:
        pairs = addition.problems(rng, config.prompts_per_iteration)
        batch = grpo.rollout(policy, [addition.prompt(a, b) for a, b in pairs], pairs,
                             addition.reward, config.grpo, jax.random.fold_in(key, it),
                             first_group=(it - 1) * config.prompts_per_iteration)
        if write_rollouts:
          rollouts_lib.write_jsonl(write_rollouts, batch, append=it > 1)
      rec = {"step": it, **grpo.train_on(policy, batch, config.grpo, ref)}
      if it % config.eval_every == 0 or it == iterations:
        rec.update(held_out.evaluate(policy, key))
        logging.info("iteration %d: %s", it, {k: round(v, 3) for k, v in rec.items()})
      record(rec)
  for trainer in (policy, ref):
    if trainer is not None:
      trainer.close()
  metrics.plot_series(written, {"rollouts": "reward_mean", "held out, greedy":
                                "eval_greedy_reward", "held out, sampled":
                                "eval_sampled_reward"},
                      os.path.join(workdir, "rewards.png"), "mean reward",
                      "GRPO on two-digit addition")
  return written


def _file_batches(rollouts: list[rollouts_lib.Rollout], groups_per_batch: int
                  ) -> list[list[rollouts_lib.Rollout]]:
  """A file's rollouts as iterations of whole groups."""
  groups = rollouts_lib.groups(rollouts)
  return [[r for g in groups[i:i + groups_per_batch] for r in g]
          for i in range(0, len(groups), groups_per_batch)]

