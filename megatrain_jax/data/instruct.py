"""Instruction data: alpaca and sharegpt records, as masked training sequences.

Every record becomes a conversation, a list of {"role", "content"} messages
with roles system / user / assistant:

  alpaca    {"instruction", "input" (optional), "output", "system" (optional)}
  sharegpt  {"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}
            or OpenAI-style {"messages": [{"role", "content"}, ...]}

in a JSON file (a list of records) or JSONL (one per line). The loss is on every
assistant turn of a conversation (not only the last), and on nothing else: the
prompt, the other roles and the template's markup around them are masked. One
conversation is one sequence padded to `seq_len + 1`, or, packed (`pack=True`),
several conversations share a sequence, kept apart by segment ids
(`data.packing`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np
from absl import logging

from megatrain_jax.data.packing import pack_rows
from megatrain_jax.data.tokenizer import Message

INSTRUCT_FORMATS = ("alpaca", "sharegpt")
# The bundled sample (`experiments/make_chat_sample.py`): sharegpt conversations about
# the Python standard library, read by the name "chat_sample".
CHAT_SAMPLE = "chat_sample"
CHAT_SAMPLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "chat_sample.jsonl")
OVERLONG = ("truncate", "drop")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "system": "system", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant"}


def _records(path: str) -> list[tuple[str, Any]]:
  """(location, record) pairs of a JSON list or a JSONL file."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if text.lstrip().startswith("["):
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}).") from None
    return [(f"{path}: record {i}", r) for i, r in enumerate(data)]
  out = []
  for lineno, line in enumerate(text.splitlines(), 1):
    if line.strip():
      try:
        out.append((f"{path}:{lineno}", json.loads(line)))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from None
  return out


def _text(where: str, record: dict, key: str, required: bool = True) -> str:
  value = record.get(key)
  if value is None and not required:
    return ""
  if not isinstance(value, str):
    raise ValueError(f"{where}: field {key!r} must be a string, got "
                     f"{type(value).__name__}.")
  return value


def _alpaca(where: str, r: Any) -> list[Message]:
  if not isinstance(r, dict):
    raise ValueError(f"{where}: an alpaca record is an object with instruction/output.")
  prompt = _text(where, r, "instruction")
  extra = _text(where, r, "input", required=False)
  if extra:
    prompt += "\n\n" + extra
  msgs = [{"role": "system", "content": _text(where, r, "system")}] if r.get("system") else []
  return msgs + [{"role": "user", "content": prompt},
                 {"role": "assistant", "content": _text(where, r, "output")}]


def _sharegpt(where: str, r: Any) -> list[Message]:
  if isinstance(r, dict) and isinstance(r.get("conversations"), list):
    turns, role_key, content_key = r["conversations"], "from", "value"
  elif isinstance(r, dict) and isinstance(r.get("messages"), list):
    turns, role_key, content_key = r["messages"], "role", "content"
  else:
    raise ValueError(f'{where}: a sharegpt record needs a "conversations" list '
                     '(from/value) or a "messages" list (role/content).')
  msgs = []
  for j, t in enumerate(turns):
    if not isinstance(t, dict) or t.get(role_key) not in _SHAREGPT_ROLES:
      raise ValueError(f"{where}: turn {j} needs {role_key!r} in "
                       f"{sorted(_SHAREGPT_ROLES)}, got {t!r:.80}.")
    msgs.append({"role": _SHAREGPT_ROLES[t[role_key]],
                 "content": _text(f"{where}: turn {j}", t, content_key)})
  if not any(m["role"] == "assistant" for m in msgs):
    raise ValueError(f"{where}: the conversation has no assistant turn to train on.")
  return msgs


def read_conversations(paths: Sequence[str] | str, fmt: str) -> list[list[Message]]:
  """Conversations from alpaca or sharegpt files (JSON list or JSONL).

  Args:
    paths: the files; a string may list several, comma-separated; "chat_sample"
      is the bundled sample (sharegpt).
    fmt: the record format, one of `INSTRUCT_FORMATS`.

  Returns:
    One list of {"role", "content"} messages per record, in file order.

  Raises:
    ValueError: an unknown `fmt`, a file that is not valid JSON, a malformed record
      (or a sharegpt one with no assistant turn), or no records at all.
  """
  if fmt not in INSTRUCT_FORMATS:
    raise ValueError(f"Instruction format {fmt!r} is not one of {INSTRUCT_FORMATS}.")
  if isinstance(paths, str):
    paths = [p.strip() for p in paths.split(",") if p.strip()]
  paths = [CHAT_SAMPLE_PATH if p == CHAT_SAMPLE else p for p in paths]
  parse = _alpaca if fmt == "alpaca" else _sharegpt
  out = []
  for path in paths:
    out += [parse(where, r) for where, r in _records(path)]
  if not out:
    raise ValueError(f"{', '.join(paths)} hold no {fmt} records.")
  logging.info("Read %d %s conversations from %s.", len(out), fmt, ",".join(paths))
  return out


def encode_conversation(tokenizer, messages: Sequence[Message]
                        ) -> tuple[list[int], list[float]]:
  """Token ids of the rendered conversation, and 1.0 on the tokens of every
  assistant turn (0.0 elsewhere).

  Each assistant turn's text is what rendering the conversation up to and
  including it adds to rendering it up to that turn with a generation prompt; the
  template must render every prefix of a conversation as a prefix of the whole.
  Without a chat template each assistant turn ends with the EOS token.

  Args:
    tokenizer: encodes and renders the conversation (`render_chat`).
    messages: the conversation, {"role", "content"} per message.

  Returns:
    (token ids, loss mask), of equal length.

  Raises:
    ValueError: the chat template does not render prefixes of the conversation as
      prefixes of the whole.
  """
  ids: list[int] = []
  mask: list[float] = []
  done = ""

  def add(text: str, train: bool):
    toks = tokenizer.encode(text) if text else []
    ids.extend(toks)
    mask.extend([float(train)] * len(toks))

  for k, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    prompt = tokenizer.render_chat(messages[:k], add_generation_prompt=True)
    full = tokenizer.render_chat(messages[:k + 1], add_generation_prompt=False)
    if not (prompt.startswith(done) and full.startswith(prompt)):
      raise ValueError("The chat template does not render a conversation's prefixes as "
                       "prefixes of the whole; assistant turns cannot be located.")
    add(prompt[len(done):], False)
    add(full[len(prompt):], True)
    if tokenizer.chat_template is None:
      ids.append(tokenizer.eos_id)
      mask.append(1.0)
    done = full
  rest = tokenizer.render_chat(messages, add_generation_prompt=False)
  add(rest[len(done):], False)
  return ids, mask


def build_sequences(conversations: Sequence[Sequence[Message]], tokenizer, seq_len: int,
                    overlong: str = "truncate", pack: bool = False):
  """Training rows of `seq_len + 1` tokens: one conversation per row, padded with
  the tokenizer's pad id (mask 0), or with `pack` as many whole conversations per
  row as fit, numbered by segment ids (`data.packing.pack_rows`); the share of
  non-padding tokens is logged. A conversation
  longer than a row is truncated or dropped (`overlong`); one left with no trained
  token is dropped. Both counts are logged.

  Args:
    conversations: the conversations, as from `read_conversations`.
    tokenizer: encodes and renders them; gives the pad id.
    seq_len: tokens a sequence trains on; each row holds one more.
    overlong: what to do with a conversation longer than a row, one of `OVERLONG`.
    pack: pack several conversations into a row.

  Returns:
    (tokens int32 [N, seq_len + 1], mask float32 [N, seq_len + 1]), and with `pack`
    the segment ids int32 [N, seq_len + 1] as a third entry.

  Raises:
    ValueError: an unknown `overlong`, a chat template `encode_conversation` cannot
      use, or no conversation left to train on.
  """
  if overlong not in OVERLONG:
    raise ValueError(f"overlong={overlong!r} is not one of {OVERLONG}.")
  n = seq_len + 1
  examples = []
  truncated = dropped = empty = 0
  for conv in conversations:
    ids, mask = encode_conversation(tokenizer, conv)
    if len(ids) > n:
      if overlong == "drop":
        dropped += 1
        continue
      truncated += 1
      ids, mask = ids[:n], mask[:n]
    if not any(mask[1:]):
      empty += 1
      continue
    examples.append((ids, mask))
  if truncated or dropped or empty:
    logging.warning("%d conversations: %d truncated and %d dropped for being longer than "
                    "%d tokens, %d dropped with no assistant token left.",
                    len(conversations), truncated, dropped, n, empty)
  if not examples:
    raise ValueError(f"No conversation left to train on out of {len(conversations)} "
                     f"(longer than seq_len + 1 = {n}: raise --seq_len, or use "
                     "--overlong=truncate).")
  if pack:
    tokens, mask, segments = pack_rows(examples, n, tokenizer.pad_id)
    logging.info("Packed %d conversations into %d rows of %d tokens (%.0f%% padding).",
                 len(examples), len(tokens), n, 100 * float(np.mean(segments == 0)))
    return tokens, mask, segments
  rows = [ids + [tokenizer.pad_id] * (n - len(ids)) for ids, _ in examples]
  masks = [mask + [0.0] * (n - len(mask)) for _, mask in examples]
  return np.asarray(rows, np.int32), np.asarray(masks, np.float32)
