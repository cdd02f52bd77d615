"""A verifiable task small enough for a CPU: add two numbers, answer exactly.

A prompt is "<bos>aa+bb=" (two digits each) and the answer the sum's three digits,
lowest first, then <eos> ("07+45=" -> "250<eos>"), over a 16-token vocabulary (the
ten digits, "+", "=", <bos>, <eos>, <pad>). The reward of a completion is 1 when it
spells the sum and stops, else 0 (`reward`). `sft_batch` gives supervised batches
(the loss on the answer only), which teach a small model the task part of the way,
so that policy-gradient fine-tuning has a reward to raise.
"""

from __future__ import annotations

import numpy as np

DIGITS = "0123456789"
PLUS, EQUALS, BOS, EOS, PAD = 10, 11, 12, 13, 14
VOCAB_SIZE = 16  # one spare id
_CHARS = {**{c: i for i, c in enumerate(DIGITS)}, "+": PLUS, "=": EQUALS}


def encode(text: str) -> list[int]:
  """Token ids of a string of digits, "+" and "=".

  Args:
    text: e.g. "12+34=".

  Returns:
    Its ids.

  Raises:
    ValueError: a character outside the task's alphabet.
  """
  bad = sorted(set(text) - set(_CHARS))
  if bad:
    raise ValueError(f"The addition task spells only digits, '+' and '='; got {bad}.")
  return [_CHARS[c] for c in text]


def decode(ids) -> str:
  """The text of token ids (<bos>, <eos> and <pad> left out).

  Args:
    ids: token ids.

  Returns:
    The string.
  """
  names = {v: k for k, v in _CHARS.items()}
  return "".join(names.get(int(i), "") for i in ids)


def problems(rng: np.random.Generator, n: int) -> np.ndarray:
  """Random operand pairs, each 0-99.

  Args:
    rng: the generator.
    n: how many.

  Returns:
    int [n, 2].
  """
  return rng.integers(0, 100, (n, 2))


def prompt(a: int, b: int) -> list[int]:
  """The prompt "<bos>aa+bb=", each operand in two digits ("07").

  Args:
    a: the first operand, 0-99.
    b: the second.

  Returns:
    Its ids.
  """
  return [BOS, *encode(f"{a:02d}+{b:02d}=")]


def answer(a: int, b: int) -> list[int]:
  """The right completion: the sum's three digits lowest first ("250" for 7 + 45,
  the order a carry is worked out in), then <eos>.

  Args:
    a: the first operand.
    b: the second.

  Returns:
    Its ids.
  """
  return [*encode(f"{a + b:03d}"[::-1]), EOS]


def reward(pair, completion) -> float:
  """1.0 when the completion is exactly the sum followed by <eos>, else 0.0.

  Args:
    pair: (a, b).
    completion: the generated ids.

  Returns:
    The reward.
  """
  return float(list(map(int, completion)) == answer(*map(int, pair)))


def sft_batch(rng: np.random.Generator, batch_size: int, seq_len: int
              ) -> dict[str, np.ndarray]:
  """A supervised batch: prompt and answer, the loss on the answer's tokens.

  Args:
    rng: the generator.
    batch_size: rows.
    seq_len: tokens per row (padded with <pad>).

  Returns:
    {"input_ids", "labels", "loss_mask"}, [batch_size, seq_len].

  Raises:
    ValueError: `seq_len` too short for a problem (10 tokens).
  """
  need = len(prompt(0, 0)) + len(answer(0, 0)) - 1
  if seq_len < need:
    raise ValueError(f"seq_len={seq_len} cannot hold a problem: it needs {need}.")
  ids = np.full((batch_size, seq_len + 1), PAD, np.int32)
  mask = np.zeros((batch_size, seq_len), np.float32)
  for r, (a, b) in enumerate(problems(rng, batch_size)):
    p, c = prompt(a, b), answer(a, b)
    ids[r, :len(p) + len(c)] = p + c
    mask[r, len(p) - 1:len(p) + len(c) - 1] = 1.0  # the positions that predict the answer
  return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask}
