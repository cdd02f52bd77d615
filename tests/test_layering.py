"""What the linters cannot say about the package's shape: module sizes and lazy loading.

The layers themselves (experiments -> train / figures / bench -> planner -> engine ->
models, with data, checkpoint and hf beside the engine, never below it) are
import-linter contracts, and the rule that nobody reaches into another object's
privates is ruff's SLF001: both are configured in pyproject.toml and run by
tests/test_lint.py.
"""

import os
import subprocess
import sys

from import_graph import PKG, REPO, py_files


def test_modules_stay_small_and_the_trainer_a_facade():
  lines = {p: sum(1 for _ in open(os.path.join(REPO, p), encoding="utf-8"))
           for p in py_files(PKG)}
  assert all(n <= 400 for n in lines.values()), {p: n for p, n in lines.items() if n > 400}
  assert lines[f"{PKG}/engine/trainer.py"] <= 350


def test_the_lazy_submodules_load_in_a_fresh_interpreter():
  code = ("import megatrain_jax as mt, sys; "
          "assert 'megatrain_jax.checkpoint' not in sys.modules; "
          "print(mt.hf.from_pretrained.__name__, mt.checkpoint.CheckpointManager.__name__, "
          "mt.planner.plan.__name__)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["from_pretrained", "CheckpointManager", "plan"]
