"""Data parallel on 4 CPU devices against one, at the same batch per device.

The 4 devices need a process started with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`, so the measurement runs in a
child process (`python -m megatrain_jax.bench.scale_out '<json>' out.json`). On the CPU
backend the 4 devices share this machine's cores: the ratio says what the
collectives and the per-device copies cost there, not what 4 accelerators would
gain.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from megatrain_jax.bench.timing import child_figures, median_times, synthetic_batch

DEVICES = 4


def scale_out(s) -> dict[str, Any]:
  """`dp4_step_over_dp1`: the streaming step on 4 devices with one sequence each over
  the step on one device with one sequence, and the bytes each device moved.

  Args:
    s: the suite's sizes (`bench.Suite`).

  Returns:
    The ratio, both step times, and each run's host -> device and device -> host
    bytes per step (per device: every device receives every unit).

  Raises:
    RuntimeError: the child process failed (its stderr's tail is in the message) or
      took over an hour.
  """
  sizes = {"model": dataclasses.asdict(s.model), "seq_len": s.seq_len,
           "warmup": s.warmup, "reps": s.reps}
  flags = os.environ.get("XLA_FLAGS", "")
  env = {**os.environ,
         "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()}
  return child_figures(["-m", "megatrain_jax.bench.scale_out", json.dumps(sizes)],
                       "scale-out", env=env)


def _child(sizes: dict[str, Any]) -> dict[str, Any]:
  import jax  # pylint: disable=import-outside-toplevel

  from megatrain_jax.engine import EngineConfig, StreamingTrainer  # pylint: disable=import-outside-toplevel
  from megatrain_jax.models.config import LlamaConfig  # pylint: disable=import-outside-toplevel
  from megatrain_jax.optim import adamw  # pylint: disable=import-outside-toplevel

  cfg = LlamaConfig(**sizes["model"])
  t = sizes["seq_len"]
  make = lambda n: StreamingTrainer.from_config(
      cfg, adamw(1e-4), EngineConfig(data_parallel=n), jax.random.key(0))
  one, four = synthetic_batch(cfg, 1, t), synthetic_batch(cfg, DEVICES, t)
  with make(1) as a, make(DEVICES) as b:
    times = median_times({"dp1": lambda: (a.step(one), a.wait()),
                          "dp4": lambda: (b.step(four), b.wait())},
                         sizes["warmup"], sizes["reps"])
    last = {k: e.stats()["last_step"] for k, e in (("dp1", a), ("dp4", b))}
  return {"dp4_step_over_dp1": times["dp4"] / times["dp1"],
          "dp1_step_time_s": times["dp1"], "dp4_step_time_s": times["dp4"],
          "dp1_h2d_bytes_per_step": last["dp1"]["h2d_bytes"],
          "dp4_h2d_bytes_per_device_per_step": last["dp4"]["h2d_bytes"],
          "dp1_d2h_bytes_per_step": last["dp1"]["d2h_bytes"],
          "dp4_d2h_bytes_per_step": last["dp4"]["d2h_bytes"]}


if __name__ == "__main__":
  # argv: the sizes as JSON, the file the figures are written to.
  with open(sys.argv[2], "w", encoding="utf-8") as f_out:
    json.dump(_child(json.loads(sys.argv[1])), f_out)
