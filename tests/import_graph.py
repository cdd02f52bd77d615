"""The import graph of the repository's Python files, read from their source (AST).

Shared by the BUILD check and the tests that walk the package's files. Every import
counts, those inside functions too.
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "megatrain_jax"


def py_files(folder):
  """Python files under `folder`, relative to the repository, sorted."""
  out = []
  for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, folder)):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
    out += [os.path.relpath(os.path.join(dirpath, f), REPO)
            for f in sorted(filenames) if f.endswith(".py")]
  return out


def module_of(path):
  """The dotted module name of a file ("megatrain_jax.engine" for its __init__)."""
  mod = path[:-3].replace(os.sep, ".")
  return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def parse(path):
  """The file's syntax tree."""
  with open(os.path.join(REPO, path), encoding="utf-8") as f:
    return ast.parse(f.read())


def imported_modules(path, modules):
  """The modules of `modules` that the file imports (anywhere in it, lazily too).

  `from pkg import name` depends on `pkg.name` when that is a module, else on `pkg`.
  """
  found = set()
  for node in ast.walk(parse(path)):
    if isinstance(node, ast.Import):
      for a in node.names:
        parts = a.name.split(".")
        name = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                     if ".".join(parts[:k]) in modules), None)
        if name:
          found.add(name)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        if sub in modules:
          found.add(sub)
        elif node.module in modules:
          found.add(node.module)
  found.discard(module_of(path))
  return found

