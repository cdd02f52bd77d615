"""Public functions and classes document themselves, Google style.

A public function or method (no leading underscore) has a docstring; it has `Args:`
when it takes parameters, `Returns:` (or `Yields:`) when it is annotated to return a
value, and `Raises:` when its body raises. Properties and dunder methods are exempt
from the sections (a property's docstring says what it is), and so is a method that
implements one documented by a base class in the same module.
"""

import ast

import pytest

from import_graph import PKG, parse, py_files


def _is_property(fn):
  return any((isinstance(d, ast.Name) and d.id in ("property", "staticmethod_property"))
             or (isinstance(d, ast.Attribute) and d.attr in ("setter", "cached_property"))
             or (isinstance(d, ast.Name) and d.id == "cached_property")
             for d in fn.decorator_list)


def function_issues(fn, where):
  """What `fn`'s docstring lacks, as messages."""
  if fn.name.startswith("_") or _is_property(fn):
    return []
  doc = ast.get_docstring(fn) or ""
  if not doc:
    return [f"{where}{fn.name}: no docstring"]
  out = []
  args = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
          if a.arg not in ("self", "cls")]
  args += [a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None]
  if args and "Args:" not in doc:
    out.append(f"{where}{fn.name}: no Args: section")
  ret = fn.returns
  if (ret is not None and not (isinstance(ret, ast.Constant) and ret.value is None)
      and "Returns:" not in doc and "Yields:" not in doc):
    out.append(f"{where}{fn.name}: no Returns: section")
  body = [n for stmt in fn.body for n in ast.walk(stmt)
          if not isinstance(n, (ast.FunctionDef, ast.Lambda))]
  if any(isinstance(n, ast.Raise) for n in body) and "Raises:" not in doc:
    out.append(f"{where}{fn.name}: no Raises: section")
  return out


def module_issues(path):
  """Every documentation gap of one module's public functions and classes. A method
  that implements one of a base class of the same module is documented there."""
  out = []
  body = parse(path).body
  methods = {c.name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)}
             for c in body if isinstance(c, ast.ClassDef)}
  for node in body:
    if isinstance(node, ast.FunctionDef):
      out += function_issues(node, "")
    elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
      if not ast.get_docstring(node):
        out.append(f"{node.name}: no class docstring")
      inherited = set().union(*(methods.get(b.id, set()) for b in node.bases
                                if isinstance(b, ast.Name)))
      for f in node.body:
        if isinstance(f, ast.FunctionDef) and f.name not in inherited:
          out += function_issues(f, f"{node.name}.")
  return out


@pytest.mark.parametrize("path", py_files(PKG))
def test_public_api_is_documented(path):
  assert not module_issues(path)


def test_the_check_finds_a_gap():
  tree = ast.parse('def f(x) -> int:\n  """Doc."""\n  if x:\n    raise ValueError()\n'
                   '  return 1\n')
  assert function_issues(tree.body[0], "") == [
      "f: no Args: section", "f: no Returns: section", "f: no Raises: section"]
