"""Reading raw text: plain files, JSONL {"text": ...}, and the embedded stdlib corpus."""

from __future__ import annotations

import json
import os
import sysconfig
from typing import Iterator, Sequence

from absl import logging

STDLIB = "stdlib"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


def stdlib_files() -> list[str]:
  """The Python standard library's own .py files, sorted: text on every machine.

  Returns:
    The file paths, walked in sorted order, skipping site-packages and caches.
  """
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames
                         if d not in ("site-packages", "dist-packages", "__pycache__"))
    files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
  return files


def _expand(path: str) -> list[str]:
  if path == STDLIB:
    return stdlib_files()
  if not os.path.exists(path):
    raise FileNotFoundError(f"Data path {path!r} does not exist; pass existing files "
                            f"or directories, or {STDLIB!r} for the embedded corpus.")
  if os.path.isdir(path):
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
      dirnames.sort()
      found.extend(os.path.join(dirpath, f) for f in sorted(filenames)
                   if f.endswith(TEXT_SUFFIXES + (".jsonl",)))
    if not found:
      raise ValueError(f"Data directory {path!r} holds no text files "
                       f"({', '.join(TEXT_SUFFIXES + ('.jsonl',))}).")
    return found
  return [path]


def jsonl_records(path: str) -> Iterator[tuple[str, object]]:
  """The JSON values of a JSON-lines file, one per non-blank line.

  Args:
    path: the file.

  Yields:
    ("path:line", the line's value), for error messages that name the line.

  Raises:
    ValueError: a line that is not JSON, named by its number.
  """
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from None
      yield f"{path}:{lineno}", record


def _jsonl_texts(path: str) -> Iterator[str]:
  for where, record in jsonl_records(path):
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
      raise ValueError(f'{where}: a JSONL record needs a string "text" field.')
    yield record["text"]


def read_documents(paths: Sequence[str] | str, max_bytes: int | None = None,
                   jsonl: bool | None = None) -> list[str]:
  """Documents from `paths` (files, directories, or "stdlib"), in a fixed order.

  A JSONL file gives one document per line's "text"; any other file is one
  document. `jsonl=None` decides by the `.jsonl` suffix, True/False forces it.
  Reading stops once `max_bytes` of text are collected.

  Args:
    paths: files, directories (searched for text and .jsonl files), or "stdlib"; a
      string may list several, comma-separated.
    max_bytes: stop once this many characters are read; None reads everything.
    jsonl: whether files are JSONL; None decides per file by the `.jsonl` suffix.

  Returns:
    The non-empty documents, in path order.

  Raises:
    ValueError: no path given, the paths hold no text, a directory holds no text
      files, or a JSONL line is not valid JSON or lacks a string "text" field.
    FileNotFoundError: a path does not exist.
  """
  if isinstance(paths, str):
    paths = [p for p in paths.split(",") if p.strip()]
  paths = [p.strip() for p in paths]
  if not paths or any(not p for p in paths):
    raise ValueError("No data path given: pass files, directories, or "
                     f"{STDLIB!r} for the embedded corpus.")
  docs, total = [], 0
  for path in paths:
    for file in _expand(path):
      if jsonl if jsonl is not None else file.endswith(".jsonl"):
        texts = _jsonl_texts(file)
      else:
        with open(file, encoding="utf-8", errors="replace") as f:
          texts = iter([f.read()])
      for text in texts:
        if text:
          docs.append(text)
          total += len(text)
        if max_bytes is not None and total >= max_bytes:
          logging.info("Read %d documents (%.1f MB) from %s.", len(docs), total / 1e6,
                       ",".join(paths))
          return docs
  if not docs:
    raise ValueError(f"Data paths {list(paths)} hold no text.")
  logging.info("Read %d documents (%.1f MB) from %s.", len(docs), total / 1e6,
               ",".join(paths))
  return docs
