r"""GRPO on a verifiable task: two-digit addition, exact-match reward.

  python experiments/grpo.py                        # about 1.5 minutes on 2 CPU cores
  python experiments/grpo.py --seed=1 --workdir=runs/grpo_seed1
  python experiments/grpo.py --rollouts=rollouts.jsonl   # train on another program's
                                                         # rollouts instead of sampling

A small model is taught the task by supervised steps until 30% of its greedy
answers are right, then GRPO raises its reward (docs/rl.md gives the runs). Writes
<workdir>/metrics.jsonl (step 0: the supervised start; then one record per
iteration: reward_mean, reward_std, response_length, loss, clip_fraction, entropy,
kl with --kl_coef, and the held-out rewards every --eval_every) and
<workdir>/rewards.png.
"""

import dataclasses

from absl import app, flags

from megatrain_jax import grpo_addition

_DEFAULTS = grpo_addition.AdditionRun()
_FIELDS = {}
for _f in dataclasses.fields(grpo_addition.AdditionRun):
  _define = {int: flags.DEFINE_integer, float: flags.DEFINE_float,
             str: flags.DEFINE_string}[type(getattr(_DEFAULTS, _f.name))]
  _FIELDS[_f.name] = _define(_f.name, getattr(_DEFAULTS, _f.name),
                             f"AdditionRun.{_f.name} (see megatrain_jax/grpo_addition.py).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/grpo", "Where metrics.jsonl and rewards.png go.")
_ROLLOUTS = flags.DEFINE_string("rollouts", None, "Train on this rollouts file (JSON lines, "
                                "megatrain_jax/rollouts.py) instead of generating.")
_WRITE = flags.DEFINE_string("write_rollouts", None, "Also write the generated rollouts here.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = grpo_addition.AdditionRun(**{k: v.value for k, v in _FIELDS.items()})
  grpo_addition.run(config, _WORKDIR.value, _ROLLOUTS.value, _WRITE.value)


if __name__ == "__main__":
  app.run(main)
