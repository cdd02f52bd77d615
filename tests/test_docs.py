"""Every Python block of README.md and docs/*.md runs, so the docs cannot name a call that
does not exist. Blocks that train are shrunk (fewer steps, less data) by the
replacements below; the calls stay the same. The blocks of one file run in order in
one namespace, in a scratch directory that holds a tiny Hugging Face checkpoint
named `dir` (for docs/hf.md).
"""

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
# Per file: (text in a block, what it becomes in the test). Each must be found.
SHRINK = {
    "README.md": [("range(20)", "range(2)"), ("max_bytes=10**6", "max_bytes=10**5")],
}


def python_blocks(path):
  """The ```python blocks of a markdown file, in order."""
  with open(path, encoding="utf-8") as f:
    return re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)


def _tiny_checkpoint(directory):
  import transformers  # pylint: disable=import-outside-toplevel
  config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64)
  transformers.Qwen2ForCausalLM(config).save_pretrained(directory)


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)],
                         ids=lambda p: os.path.relpath(p, REPO))
def test_every_python_block_runs(path, tmp_path, monkeypatch):
  name = os.path.relpath(path, REPO).replace(os.sep, "/")
  blocks = python_blocks(path)
  code = "\n".join(blocks)
  for old, new in SHRINK.get(os.path.basename(name), []):
    assert old in code, f"{name} no longer holds {old!r}: update SHRINK"
    code = code.replace(old, new)
  monkeypatch.chdir(tmp_path)
  if re.search(r"[\"']dir[\"']", code):
    _tiny_checkpoint(str(tmp_path / "dir"))
  exec(compile(code, name, "exec"), {"__name__": "__docs__"})  # pylint: disable=exec-used


def test_the_docs_have_python_blocks_to_run():
  assert sum(len(python_blocks(p)) for p in DOCS) >= 3
