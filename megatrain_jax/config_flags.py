"""absl flags made from a config dataclass's fields, so a launcher never repeats them.

Each field gives one flag of its name: its help from `metadata["help"]`, its type
from its default and annotation, the choices of an enum from `metadata["choices"]`,
and a lower bound from `metadata["low"]`. A field with `metadata["flag"] == False`
gets none. Sizes in bytes (`metadata["size"]`) take suffixes: 512M, 8G, 1.5T.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from absl import flags

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
  """Bytes from "123", "512M", "8G", "1.5T" (binary units).

  Args:
    text: the size.

  Returns:
    The bytes.

  Raises:
    ValueError: not a size.
  """
  m = _SIZE.match(str(text))
  if not m:
    raise ValueError(f"{text!r} is not a size (e.g. 1048576, 512M, 8G).")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _SizeParser(flags.ArgumentParser):
  syntactic_help = "a size in bytes, e.g. 1048576, 512M, 8G"

  def parse(self, argument):
    if argument is None or isinstance(argument, int):
      return argument
    try:
      return parse_size(argument)
    except ValueError as e:
      raise ValueError(str(e)) from None

  def flag_type(self):
    return "size"


def _kind(f: dataclasses.Field) -> str:
  meta, default = f.metadata, f.default
  if meta.get("size"):
    return "size"
  if meta.get("as_string"):
    return "string"
  if "choices" in meta:
    return "enum"
  if isinstance(default, bool) or str(f.type).startswith("bool"):
    return "bool"
  text = str(f.type)
  if isinstance(default, int) or text.startswith("int"):
    return "int"
  if isinstance(default, float) or text.startswith("float"):
    return "float"
  return "string"


def define_flags(cls, skip: tuple[str, ...] = (), flag_values=flags.FLAGS) -> list[str]:
  """Defines one flag per field of the dataclass `cls` (see the module docstring).

  Args:
    cls: the dataclass.
    skip: fields to leave out.
    flag_values: where to define them.

  Returns:
    The flag names (a launcher passes them to `flags.declare_key_flag`, so that
    `--help` lists them).
  """
  names = []
  for f in dataclasses.fields(cls):
    meta = f.metadata
    if f.name in skip or meta.get("flag") is False or not f.init:
      continue
    help_text, kind = meta.get("help", f.name), _kind(f)
    default = meta.get("flag_default", f.default)
    if kind == "string" and default is not None:
      default = str(default)
    kw = dict(flag_values=flag_values)
    if kind == "enum":
      flags.DEFINE_enum(f.name, default, list(meta["choices"]), help_text, **kw)
    elif kind == "bool":
      flags.DEFINE_bool(f.name, default, help_text, **kw)
    elif kind == "int":
      flags.DEFINE_integer(f.name, default, help_text, lower_bound=meta.get("low"), **kw)
    elif kind == "float":
      flags.DEFINE_float(f.name, default, help_text, lower_bound=meta.get("low"), **kw)
    elif kind == "size":
      flags.DEFINE(_SizeParser(), f.name, default, help_text, **kw)
    else:
      flags.DEFINE_string(f.name, default, help_text, **kw)
    names.append(f.name)
  return names


def from_flags(cls, flag_values=flags.FLAGS, skip: tuple[str, ...] = (),
               **overrides: Any) -> dict[str, Any]:
  """The keyword arguments of `cls` that its flags hold.

  Args:
    cls: the dataclass whose flags `define_flags` made.
    flag_values: the parsed flags.
    skip: fields to leave out.
    **overrides: values that replace the flags'.

  Returns:
    field name -> value.
  """
  out = {}
  for f in dataclasses.fields(cls):
    if f.name in skip or f.metadata.get("flag") is False or not f.init:
      continue
    out[f.name] = flag_values[f.name].value
  out.update(overrides)
  return out
