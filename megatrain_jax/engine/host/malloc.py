"""Keeping the host's resident memory at what the engine holds (glibc's malloc).

glibc's malloc raises its mmap threshold after the first large free (up to 32 MiB),
so later unit-sized buffers come from heap arenas (one per thread), which keep
freed memory instead of returning it. With several threads allocating and freeing
unit-sized buffers every step, that retention measured +2.7 bytes per parameter of
RSS on a 350M-parameter model after one step. Fixing the threshold
(`MMAP_THRESHOLD`, 1 MiB) makes every larger buffer its own mapping, returned to the
system when freed.

A higher threshold is faster on the CPU backend, where the device's buffers are
malloc's too: at 16 MiB a small layer's activations and residuals are reused from
the arenas, and the streaming step with recompute "none" (d_model 512, 8 layers,
2K tokens, 2 cores) took 3.55 s against 5.26 s at 1 MiB. The step now reuses those
buffers itself (`device.pool.BufferPool`), so the threshold stays at 1 MiB, where a
dropped trainer's buffers go back to the system without `malloc_trim`. (The
14.9-17.0 bytes per parameter once measured for the `300m` preset at 16 MiB inside
the whole benchmark were the benchmark process's own peak, which `ru_maxrss`
carried into the child that measured; by itself it measured 13.44-13.81 at 16 MiB
against 13.4-13.7 at 1 MiB: docs/performance.md.)

Fresh mappings cost a page fault per 4 KiB page on first touch; the launchers ask
for transparent huge pages at start (`megatrain_jax.launch`), which the engine
itself never does: a library does not restart its process.
"""


from __future__ import annotations

import ctypes
import ctypes.util
import platform

from absl import logging

_M_MMAP_THRESHOLD = -3
_done = False


MMAP_THRESHOLD = 1 << 20


def return_freed_memory(threshold_bytes: int = MMAP_THRESHOLD) -> bool:
  """Fixes glibc's mmap threshold (process-wide, once).

  Args:
    threshold_bytes: buffers larger than this are mapped (and unmapped when freed).

  Returns:
    Whether the threshold is set (False where the C library is not glibc).
  """
  global _done
  if _done:
    return True
  if platform.system() != "Linux":
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))
  except (OSError, AttributeError):
    return False
  if ok:
    _done = True
    logging.info("malloc: buffers over %d KiB are mapped and returned when freed.",
                 threshold_bytes // 1024)
  return ok
