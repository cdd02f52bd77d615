"""The fused host AdamW: optax.adamw's operations, in place, a chunk at a time, in parts.

Each unit's master and moments are held as one contiguous part per host thread (a
whole number of chunks each); each thread updates its part in place, a cache-sized
chunk at a time, so p, m and v cross memory once. (XLA's CPU backend compiles the
whole-buffer update into three passes over memory, and runs an in-place loop on one
core; see docs/performance.md.)
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp

from megatrain_jax.optim import AdamWHyper, adamw_moments, adamw_params, adamw_scalars, \
    clip_with_norm


def host_threads() -> int:
  """The CPUs this process may run on.

  Returns:
    Their count (at least 1).
  """
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def part_bounds(size: int, parts: int, chunk: int) -> list[tuple[int, int]]:
  """How a buffer splits into parts of whole chunks.

  Args:
    size: the buffer's elements.
    parts: the most parts wanted.
    chunk: elements per chunk.

  Returns:
    [lo, hi) of up to `parts` contiguous parts, each a whole number of chunks (the
    last one takes the remainder), none empty.
  """
  full = size // chunk
  k = max(1, min(parts, full))
  cuts = [j * full // k * chunk for j in range(k)] + [size]
  return list(zip(cuts[:-1], cuts[1:]))


def chunked_adamw_update(h: AdamWHyper, lo: int, chunk: int,
                         max_norm: float | None = None) -> Callable:
  """The fused AdamW update of one part, in place, chunk by chunk.

  Every element goes through optax's operations, so for a given gradient the result
  is optax.adamw's, bit for bit, for any `lo` and `chunk` (tests/test_host_optimizer.py;
  `adamw_params` says why it is called `in_loop`).

  Args:
    h: AdamW's hyperparameters.
    lo: the part's first element in its unit's flat layout.
    chunk: elements per step of the loop.
    max_norm: the clip of clipped mode (None: no clip).

  Returns:
    `update(part, state, grad, acc, norm) -> (part, state, sumsq)`: `part` and
    `state` (optax.adamw's state for `part`) are elements [lo, lo + part.size) of a
    unit whose whole gradient is `grad` (plus the accumulated `acc`, when not None;
    clipped by the global `norm`, when not None); with `acc`, `sumsq` is the sum of
    squares of the part's summed gradient before the clip, read in the same pass
    (else 0: the device summed the one micro-batch's; a reduction in this loop costs
    a fifth of its time on the CPU backend).
  """

  def update(part, state, grad, acc, norm):
    adam, decay, lr_state = state
    s, lr_state = adamw_scalars(h, adam.count, lr_state)
    at = lambda x, o, n: jax.lax.dynamic_slice(x, (o,), (n,))

    def step(o, n, pmv):
      p, mu, nu, ss = pmv
      g = at(grad, lo + o, n).astype(jnp.float32)
      if acc is not None:
        g = at(acc, lo + o, n) + g
        ss = ss + jnp.sum(jnp.square(g))
      if norm is not None:
        g = clip_with_norm(g, norm, max_norm)
      m, v = adamw_moments(h, g, at(mu, o, n), at(nu, o, n))
      mu = jax.lax.dynamic_update_slice(mu, m, (o,))
      nu = jax.lax.dynamic_update_slice(nu, v, (o,))
      # The new moments are read back from their buffers: p's update then depends
      # on the written buffers alone, so XLA updates all three in place.
      new = adamw_params(h, at(p, o, n), at(mu, o, n), at(nu, o, n), s, in_loop=True)
      return jax.lax.dynamic_update_slice(p, new, (o,)), mu, nu, ss

    size = part.shape[0]
    full = size // chunk
    pmv = (part, adam.mu, adam.nu, jnp.zeros((), jnp.float32))
    if full:
      pmv = jax.lax.fori_loop(0, full, lambda i, c: step(i * chunk, chunk, c), pmv)
    if size % chunk:
      pmv = step(full * chunk, size % chunk, pmv)
    part, mu, nu, ss = pmv
    return part, (adam._replace(count=s.count, mu=mu, nu=nu), decay, lr_state), ss

  return update


def piece_adamw_update(h: AdamWHyper, size: int, chunk: int,
                       max_norm: float | None = None) -> Callable:
  """The fused AdamW update of one piece of `size` elements at a traced offset: one
  compiled program serves every piece of that size (the disk tier's updates).

  Args:
    h: AdamW's hyperparameters.
    size: the piece's elements.
    chunk: elements per step of the loop.
    max_norm: the clip of clipped mode (None: no clip).

  Returns:
    `update(part, state, grad, acc, norm, lo)`: `chunked_adamw_update`'s, for the
    piece starting at element `lo` (an int32 scalar) of its unit, bit for bit.
  """
  inner = chunked_adamw_update(h, 0, chunk, max_norm)

  def update(part, state, grad, acc, norm, lo):
    at = lambda x: None if x is None else jax.lax.dynamic_slice(x, (lo,), (size,))
    return inner(part, state, at(grad), at(acc), norm)

  return update
