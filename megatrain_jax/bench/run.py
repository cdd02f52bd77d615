"""Runs the benchmark's parts and merges their figures (`experiments/bench.py`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from absl import logging

from megatrain_jax.bench import (attention, disk, host_memory, host_optimizer, link, lora,
                                 planner, scale_out, steps)
from megatrain_jax.bench.suite import Suite, machine


def parts() -> dict[str, Callable[[Suite], dict[str, Any]]]:
  """Every part of the suite by name.

  Returns:
    Part name -> its function, which takes the sizes and returns its figures.
  """
  return {"steps": steps.step_ratios, "link": link.link_ratios,
          "host_optimizer": host_optimizer.host_optimizer_bandwidth,
          "host_memory": host_memory.host_memory, "templates": steps.template_times,
          "host_optimizer_profile": host_optimizer.host_optimizer_profile,
          "planner": planner.planner_accuracy, "scale_out": scale_out.scale_out,
          "lora": lora.lora_ratios, "attention": attention.attention_crossover,
          "disk_tier": disk.disk_tier, "disk_copies": disk.disk_copies}


# The parts behind the goals; "templates", "host_optimizer_profile", "planner"
# (the plan's step time against a measured one), "scale_out" (4 CPU devices in a
# child process), "attention" (the dense/blockwise crossover), "disk_tier" (the disk
# tier; its goals hold on a disk of the speed docs/performance.md names) and
# "disk_copies" (its copies on disk too; reported only) run on request.
DEFAULT_PARTS = ("steps", "link", "host_optimizer", "host_memory", "lora")
PART_NAMES = ("steps", "link", "host_optimizer", "host_memory", "lora", "templates",
              "host_optimizer_profile", "planner", "scale_out", "attention", "disk_tier",
              "disk_copies")


def run_suite(s: Suite, names: tuple[str, ...] = DEFAULT_PARTS,
              table: dict[str, Any] | None = None) -> dict[str, Any]:
  """Runs the named parts of the suite and merges their figures.

  Args:
    s: the sizes.
    names: parts to run, of `PART_NAMES`.
    table: name -> part function (default: `parts()`).

  Returns:
    The figures, with the machine, model and sizes.

  Raises:
    ValueError: an unknown part name.
  """
  table = parts() if table is None else table
  unknown = [p for p in names if p not in table]
  if unknown:
    raise ValueError(f"Unknown benchmark parts {unknown}; choose from {list(table)}.")
  out: dict[str, Any] = {"machine": machine(), "model": dataclasses.asdict(s.model),
                         "batch_size": s.batch_size, "seq_len": s.seq_len,
                         "reps": s.reps, "warmup": s.warmup, "parts": list(names)}
  for name in names:
    t0 = time.perf_counter()
    out.update(table[name](s))
    logging.info("bench %s done in %.0f s", name, time.perf_counter() - t0)
  return out
