"""safetensors checkpoints read tensor by tensor with numpy (bf16 included), checked first.

A safetensors file is an 8-byte header length, a JSON header naming each tensor's
dtype, shape and byte range, then the bytes. The header alone says whether the
file is complete and what every tensor is, so a checkpoint is checked whole before
any tensor is read. Tensors are read through a memory map, one at a time.
"""

from __future__ import annotations

import json
import os
import struct
from typing import NamedTuple

import numpy as np

# safetensors dtype -> (numpy dtype of the stored bytes, whether it is floating).
_DTYPES = {"F64": (np.float64, True), "F32": (np.float32, True), "F16": (np.float16, True),
           "BF16": (np.uint16, True), "I64": (np.int64, False), "I32": (np.int32, False),
           "I16": (np.int16, False), "I8": (np.int8, False), "U8": (np.uint8, False),
           "BOOL": (np.bool_, False)}
_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
          "BOOL": "bool"}


class TensorInfo(NamedTuple):
  """Where a tensor is and what it is, from its file's header."""
  name: str
  path: str
  dtype: str  # the safetensors name, e.g. "BF16"
  shape: tuple[int, ...]
  start: int  # byte offset in the file
  end: int

  @property
  def dtype_name(self) -> str:
    """The dtype as numpy would name it ("bfloat16", "float32", "int32", ...)."""
    return _NAMES.get(self.dtype, self.dtype)

  @property
  def floating(self) -> bool:
    """Whether the tensor holds floating-point numbers."""
    return _DTYPES.get(self.dtype, (None, False))[1]


def _unreadable(path: str, why: str) -> ValueError:
  return ValueError(f"{path} cannot be read as a safetensors file: {why}. Is it complete "
                    "(a download or copy cut short), and is it the file config.json "
                    "belongs to?")


def read_header(path: str) -> dict[str, TensorInfo]:
  """The tensors a safetensors file holds, checked against the file's size.

  Args:
    path: the file.

  Returns:
    name -> TensorInfo.

  Raises:
    ValueError: the file is truncated or its header is not valid safetensors.
    FileNotFoundError: the file does not exist.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist (it is named by the checkpoint's "
                            "index or expected in its directory).")
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise _unreadable(path, f"it has {size} bytes, fewer than a header")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
      raise _unreadable(path, f"its header says {n} bytes of metadata, but the file has "
                              f"{size} bytes in all")
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise _unreadable(path, f"its header is not JSON ({e})") from None
  out, data = {}, 8 + n
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype, shape, (lo, hi) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise _unreadable(path, f"the header entry of {name!r} is malformed") from None
    if data + hi > size:
      raise _unreadable(path, f"tensor {name!r} ends at byte {data + hi}, past the end "
                              f"of the file ({size} bytes)")
    out[name] = TensorInfo(name, path, dtype, shape, data + lo, data + hi)
  return out


def read_tensor(info: TensorInfo, dtype=np.float32) -> np.ndarray:
  """One floating tensor as a new `dtype` array (bf16 and fp16 converted exactly).

  Args:
    info: the tensor, from `read_header`.
    dtype: the dtype to return.

  Returns:
    The array, of shape `info.shape`.

  Raises:
    ValueError: the tensor is not floating point.
  """
  stored, floating = _DTYPES.get(info.dtype, (None, False))
  if not floating:
    raise ValueError(f"{info.name} in {info.path} is {info.dtype_name}, not a floating "
                     "type (float16, bfloat16, float32 or float64).")
  raw = np.memmap(info.path, dtype=stored, mode="r", offset=info.start,
                  shape=(int(np.prod(info.shape, dtype=np.int64)),))
  if info.dtype == "BF16":  # the top 16 bits of a float32
    out = (raw.astype(np.uint32) << 16).view(np.float32)
  else:
    out = np.asarray(raw)
  return np.array(out.reshape(info.shape), dtype=dtype)


def checkpoint_tensors(local_dir: str) -> dict[str, TensorInfo]:
  """Every tensor of a single (`model.safetensors`) or sharded
  (`model.safetensors.index.json`) checkpoint directory.

  Args:
    local_dir: the directory.

  Returns:
    name -> TensorInfo, from the headers alone.

  Raises:
    FileNotFoundError: no checkpoint file, or a shard the index names is missing.
    ValueError: an unreadable file or index, or a tensor the index places in a
      shard that does not hold it.
  """
  index = os.path.join(local_dir, "model.safetensors.index.json")
  single = os.path.join(local_dir, "model.safetensors")
  if os.path.exists(index):
    try:
      with open(index, encoding="utf-8") as f:
        where = {k: os.path.join(local_dir, v) for k, v in json.load(f)["weight_map"].items()}
    except (ValueError, KeyError, AttributeError) as e:
      raise ValueError(f"{index} is not a valid safetensors index ({type(e).__name__}: "
                       f"{e}).") from None
    headers = {p: read_header(p) for p in sorted(set(where.values()))}
    out = {}
    for name, path in where.items():
      if name not in headers[path]:
        raise ValueError(f"{index} places {name} in {path}, which does not hold it.")
      out[name] = headers[path][name]
    return out
  if os.path.exists(single):
    return read_header(single)
  raise FileNotFoundError(f"{local_dir} holds neither model.safetensors nor "
                          "model.safetensors.index.json.")
