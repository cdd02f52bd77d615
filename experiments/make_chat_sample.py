"""Writes the bundled instruction sample, megatrain_jax/data/chat_sample.jsonl.

  python experiments/make_chat_sample.py

ShareGPT-style conversations about the Python standard library, made from its own
docstrings and signatures (the same source as the default text corpus), so the
instruction path trains with no download: `--data=chat_sample --data_format=sharegpt`.
The file is committed; rerunning this on another Python version changes its text.
"""

import importlib
import inspect
import json
import os

MODULES = ("os.path", "json", "re", "math", "itertools", "functools", "collections",
           "string", "textwrap", "statistics", "random", "shutil", "glob", "fnmatch",
           "heapq", "bisect", "base64", "hashlib", "difflib", "calendar", "zlib",
           "copy", "operator", "keyword", "html", "urllib.parse", "posixpath",
           "secrets", "uuid", "colorsys")
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "megatrain_jax", "data", "chat_sample.jsonl")


def _summary(doc: str) -> str:
  para = doc.strip().split("\n\n")[0]
  return " ".join(para.split())[:400]


def conversations():
  for mod_name in MODULES:
    mod = importlib.import_module(mod_name)
    for name in sorted(getattr(mod, "__all__", None) or dir(mod)):
      obj = getattr(mod, name, None)
      if name.startswith("_") or not callable(obj) or not inspect.getdoc(obj):
        continue
      answer = _summary(inspect.getdoc(obj))
      if len(answer) < 20:
        continue
      turns = [{"from": "human", "value": f"What does {mod_name}.{name} do?"},
               {"from": "gpt", "value": answer}]
      try:
        sig = str(inspect.signature(obj))
      except (TypeError, ValueError):
        sig = None
      if sig and len(sig) < 120:
        turns += [{"from": "human", "value": "How is it called?"},
                  {"from": "gpt", "value": f"{mod_name}.{name}{sig}"}]
      yield {"conversations": turns}


def main():
  rows = list(conversations())
  with open(OUT, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
  print(f"Wrote {len(rows)} conversations to {OUT}.")  # the script's output


if __name__ == "__main__":
  main()
