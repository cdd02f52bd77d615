"""A byte-level tokenizer: no vocabulary file, any UTF-8 text round-trips."""

from __future__ import annotations

from typing import Iterable


class ByteTokenizer:
  """Token ids 0..255 are bytes; 256 = BOS, 257 = EOS, 258 = PAD."""

  BOS = 256
  EOS = 257
  PAD = 258
  vocab_size = 259

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    ids = list(text.encode("utf-8"))
    if add_bos:
      ids.insert(0, self.BOS)
    if add_eos:
      ids.append(self.EOS)
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Bytes back to text; special ids are dropped, invalid UTF-8 is replaced."""
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode("utf-8", errors="replace")
