"""Rollouts: completions with rewards, from this process or from an inference server.

A rollouts file is JSON lines, one completion per line:

  {"prompt_ids": [12, 1, 10, 2, 11], "completion_ids": [3, 13], "reward": 1.0,
   "group": "p17", "logprobs": [-0.01, -0.2]}

"prompt_ids" and "completion_ids" are token ids (non-empty lists of ints), "reward" a
finite number; "group" (any JSON scalar) names the prompt a completion answers, so
that GRPO can normalize rewards within it (absent: the line's prompt ids are the
group); "logprobs" (optional) are the generator's log-probabilities of the
completion's tokens, kept for comparison (the trainer scores its own old policy).
Any other key is kept in `Rollout.extra` and otherwise ignored, so vLLM or SGLang
output needs only its ids renamed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Hashable, Iterable, Sequence

import numpy as np
from absl import logging

from megatrain_jax.data.corpus import jsonl_records
from megatrain_jax.models.policy import group_advantages

_KNOWN = ("prompt_ids", "completion_ids", "reward", "group", "logprobs")


@dataclasses.dataclass(frozen=True)
class Rollout:
  """One completion of one prompt, and its reward.

  Attributes:
    prompt_ids: the prompt's token ids.
    completion_ids: the completion's (an EOS token included, if it ended so).
    reward: its reward.
    group: the prompt it answers (None: its prompt ids).
    logprobs: the generator's log-probability of each completion token, or None.
    extra: the file's other keys.
  """

  prompt_ids: tuple[int, ...]
  completion_ids: tuple[int, ...]
  reward: float
  group: Hashable | None = None
  logprobs: tuple[float, ...] | None = None
  extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

  @property
  def group_key(self) -> Hashable:
    """The group it belongs to: `group`, or its prompt ids."""
    return self.prompt_ids if self.group is None else self.group

  def to_json(self) -> dict[str, Any]:
    """The file's line for it.

    Returns:
      A JSON-ready dict.
    """
    out = {"prompt_ids": list(self.prompt_ids), "completion_ids": list(self.completion_ids),
           "reward": self.reward, **self.extra}
    if self.group is not None:
      out["group"] = self.group
    if self.logprobs is not None:
      out["logprobs"] = list(self.logprobs)
    return out


def _ids(value, where: str, key: str) -> tuple[int, ...]:
  if (not isinstance(value, list) or not value or not all(
      isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in value)):
    raise ValueError(f"{where}: {key!r} must be a non-empty list of token ids (ints in "
                     "[0, 2**31)).")
  return tuple(value)


def _number(value) -> float | None:
  """A finite float, or None."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  try:
    x = float(value)
  except OverflowError:
    return None
  return x if np.isfinite(x) else None


def parse(record: Any, where: str = "rollout") -> Rollout:
  """A `Rollout` from one decoded JSON line.

  Args:
    record: the decoded line.
    where: names the line in errors (e.g. "file.jsonl:3").

  Returns:
    The rollout.

  Raises:
    ValueError: not an object, a missing key, ids that are not non-empty lists of
      non-negative ints, a reward that is not a finite number, logprobs that are not
      one finite number <= 0 per completion token, or a group that is not a string
      or a number.
  """
  if not isinstance(record, dict):
    raise ValueError(f"{where}: a rollout is a JSON object, got {type(record).__name__}.")
  missing = [k for k in _KNOWN[:3] if k not in record]
  if missing:
    raise ValueError(f"{where}: missing {missing}; a rollout has {list(_KNOWN[:3])} and "
                     f"optionally {list(_KNOWN[3:])}.")
  prompt = _ids(record["prompt_ids"], where, "prompt_ids")
  completion = _ids(record["completion_ids"], where, "completion_ids")
  reward = _number(record["reward"])
  if reward is None:
    raise ValueError(f"{where}: 'reward' must be a finite number, got {record['reward']!r}.")
  logprobs = record.get("logprobs")
  if logprobs is not None:
    if not isinstance(logprobs, list) or len(logprobs) != len(completion):
      raise ValueError(f"{where}: 'logprobs' must list one number per completion token "
                       f"({len(completion)}).")
    logprobs = tuple(_number(x) for x in logprobs)
    if any(x is None or x > 0 for x in logprobs):
      raise ValueError(f"{where}: 'logprobs' must be finite numbers <= 0.")
  group = record.get("group")
  if group is not None and (isinstance(group, bool) or not isinstance(group, (str, int, float))):
    raise ValueError(f"{where}: 'group' must be a string or a number, got {group!r}.")
  return Rollout(prompt, completion, reward, group, logprobs,
                 {k: v for k, v in record.items() if k not in _KNOWN})


def read_jsonl(path: str) -> list[Rollout]:
  """Reads a rollouts file.

  Args:
    path: the JSON-lines file.

  Returns:
    Its rollouts, in order (blank lines skipped).

  Raises:
    ValueError: a line that is not JSON or not a rollout (`parse`), named by its
      number; an empty file.
  """
  out = [parse(record, where) for where, record in jsonl_records(path)]
  if not out:
    raise ValueError(f"{path} holds no rollout.")
  return out


def write_jsonl(path: str, rollouts: Iterable[Rollout], append: bool = False) -> None:
  """Writes rollouts as a file `read_jsonl` reads.

  Args:
    path: the file.
    rollouts: the rollouts.
    append: add them after the file's lines (else the file is replaced).
  """
  with open(path, "a" if append else "w", encoding="utf-8") as f:
    for r in rollouts:
      f.write(json.dumps(r.to_json()) + "\n")


def groups(rollouts: Sequence[Rollout]) -> list[list[Rollout]]:
  """The rollouts grouped by prompt, in order of first appearance.

  Args:
    rollouts: the rollouts.

  Returns:
    One list per group.

  Raises:
    ValueError: a group name shared by different prompts (a server's batch-local
      names reused across batches would merge unrelated groups).
  """
  by_key: dict[Hashable, list[Rollout]] = {}
  for i, r in enumerate(rollouts):
    g = by_key.setdefault(r.group_key, [])
    if g and g[0].prompt_ids != r.prompt_ids:
      raise ValueError(f"Rollout {i}: group {r.group_key!r} already holds another prompt; "
                       "a group is the completions of one prompt: name groups uniquely.")
    g.append(r)
  return list(by_key.values())


def policy_batch(rollouts: Sequence[Rollout], seq_len: int, pad_id: int = 0,
                 scale: bool = True) -> dict[str, np.ndarray]:
  """A policy-gradient batch: each rollout a row, the loss on its completion.

  Row r holds prompt + completion, shifted as every batch is (labels are the next
  tokens), padded to `seq_len`; the mask covers the positions whose label is a
  completion token, and their advantage is the rollout's group-normalized reward
  (`group_advantages`, within each group, whatever its size).

  Args:
    rollouts: the rollouts, in groups (`groups`) or not.
    seq_len: tokens per row.
    pad_id: what pads a row.
    scale: divide by each group's standard deviation (GRPO; not in Dr. GRPO).

  Returns:
    {"input_ids", "labels", "loss_mask", "advantages"}, [len(rollouts), seq_len].

  Raises:
    ValueError: no rollouts, a prompt + completion longer than seq_len + 1, or a
      group name shared by different prompts.
  """
  if not rollouts:
    raise ValueError("No rollouts to train on.")
  adv, alone = {}, 0
  for g in groups(rollouts):
    alone += len(g) == 1
    for r, a in zip(g, group_advantages([r.reward for r in g], len(g), scale=scale)):
      adv[id(r)] = a
  if alone:
    logging.warning("%d group(s) of a single completion: their advantage is 0, so they "
                    "train nothing (GRPO compares completions of one prompt).", alone)
  b = len(rollouts)
  ids = np.full((b, seq_len + 1), pad_id, np.int32)
  mask = np.zeros((b, seq_len), np.float32)
  advantages = np.zeros((b, seq_len), np.float32)
  for row, r in enumerate(rollouts):
    p, c = len(r.prompt_ids), len(r.completion_ids)
    if p + c > seq_len + 1:
      raise ValueError(f"Rollout {row}: prompt ({p}) + completion ({c}) tokens exceed "
                       f"seq_len + 1 = {seq_len + 1}; raise seq_len.")
    ids[row, :p + c] = r.prompt_ids + r.completion_ids
    mask[row, p - 1:p + c - 1] = 1.0
    advantages[row] = adv[id(r)] * mask[row]
  return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask,
          "advantages": advantages}
