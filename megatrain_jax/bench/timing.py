"""Timing and synthetic inputs shared by the benchmark, the planner, the figures and tests.

Every figure is a ratio of two things timed in the same process, alternating
between them, reported as the ratio of their medians after warm-up (the first,
compiling call is never timed).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.models.config import LlamaConfig


def synthetic_batch(cfg: LlamaConfig, batch_size: int, seq_len: int, seed: int = 0
                    ) -> dict[str, np.ndarray]:
  """A random batch of token ids in the model's vocabulary, every token trained.

  Args:
    cfg: the model (its vocabulary).
    batch_size: sequences.
    seq_len: tokens per sequence.
    seed: the numpy seed.

  Returns:
    {"input_ids", "labels", "loss_mask"}.
  """
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
  return {"input_ids": ids[:, :-1], "labels": ids[:, 1:],
          "loss_mask": np.ones((batch_size, seq_len), np.float32)}


def median_times(fns: dict[str, Callable[[], Any]], warmup: int, reps: int,
                 settle: int = 0) -> dict[str, float]:
  """Median wall time of each fn, calls interleaved so drift hits all alike.

  Args:
    fns: name -> a call to time (its result is waited for).
    warmup: untimed rounds first.
    reps: timed rounds.
    settle: untimed calls of the same fn right before each timed one. What one
      program leaves behind can slow the next: on the CPU backend a streaming step
      after a resident one ran 0.3 s faster than after itself, and a resident step
      after a streaming one 0.6-0.9 s slower; with `settle` >= 1 each step is timed
      after its own, as in training. The step part uses 2: with 1, the streaming
      step with recompute "none" took 3.48 s, with 2, 3.12 s (docs/performance.md).

  Returns:
    name -> median seconds.
  """
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, fn in fns.items():
      for _ in range(settle):
        jax.block_until_ready(fn())
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def median_time(fn: Callable[[], Any], reps: int) -> float:
  """Median seconds of `fn` over `reps` calls after one untimed call.

  Args:
    fn: the call to time (its result is waited for).
    reps: timed calls.

  Returns:
    Median seconds.
  """
  return median_times({"fn": fn}, 1, reps)["fn"]


def steady_step_samples(trainers: dict[str, Any], batch, warmup: int, reps: int,
                        before_turn: Callable[[], Any] | None = None
                        ) -> tuple[dict[str, list[float]], list[Any]]:
  """Step times of each trainer in steady state, one per turn: the timed step starts
  as the same trainer's previous step returns, so it overlaps that step's last
  updates as in a training loop. The trainers take turns (one untimed step, one
  timed, then `wait()` so the next trainer starts on a quiet machine).

  Args:
    trainers: name -> a trainer with `step(batch)` and `wait()`.
    batch: the batch every step takes.
    warmup: untimed turns first.
    reps: timed turns.
    before_turn: called before every turn (warm-up ones too), e.g. to measure
      something the turn's figures are taken against at the same time as them.

  Returns:
    (name -> the timed turns' step seconds, what `before_turn` returned for each
    timed turn).
  """
  times, marks = {k: [] for k in trainers}, []
  for r in range(warmup + reps):
    mark = before_turn() if before_turn is not None else None
    for k, eng in trainers.items():
      eng.step(batch)
      t0 = time.perf_counter()
      eng.step(batch)
      dt = time.perf_counter() - t0
      eng.wait()
      if r >= warmup:
        times[k].append(dt)
    if r >= warmup:
      marks.append(mark)
  return times, marks


def steady_step_times(trainers: dict[str, Any], batch, warmup: int, reps: int
                      ) -> dict[str, float]:
  """Median step time of each trainer in steady state (`steady_step_samples`).

  Args:
    trainers: name -> a trainer with `step(batch)` and `wait()`.
    batch: the batch every step takes.
    warmup: untimed turns first.
    reps: timed turns.

  Returns:
    name -> median seconds of the timed step.
  """
  times, _ = steady_step_samples(trainers, batch, warmup, reps)
  return {k: statistics.median(v) for k, v in times.items()}


@functools.lru_cache(maxsize=None)
def _normal_fill(size: int) -> Callable:
  return jax.jit(lambda key: jax.random.normal(key, (size,), jnp.float32),
                 device=jax.devices("cpu")[0])


def host_normal(size: int, seed: int) -> jax.Array:
  """`size` fp32 normals on the CPU backend, in a buffer XLA made itself (a numpy
  source may be aliased, and an aliased buffer cannot be donated, which would time
  page faults instead of bandwidth).

  Args:
    size: elements.
    seed: the random key's seed.

  Returns:
    The buffer, on the CPU backend.
  """
  return _normal_fill(size)(jax.random.key(seed))


def donated_triad() -> Callable:
  """The reference for host bandwidth: `a = b + s*c`, jitted, with b donated, so it
  is written in place (TRIAD_BYTES_PER_ELEMENT per element).

  Returns:
    The jitted function of (b, c).
  """
  return jax.jit(lambda b, c: b + jnp.float32(0.5) * c, donate_argnums=(0,))


TRIAD_BYTES_PER_ELEMENT = 12  # read b, c; write a (fp32)
ADAMW_BYTES_PER_PARAM = 28  # read p, g, m, v; write p, m, v (fp32)


def child_figures(argv: list[str], what: str, env: dict[str, str] | None = None,
                  timeout_s: float = 3600.0) -> dict[str, Any]:
  """Runs a measurement in a fresh Python process and reads back its figures.

  The child is `python <argv...> <path>`: it writes its figures as JSON to the path
  given last (so nothing it logs can be mistaken for them).

  Args:
    argv: the child's arguments after the interpreter (e.g. ["-m", module, arg]).
    what: the measurement's name, for errors.
    env: the child's environment (default: this process's).
    timeout_s: the longest the child may run.

  Returns:
    The figures the child wrote.

  Raises:
    RuntimeError: the child failed, wrote nothing, or ran over `timeout_s`.
  """
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "figures.json")
    try:
      r = subprocess.run([sys.executable, *argv, out], env=env, capture_output=True,
                         text=True, check=False, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
      raise RuntimeError(f"The {what} measurement took over {timeout_s:.0f} s.") from e
    if r.returncode or not os.path.exists(out):
      raise RuntimeError(f"The {what} measurement failed:\n{r.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
      return json.load(f)
