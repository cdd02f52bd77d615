"""Tokenizers: a built-in byte tokenizer, and a Hugging Face `tokenizer.json`.

Both offer `encode`, `decode`, `vocab_size`, `bos_id` / `eos_id` / `pad_id` and
`render_chat(messages, add_generation_prompt)`, which formats a conversation as
text: with the checkpoint's chat template where it has one, else with the
built-in template below (whose assistant turns the caller ends with EOS).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

Message = dict[str, str]


def render_builtin_chat(messages: Sequence[Message], add_generation_prompt: bool) -> str:
  """`<|role|>\\ncontent\\n` per message; a generation prompt is `<|assistant|>\\n`.

  Args:
    messages: the conversation, {"role", "content"} per message.
    add_generation_prompt: whether to end with the prompt for an assistant turn.

  Returns:
    The conversation as text.
  """
  out = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
  return out + ("<|assistant|>\n" if add_generation_prompt else "")


class ByteTokenizer:
  """Token ids 0..255 are bytes; 256 = BOS, 257 = EOS, 258 = PAD."""

  BOS = 256
  EOS = 257
  PAD = 258
  vocab_size = 259
  bos_id, eos_id, pad_id = BOS, EOS, PAD
  chat_template = None

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """The UTF-8 bytes of `text` as token ids.

    Args:
      text: the text.
      add_bos: whether to put BOS first.
      add_eos: whether to put EOS last.

    Returns:
      The token ids.
    """
    ids = list(text.encode("utf-8"))
    if add_bos:
      ids.insert(0, self.BOS)
    if add_eos:
      ids.append(self.EOS)
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Bytes back to text; special ids are dropped, invalid UTF-8 is replaced.

    Args:
      ids: the token ids.

    Returns:
      The text.
    """
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode("utf-8", errors="replace")

  def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """A conversation as text, in the built-in template (`render_builtin_chat`).

    Args:
      messages: the conversation, {"role", "content"} per message.
      add_generation_prompt: whether to end with the prompt for an assistant turn.

    Returns:
      The conversation as text.
    """
    return render_builtin_chat(messages, add_generation_prompt)


def _token_text(value: Any) -> str | None:
  """A special token from tokenizer_config.json: a string or {"content": ...}."""
  if isinstance(value, dict):
    return value.get("content")
  return value


class HFTokenizer:
  """A checkpoint directory's `tokenizer.json` (through the `tokenizers` library),
  with special tokens and the chat template from `tokenizer_config.json`."""

  def __init__(self, local_dir: str):
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
    path = os.path.join(local_dir, "tokenizer.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} does not exist; the Hugging Face tokenizer needs "
                              "tokenizer.json in the checkpoint directory.")
    self._tok = Tokenizer.from_file(path)
    config: dict[str, Any] = {}
    cfg_path = os.path.join(local_dir, "tokenizer_config.json")
    if os.path.exists(cfg_path):
      with open(cfg_path, encoding="utf-8") as f:
        config = json.load(f)
    template = config.get("chat_template")
    jinja = os.path.join(local_dir, "chat_template.jinja")
    if template is None and os.path.exists(jinja):
      with open(jinja, encoding="utf-8") as f:
        template = f.read()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      template = next((t["template"] for t in template if t.get("name") == "default"),
                      template[0]["template"])
    self.chat_template = template
    self.bos_token = _token_text(config.get("bos_token"))
    self.eos_token = _token_text(config.get("eos_token"))
    self.bos_id = self._id(self.bos_token)
    self.eos_id = self._id(self.eos_token)
    pad = self._id(_token_text(config.get("pad_token")))
    self.pad_id = pad if pad is not None else self.eos_id
    if self.eos_id is None or self.pad_id is None:
      raise ValueError(f"{local_dir}: tokenizer_config.json names no eos_token in the "
                       "vocabulary; sequences could not be ended or padded.")
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self._compiled = None

  def _id(self, token: str | None) -> int | None:
    return None if token is None else self._tok.token_to_id(token)

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of `text`, without the tokenizer's own special tokens.

    Args:
      text: the text.
      add_bos: whether to put BOS first (when the tokenizer has one).
      add_eos: whether to put EOS last.

    Returns:
      The token ids.
    """
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if add_bos and self.bos_id is not None:
      ids.insert(0, self.bos_id)
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def id_to_token(self, i: int) -> str | None:
    """The token string of id i (None when the vocabulary has no such id).

    Args:
      i: the token id.

    Returns:
      The token string, or None.
    """
    return self._tok.id_to_token(int(i))

  def decode(self, ids: Iterable[int]) -> str:
    """Token ids back to text, special tokens skipped.

    Args:
      ids: the token ids.

    Returns:
      The text.
    """
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """A conversation as text, in the chat template (built-in when there is none).

    Args:
      messages: the conversation, {"role", "content"} per message.
      add_generation_prompt: whether to end with the prompt for an assistant turn.

    Returns:
      The conversation as text.

    Raises:
      ValueError: the template refuses the conversation (its `raise_exception`).
    """
    if self.chat_template is None:
      return render_builtin_chat(messages, add_generation_prompt)
    if self._compiled is None:
      from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel

      def raise_exception(message):
        raise ValueError(f"The chat template refused the conversation: {message}")
      env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      env.globals["raise_exception"] = raise_exception
      self._compiled = env.from_string(self.chat_template)
    return self._compiled.render(messages=list(messages),
                                 add_generation_prompt=add_generation_prompt,
                                 bos_token=self.bos_token or "", eos_token=self.eos_token or "")
