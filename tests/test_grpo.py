"""Rollouts files, policy batches, and the GRPO loop (`mt.rollouts`, `mt.grpo`,
experiments/grpo.py)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import megatrain_jax as mt
from megatrain_jax import grpo, rollouts
from megatrain_jax.data import addition

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = mt.LlamaConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     d_ff=64, max_seq_len=16)


def _write(path, lines):
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


@pytest.mark.parametrize("line, message", [
    ('[1, 2]', "a rollout is a JSON object"),
    ('{"prompt_ids": [1], "reward": 1}', r"missing \['completion_ids'\]"),
    ('{"prompt_ids": [], "completion_ids": [2], "reward": 1}', "'prompt_ids' must be a non-empty"),
    ('{"prompt_ids": [1], "completion_ids": [2.5], "reward": 1}', "'completion_ids' must be"),
    ('{"prompt_ids": [1], "completion_ids": [2], "reward": NaN}', "'reward' must be a finite"),
    ('{"prompt_ids": [1], "completion_ids": [2], "reward": "1"}', "'reward' must be a finite"),
    ('{"prompt_ids": [1], "completion_ids": [2, 3], "reward": 1, "logprobs": [-1]}',
     "one number per completion token"),
    ('{"prompt_ids": [1]', "not valid JSON"),
    ('{"prompt_ids": [4294967296], "completion_ids": [2], "reward": 1}', "2\\*\\*31"),
    ('{"prompt_ids": [1], "completion_ids": [2], "reward": 1e400}', "'reward' must be"),
    ('{"prompt_ids": [1], "completion_ids": [2], "reward": 1, "logprobs": ["a"]}',
     "finite numbers <= 0"),
    ('{"prompt_ids": [1], "completion_ids": [2], "reward": 1, "group": {"a": 1}}',
     "'group' must be a string or a number"),
])
def test_a_bad_rollout_line_is_named_by_its_number(tmp_path, line, message):
  good = '{"prompt_ids": [1], "completion_ids": [2], "reward": 0.5}'
  path = str(tmp_path / "r.jsonl")
  _write(path, [good, "", line])
  with pytest.raises(ValueError, match=f"r.jsonl:3: .*{message}"):
    rollouts.read_jsonl(path)


def test_rollouts_round_trip_and_group_by_prompt_or_by_name(tmp_path):
  rs = [rollouts.Rollout((1, 2), (3,), 1.0, None, (-0.5,)),
        rollouts.Rollout((1, 2), (4, 5), 0.0),
        rollouts.Rollout((7,), (3,), 1.0, "g1"),
        rollouts.Rollout((7,), (4,), 0.0, "g1", extra={"text": "3"})]
  path = str(tmp_path / "r.jsonl")
  rollouts.write_jsonl(path, rs[:2])
  rollouts.write_jsonl(path, rs[2:], append=True)
  back = rollouts.read_jsonl(path)
  assert back == rs and back[3].extra == {"text": "3"}
  assert [len(g) for g in rollouts.groups(back)] == [2, 2]


def test_a_policy_batch_masks_completions_and_normalizes_within_groups():
  rs = [rollouts.Rollout((1, 2, 3), (4, 5), 1.0, "a"),
        rollouts.Rollout((1, 2, 3), (6,), 0.0, "a"),
        rollouts.Rollout((9,), (4, 5, 6), 2.0, "b"),
        rollouts.Rollout((9,), (4,), 5.0, "b"),
        rollouts.Rollout((9,), (5,), 5.0, "b")]
  b = rollouts.policy_batch(rs, seq_len=6, pad_id=0)
  np.testing.assert_array_equal(b["input_ids"][0], [1, 2, 3, 4, 5, 0])
  np.testing.assert_array_equal(b["labels"][0], [2, 3, 4, 5, 0, 0])
  np.testing.assert_array_equal(b["loss_mask"][0], [0, 0, 1, 1, 0, 0])  # predict 4, 5
  np.testing.assert_array_equal(b["loss_mask"][2], [1, 1, 1, 0, 0, 0])
  adv = b["advantages"].sum(1) / b["loss_mask"].sum(1)
  want_b = (np.array([2.0, 5.0, 5.0]) - 4.0) / (np.std([2.0, 5, 5], ddof=1) + 1e-4)
  np.testing.assert_allclose(adv, [0.7070, -0.7070, *want_b], atol=1e-3)
  assert np.all(b["advantages"][b["loss_mask"] == 0] == 0)
  with pytest.raises(ValueError, match="exceed seq_len"):
    rollouts.policy_batch(rs, seq_len=3)
  with pytest.raises(ValueError, match="group 'a' already holds another prompt"):
    rollouts.policy_batch(rs + [rollouts.Rollout((5,), (6,), 1.0, "a")], seq_len=6)


def test_policy_steps_move_probability_toward_rewarded_completions():
  """The point of the loop: after train_on, completions with a positive advantage
  are likelier and those with a negative one less likely."""
  tx = optax.adam(1e-2)
  config = grpo.GrpoConfig(group_size=4, max_new_tokens=4, policy_steps=3, seq_len=12,
                           eos_id=addition.EOS, pad_id=addition.PAD)
  pairs = [(12, 34), (5, 7)]
  reward = lambda pair, toks: float(len(toks) > 0 and toks[0] % 2 == 0)  # learnable
  with mt.StreamingTrainer.from_config(CFG, tx, mt.EngineConfig(), key=jax.random.key(0),
                                       loss=mt.rl.PolicyLoss()) as policy:
    rs = grpo.rollout(policy, [addition.prompt(*p) for p in pairs], pairs, reward, config,
                      jax.random.key(1))
    assert len(rs) == 8 and 0 < np.mean([r.reward for r in rs]) < 1
    batch = rollouts.policy_batch(rs, config.seq_len, config.pad_id)
    # The generator's log-probs are the trainer's own.
    before = policy.logprobs(batch)
    np.testing.assert_allclose((before * batch["loss_mask"]).sum(1),
                               [sum(r.logprobs) for r in rs], atol=1e-4)
    out = grpo.train_on(policy, rs, config)
    after = policy.logprobs(batch)
  assert out["reward_mean"] == np.mean([r.reward for r in rs]) and np.isfinite(out["loss"])
  moved = ((after - before) * batch["loss_mask"]).sum(1)
  adv = batch["advantages"].sum(1)
  assert np.all(moved[adv > 0] > 0) and np.all(moved[adv < 0] < 0), (moved, adv)


TINY_RUN = ["--d_model=32", "--sft_max_steps=20", "--sft_target=2", "--eval_problems=8",
            "--prompts_per_iteration=2", "--group_size=4", "--eval_every=1"]


def _grpo(workdir, *flags):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, os.path.join(REPO, "experiments", "grpo.py"),
                  f"--workdir={workdir}", *TINY_RUN, *flags], check=True, env=env,
                 cwd=REPO, capture_output=True, timeout=300)
  return mt.metrics.read_metrics(os.path.join(workdir, "metrics.jsonl"))


def test_a_rollouts_file_trains_as_the_rollouts_it_holds(tmp_path):
  """A run that wrote its rollouts, and a run that trains on that file, take the
  same steps; and a file another program wrote (extra keys, its own group names,
  groups of different sizes) trains and is scored as its rewards say."""
  made = str(tmp_path / "made.jsonl")
  live = _grpo(tmp_path / "live", "--iterations=2", f"--write_rollouts={made}")
  replay = _grpo(tmp_path / "replay", f"--rollouts={made}")
  assert [r["step"] for r in replay] == [0, 1, 2]
  for a, b in zip(live, replay):
    for k in ("loss", "reward_mean", "clip_fraction", "entropy", "eval_greedy_reward"):
      assert a.get(k) == b.get(k), k
  assert os.path.exists(tmp_path / "replay" / "rewards.png")

  other = str(tmp_path / "server.jsonl")
  script = (
      "import json, random\n"
      "random.seed(0)\n"
      "with open(%r, 'w') as f:\n"
      "  for g in range(3):\n"
      "    for k in range(2 + g):\n"
      "      toks = [random.randrange(10) for _ in range(random.randrange(1, 4))] + [13]\n"
      "      f.write(json.dumps({'prompt_ids': [12, 1, 10, g, 11], 'completion_ids': toks,\n"
      "                          'reward': float(k %% 2), 'group': 'q%%d' %% g,\n"
      "                          'text': 'ignored', 'logprobs': [-1.0] * len(toks)}) + '\\n')\n"
  ) % other
  subprocess.run([sys.executable, "-c", script], check=True)
  with open(other, encoding="utf-8") as f:
    lines = [json.loads(x) for x in f]
  recs = _grpo(tmp_path / "server", f"--rollouts={other}")
  assert [r["step"] for r in recs] == [0, 1, 2]  # 3 groups, 2 per iteration
  assert recs[1]["reward_mean"] == np.mean([x["reward"] for x in lines[:5]])
  assert all(np.isfinite(r["loss"]) for r in recs[1:])


def test_rollouts_generated_in_several_calls_equal_one_call_when_greedy():
  config = grpo.GrpoConfig(group_size=3, max_new_tokens=4, temperature=0.0,
                           eos_id=addition.EOS)
  pairs = [(12, 34), (5, 7)]
  prompts = [addition.prompt(*p) for p in pairs]
  with mt.StreamingTrainer.from_config(CFG, optax.sgd(0.0), mt.EngineConfig(),
                                       key=jax.random.key(0)) as policy:
    whole = grpo.rollout(policy, prompts, pairs, addition.reward, config, jax.random.key(1))
    split = grpo.rollout(policy, prompts, pairs, addition.reward,
                         grpo.GrpoConfig(**{**config.__dict__, "generate_rows": 4}),
                         jax.random.key(1))
  assert split == whole and len(whole) == 6
