"""The disk tier against the host tier: step time, the disk's own time, host bytes."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
from flax import nnx

from megatrain_jax.bench.host_memory import host_memory_run
from megatrain_jax.bench.suite import Suite
from megatrain_jax.bench.timing import median_times, synthetic_batch
from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.engine.host.disk import CHUNK, FileLayout, UnitFile
from megatrain_jax.engine.host.disk_support import Buffers
from megatrain_jax.models.llama import Llama
from megatrain_jax.optim import adamw


def disk_seconds(layouts: list[FileLayout], state_dir: str, threads: int,
                 reps: int = 3) -> tuple[float, float]:
  """The disk's own time to write, then read, files of these layouts, as the disk
  tier does it (direct I/O, `threads` at a time, the same checks), nothing else
  running.

  Args:
    layouts: one per file.
    state_dir: where the files go (removed after).
    threads: files in flight at once.
    reps: rounds; the median is kept.

  Returns:
    (write seconds, read seconds) for all the files once.
  """
  d = tempfile.mkdtemp(prefix="calibrate-", dir=state_dir)
  files = [UnitFile(os.path.join(d, f"c{u}"), u, b"\0" * 16, lay)
           for u, lay in enumerate(layouts)]
  rng = np.random.default_rng(0)
  data = [[rng.random(leaf.nbytes // 4 or 1, np.float32)[:leaf.nbytes // 4]
           for leaf in lay.leaves] for lay in layouts]
  buffers = Buffers()

  def write(u, r):
    with buffers(CHUNK) as bounce:
      files[u].write(data[u], r + 1, bounce)

  times: dict[str, list[float]] = {"write": [], "read": []}
  try:
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      for r in range(reps):
        t0 = time.perf_counter()
        list(pool.map(lambda u, r=r: write(u, r), range(len(files))))
        t1 = time.perf_counter()
        list(pool.map(lambda u: files[u].read(r + 1), range(len(files))))
        times["write"].append(t1 - t0)
        times["read"].append(time.perf_counter() - t1)
  finally:
    for f in files:
      f.close()
    shutil.rmtree(d, ignore_errors=True)
  return float(np.median(times["write"])), float(np.median(times["read"]))


def disk_tier(s: Suite) -> dict[str, Any]:
  """The streaming step with the state on disk over the same step with it in RAM,
  timed side by side (each step charged its updates and its writes); the state I/O's
  achieved GB/s against the same disk's raw direct-I/O GB/s, measured after; and the
  host bytes per parameter of a disk-tier run of the host-memory model.

  Args:
    s: the sizes (`state_dir`: where the state files go; None: the temporary
      directory).

  Returns:
    "disk_over_host_step"; "disk_io_efficiency": the bytes the steps read and wrote
    over the time the disk was busy with them, over the raw rate; the goal of the
    first, 1.15 x max(1, disk time / step time in RAM) ("disk_over_host_goal");
    "host_bytes_per_param_disk_tier", and the same with grad_accum 2
    ("..._accum2", reported); and the rates and times behind them.
  """
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  root = s.state_dir or tempfile.gettempdir()
  d = tempfile.mkdtemp(prefix="megatrain-disk-bench-", dir=root)
  try:
    ec = EngineConfig(state_tier="disk", state_dir=d)
    with StreamingTrainer(Llama(cfg, rngs=nnx.Rngs(0)), adamw(1e-4),
                          EngineConfig(stream_copy="keep")) as host, \
         StreamingTrainer(Llama(cfg, rngs=nnx.Rngs(0)), adamw(1e-4), ec) as dsk:
      store = dsk.host_optimizer.store
      timed = {"host": lambda: (host.step(batch), host.wait()),
               "disk": lambda: (dsk.step(batch), dsk.wait(), store.flush())}
      before = store.io_stats()
      t = median_times(timed, s.warmup, s.reps, settle=2)
      after = store.io_stats()
      layouts = list(store.layouts)
    write_s, read_s = disk_seconds(layouts, d, ec.state_in_flight)
  finally:
    shutil.rmtree(d, ignore_errors=True)
  delta = {k: after[k] - before[k] for k in ("read_bytes", "write_bytes", "read_busy_s",
                                               "write_busy_s", "busy_s", "read_misses")}
  steps = s.warmup + 3 * s.reps  # per round: two settling steps and a timed one
  total = sum(lay.file_bytes for lay in layouts)
  raw = 2 * total / (write_s + read_s)  # a step writes and reads every unit once
  achieved = (delta["read_bytes"] + delta["write_bytes"]) / delta["busy_s"]
  io_s = write_s + read_s
  rss_dir = tempfile.mkdtemp(prefix="megatrain-disk-rss-", dir=root)
  try:
    rss = host_memory_run(s.rss_model, "auto", state_dir=rss_dir)
    # With micro-batches, each unit's fp32 gradient accumulator stays in RAM.
    accum = host_memory_run(s.rss_model, "auto", state_dir=rss_dir, grad_accum=2)
  finally:
    shutil.rmtree(rss_dir, ignore_errors=True)
  return {
      "disk_over_host_step": t["disk"] / t["host"],
      "disk_over_host_goal": 1.15 * max(1.0, io_s / t["host"]),
      "disk_io_efficiency": achieved / raw,
      "disk_step_time_s": t["disk"], "disk_host_step_time_s": t["host"],
      "disk_io_s_per_step": io_s, "disk_busy_s_per_step": delta["busy_s"] / steps,
      "disk_raw_gb_per_s": raw / 1e9, "disk_achieved_gb_per_s": achieved / 1e9,
      "disk_raw_write_gb_per_s": total / write_s / 1e9,
      "disk_raw_read_gb_per_s": total / read_s / 1e9,
      "disk_achieved_write_gb_per_s": delta["write_bytes"] / delta["write_busy_s"] / 1e9,
      "disk_achieved_read_gb_per_s": delta["read_bytes"] / delta["read_busy_s"] / 1e9,
      "disk_read_misses_per_step": delta["read_misses"] / steps,
      "disk_bytes": total,
      "host_bytes_per_param_disk_tier": rss["host_bytes_per_param"],
      "host_bytes_per_param_disk_tier_accum2": accum["host_bytes_per_param"],
      "disk_rss_peak_bytes": rss["rss_peak_bytes"],
  }


def disk_copies(s: Suite) -> dict[str, Any]:
  """The disk tier with the streaming copies in files too (`stream_copy="disk"`)
  against the same tier with them in RAM, timed side by side on the benchmark model,
  and the host bytes per parameter of such a run of the host-memory model.

  Args:
    s: the sizes (`state_dir`, as `disk_tier`).

  Returns:
    "disk_copies_over_kept_step" (reported, no goal), the two step times, the
    copies' bytes read and written per step, and "host_bytes_per_param_disk_copies".
  """
  cfg, batch = s.model, synthetic_batch(s.model, s.batch_size, s.seq_len)
  root = s.state_dir or tempfile.gettempdir()
  dirs = [tempfile.mkdtemp(prefix="megatrain-copies-bench-", dir=root) for _ in range(3)]
  try:
    make = lambda d, copies: StreamingTrainer(
        Llama(cfg, rngs=nnx.Rngs(0)), adamw(1e-4),
        EngineConfig(state_tier="disk", state_dir=d, stream_copy=copies))
    with make(dirs[0], "keep") as kept, make(dirs[1], "disk") as files:
      timed = {k: lambda e=e: (e.step(batch), e.wait(), e.host_optimizer.store.flush())
               for k, e in (("kept", kept), ("files", files))}
      before = files.stats()["disk"]
      t = median_times(timed, s.warmup, s.reps, settle=2)
      after = files.stats()["disk"]
    rss = host_memory_run(s.rss_model, "disk", state_dir=dirs[2])
  finally:
    for d in dirs:
      shutil.rmtree(d, ignore_errors=True)
  steps = s.warmup + 3 * s.reps
  return {"disk_copies_over_kept_step": t["files"] / t["kept"],
          "disk_copies_step_time_s": t["files"], "disk_kept_copies_step_time_s": t["kept"],
          "disk_copy_read_bytes_per_step":
              (after["copy_read_bytes"] - before["copy_read_bytes"]) / steps,
          "disk_copy_write_bytes_per_step":
              (after["copy_write_bytes"] - before["copy_write_bytes"]) / steps,
          "host_bytes_per_param_disk_copies": rss["host_bytes_per_param"]}
