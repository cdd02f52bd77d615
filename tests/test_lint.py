"""The linters CI runs pass: ruff (docstrings, private members) and import-linter (layers).

Their rules live in pyproject.toml ([tool.ruff], [tool.importlinter]); this test runs
them so that `pytest` alone checks everything the README promises.
"""

import json
import os
import shutil
import subprocess
import sys

from import_graph import REPO

RUFF_PATHS = ("megatrain_jax", "experiments", "tests")


def _run(cmd, stdin=None):
  return subprocess.run(cmd, cwd=REPO, input=stdin, capture_output=True, text=True,
                        timeout=300, check=False)


def _lint_imports():
  """The `lint-imports` entry point of this interpreter's environment."""
  here = os.path.join(os.path.dirname(sys.executable), "lint-imports")
  found = here if os.path.exists(here) else shutil.which("lint-imports")
  assert found, "lint-imports is missing: pip install -e '.[dev]'"
  return found


def test_ruff_passes():
  out = _run([sys.executable, "-m", "ruff", "check", "--no-cache", *RUFF_PATHS])
  assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_import_contracts_are_kept():
  out = _run([_lint_imports(), "--no-cache"])
  assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
  assert " 0 broken" in out.stdout, out.stdout[-6000:]


def test_ruff_finds_the_gaps_the_rules_name():
  # The configuration is in force: a package module without docstrings and with
  # another object's private member is refused, and the same access in a test too.
  code = ("def f(x, y):\n  \"\"\"Doc.\n\n  Args:\n    x: one.\n  \"\"\"\n"
          "  return x._hidden, y\n\n\nclass C:\n  pass\n")
  found = {}
  for name in ("megatrain_jax/scratch.py", "tests/scratch.py"):
    out = _run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format",
                "json", "--stdin-filename", name, "-"], stdin=code)
    assert out.returncode == 1, out.stdout + out.stderr
    found[name] = {d["code"] for d in json.loads(out.stdout)}
  assert found == {"megatrain_jax/scratch.py": {"D100", "D101", "D417", "SLF001"},
                   "tests/scratch.py": {"SLF001"}}, found
