"""The package's layers: dependencies point down, and nobody reaches into another's privates.

experiments -> train / figures / bench -> planner -> engine -> models, with data,
checkpoint and hf beside the engine, never below it.
"""

import ast

import pytest

from import_graph import PKG, package_graph, parse, py_files, reachable

ABOVE_ENGINE = ("hf", "hf_config", "checkpoint", "data", "train", "planner", "bench", "figures",
                "safetensors_reader", "config_flags")
GRAPH = package_graph()


def _modules(prefix):
  return sorted(m for m in GRAPH if m == prefix or m.startswith(prefix + "."))


@pytest.mark.parametrize("module", _modules(f"{PKG}.engine"))
def test_the_engine_reaches_nothing_above_it(module):
  reached = reachable(GRAPH, module)
  bad = sorted(m for m in reached for top in ABOVE_ENGINE
               if m == f"{PKG}.{top}" or m.startswith(f"{PKG}.{top}."))
  assert not bad, f"{module} imports (through others) {bad}"
  assert PKG not in reached, f"{module} imports the whole package"


@pytest.mark.parametrize("module", _modules(f"{PKG}.planner"))
def test_the_planner_reaches_neither_the_benchmark_nor_the_launchers(module):
  # The benchmark measures the planner's figures (and calibrates its profiles), so
  # it sits above it; a planner that imported it would close a cycle.
  reached = reachable(GRAPH, module)
  bad = sorted(m for m in reached for top in ("bench", "figures", "train")
               if m == f"{PKG}.{top}" or m.startswith(f"{PKG}.{top}."))
  assert not bad, f"{module} imports (through others) {bad}"


def test_no_two_packages_import_each_other():
  # Above the module level too: a package whose modules import another package's,
  # and back, is one tangle whatever its files say.
  top = lambda m: m.split(".")[1] if m.count(".") else m
  edges = {(top(a), top(b)) for a, outs in GRAPH.items() for b in outs
           if top(a) != top(b) and "." in a and "." in b}
  assert not {(a, b) for a, b in edges if (b, a) in edges}


@pytest.mark.parametrize("module", _modules(f"{PKG}.models"))
def test_the_models_reach_neither_the_engine_nor_the_data(module):
  reached = reachable(GRAPH, module)
  bad = sorted(m for m in reached if m.startswith((f"{PKG}.engine", f"{PKG}.data")))
  assert not bad, f"{module} imports (through others) {bad}"


def test_the_layering_check_sees_a_lazy_import():
  # An import inside a function is an edge of the graph like any other.
  graph = {"a": {"b"}, "b": {"c"}, "c": set()}
  assert reachable(graph, "a") == {"b", "c"}
  tree = ast.parse("def f():\n  from megatrain_jax import hf\n")
  assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))


# Members whose leading underscore is part of a public API (namedtuple's methods).
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def private_accesses(path):
  """(line, text) of each `x._name` where x is not self or cls."""
  out = []
  for node in ast.walk(parse(path)):
    if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__") and node.attr not in PUBLIC_UNDERSCORED):
      owner = node.value
      if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
        continue
      out.append((node.lineno, ast.unparse(node)))
  return out


@pytest.mark.parametrize("folder", [PKG, "experiments", "tests"])
def test_no_one_touches_another_objects_private_members(folder):
  found = {p: private_accesses(p) for p in py_files(folder)}
  found = {p: v for p, v in found.items() if v}
  assert not found, found


def test_the_private_check_sees_one():
  import os
  import tempfile
  from import_graph import REPO
  with tempfile.NamedTemporaryFile("w", suffix=".py", dir=REPO, delete=False) as f:
    f.write("def f(trainer, self):\n  trainer._stream = None\n  return self._ok\n")
  try:
    assert private_accesses(os.path.relpath(f.name, REPO)) == [(2, "trainer._stream")]
  finally:
    os.remove(f.name)


def test_modules_stay_small_and_the_trainer_a_facade():
  import os
  from import_graph import REPO
  lines = {p: sum(1 for _ in open(os.path.join(REPO, p), encoding="utf-8"))
           for p in py_files(PKG)}
  assert all(n <= 400 for n in lines.values()), {p: n for p, n in lines.items() if n > 400}
  assert lines[f"{PKG}/engine/trainer.py"] <= 350


def test_the_lazy_submodules_load_in_a_fresh_interpreter():
  import subprocess
  import sys
  code = ("import megatrain_jax as mt, sys; "
          "assert 'megatrain_jax.checkpoint' not in sys.modules; "
          "print(mt.hf.from_pretrained.__name__, mt.checkpoint.CheckpointManager.__name__, "
          "mt.planner.plan.__name__)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["from_pretrained", "CheckpointManager", "plan"]
