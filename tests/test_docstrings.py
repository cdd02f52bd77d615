"""The docstring rules ruff cannot state (ruff checks the rest: pyproject.toml).

ruff requires a docstring of every public module, class and function, and that an
`Args:` section names every parameter. This test keeps what no ruff rule says the
same way:

- A public method has a docstring, unless it is a property, a dunder, or implements a
  method of a base class in the same module, whose docstring it shares (ruff's D102
  flags all three).
- A public function or method has `Args:` when it takes parameters (D417 looks only
  inside an `Args:` section that is there), `Returns:` (or `Yields:`) when it is
  annotated to return a value, and `Raises:` when its body raises (the preview rules
  DOC201/DOC501 go by `return` statements, and check private functions too).
"""

import ast

import pytest

from import_graph import PKG, parse, py_files


def _is_property(fn):
  return any((isinstance(d, ast.Name) and d.id in ("property", "staticmethod_property"))
             or (isinstance(d, ast.Attribute) and d.attr in ("setter", "cached_property"))
             or (isinstance(d, ast.Name) and d.id == "cached_property")
             for d in fn.decorator_list)


def _exempt(fn):
  return fn.name.startswith("_") or _is_property(fn)


def section_issues(fn, where):
  """The sections `fn`'s docstring lacks, as messages (none without a docstring)."""
  doc = ast.get_docstring(fn) or ""
  if _exempt(fn) or not doc:
    return []
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


def method_issues(fn, where):
  """What public method `fn` lacks: a docstring, else its sections."""
  if not _exempt(fn) and not ast.get_docstring(fn):
    return [f"{where}{fn.name}: no docstring"]
  return section_issues(fn, where)


def module_issues(tree):
  """Every documentation gap of one module's public functions and methods. A method
  that implements one of a base class of the same module is documented there."""
  out = []
  body = tree.body
  methods = {c.name: {f.name for f in c.body if isinstance(f, ast.FunctionDef)}
             for c in body if isinstance(c, ast.ClassDef)}
  for node in body:
    if isinstance(node, ast.FunctionDef):
      out += section_issues(node, "")
    elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
      inherited = set().union(*(methods.get(b.id, set()) for b in node.bases
                                if isinstance(b, ast.Name)))
      for f in node.body:
        if isinstance(f, ast.FunctionDef) and f.name not in inherited:
          out += method_issues(f, f"{node.name}.")
  return out


@pytest.mark.parametrize("path", py_files(PKG))
def test_public_api_is_documented(path):
  assert not module_issues(parse(path))


def test_the_check_finds_a_gap():
  tree = ast.parse('def f(x) -> int:\n  """Doc."""\n  if x:\n    raise ValueError()\n'
                   '  return 1\n')
  assert section_issues(tree.body[0], "") == [
      "f: no Args: section", "f: no Returns: section", "f: no Raises: section"]
  tree = ast.parse('class B:\n  """B."""\n\n  def run(self):\n    """Runs."""\n\n\n'
                   'class C(B):\n  """C."""\n\n  def run(self):\n    pass\n\n'
                   '  @property\n  def size(self):\n    return 1\n\n'
                   '  def stop(self, now):\n    pass\n')
  assert module_issues(tree) == ["C.stop: no docstring"]
