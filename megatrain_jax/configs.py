"""Experiments as config files: a `TrainConfig` as an `ml_collections.ConfigDict`, and back.

An experiment is a Python file in `experiments/configs/` whose `get_config()` returns
`config_dict(TrainConfig(...))`. `experiments/train.py --config=<file>` loads it
with ml_collections' `config_flags`, and any field can be overridden on the command
line, nested ones by their path:

  python experiments/train.py --config=experiments/configs/moe.py \
      --config.steps=50 --config.engine.prefetch_depth=3 --config.model.n_layers=4

The dict holds every field of `TrainConfig`, of its `engine` (`EngineConfig`) and,
when the model is given as a `LlamaConfig` rather than a preset's name, of the
model. A field that is None by default takes a value of its annotated type; sizes
in bytes also take "512M", "8G"; `batch_size` also takes "auto".
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict as cd_lib

from megatrain_jax.engine import EngineConfig
from megatrain_jax.engine.config import dtype_name
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.train_config import TrainConfig

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_PLAIN = (bool, int, float, str)


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


def config_dict(config: Any) -> ml_collections.ConfigDict:
  """A config dataclass (`TrainConfig`, or any of its parts) as a `ConfigDict`.

  Args:
    config: the dataclass instance.

  Returns:
    The dict: one entry per field (but those with `flag=False`), nested dataclasses
    as nested dicts, dtypes by name.
  """
  hints = typing.get_type_hints(type(config))
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(config):
    if f.metadata.get("flag") is False or not f.init:
      continue
    value = getattr(config, f.name)
    if dataclasses.is_dataclass(value):
      out[f.name] = config_dict(value)
      continue
    if f.name == "compute_dtype":
      value = dtype_name(value)
    kind = _inner(hints[f.name])
    if f.metadata.get("size") or kind not in _PLAIN or f.name == "batch_size":
      out[f.name] = cd_lib.placeholder(object)  # a size, "auto", a tuple, a nested value
      out[f.name] = value
    elif value is None:
      out[f.name] = cd_lib.placeholder(kind)
    else:
      out[f.name] = kind(value) if kind is float else value
  return out


def train_config(config: ml_collections.ConfigDict) -> TrainConfig:
  """The `TrainConfig` a config file (with its overrides) describes.

  Args:
    config: the dict `config_dict` made, as loaded and overridden.

  Returns:
    The `TrainConfig` (not yet validated: `TrainConfig.validate` checks ranges).

  Raises:
    ValueError: a field no config has, or a value of the wrong kind, naming it.
  """
  d = config.to_dict()
  engine = _build(EngineConfig, d.pop("engine", {}), "engine.")
  model = d.get("model", "tiny")
  if isinstance(model, dict):
    d["model"] = _build(LlamaConfig, model, "model.")
  batch = d.get("batch_size")
  if isinstance(batch, str) and batch != "auto":
    try:
      d["batch_size"] = int(batch)
    except ValueError:
      raise ValueError(f"--config.batch_size must be an integer or 'auto', got "
                       f"{batch!r}.") from None
  return _build(TrainConfig, {**d, "engine": engine}, "")


def describe(config: Any, prefix: str = "") -> list[str]:
  """One line per field: its path, current value and help.

  Args:
    config: a config dataclass instance.
    prefix: the path of `config` in the file ("" for the top).

  Returns:
    The lines, nested dataclasses after their parent's fields.
  """
  lines, nested = [], []
  for f in dataclasses.fields(config):
    if f.metadata.get("flag") is False or not f.init:
      continue
    value = getattr(config, f.name)
    if dataclasses.is_dataclass(value):
      nested.append((f.name, value))
      continue
    text = f.metadata.get("help", "")
    choices = f.metadata.get("choices")
    lines.append(f"--config.{prefix}{f.name}={value!r}  {text}"
                 + (f" One of {', '.join(map(str, choices))}." if choices else ""))
  for name, value in nested:
    lines += describe(value, f"{prefix}{name}.")
  return lines


def _build(cls, values: dict[str, Any], prefix: str):
  """`cls(**values)`, sizes parsed, with a message that names a bad field."""
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ValueError(f"--config.{prefix}{unknown[0]} is not a field of {cls.__name__}.")
  for f in dataclasses.fields(cls):
    if f.metadata.get("size") and isinstance(values.get(f.name), str):
      values[f.name] = _size(prefix + f.name, values[f.name])
    if isinstance(values.get(f.name), list):
      values[f.name] = tuple(values[f.name])
  try:
    return cls(**values)
  except (TypeError, ValueError) as e:
    raise ValueError(f"--config.{prefix.rstrip('.') or 'train'}: {e}") from None


def _size(name: str, text: str) -> int:
  try:
    return parse_size(text)
  except ValueError as e:
    raise ValueError(f"--config.{name}: {e}") from None


def _inner(t) -> Any:
  """The type of an annotation, Optional stripped; `object` for unions and `Any`."""
  args = [a for a in typing.get_args(t) if a is not type(None)]
  if typing.get_origin(t) in (typing.Union, types.UnionType):
    return args[0] if len(args) == 1 else object
  return t if isinstance(t, type) else object
