"""The device-memory ledger: the bytes the engine holds in accelerator memory, by key."""

from __future__ import annotations

import threading
from typing import Any


class Ledger:
  """Bytes the engine holds in accelerator memory, and their peak."""

  def __init__(self):
    self._lock = threading.Lock()
    self._live: dict[Any, int] = {}
    self.current = 0
    self.peak = 0

  def add(self, key, nbytes: int) -> None:
    """Counts bytes under a key (replacing what the key held).

    Args:
      key: what holds them.
      nbytes: their size.
    """
    with self._lock:
      self.current += nbytes - self._live.get(key, 0)
      self._live[key] = nbytes
      self.peak = max(self.peak, self.current)

  def remove(self, key) -> None:
    """Stops counting a key (nothing if it is not counted).

    Args:
      key: what held the bytes.
    """
    with self._lock:
      self.current -= self._live.pop(key, 0)

  def clear(self) -> None:
    """Counts nothing any more (the runtime is shut down)."""
    with self._lock:
      self._live.clear()
      self.current = 0

  def reset_peak(self) -> None:
    """Starts a new peak from the current bytes."""
    with self._lock:
      self.peak = self.current
