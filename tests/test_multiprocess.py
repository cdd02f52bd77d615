"""Two processes on `jax.distributed` (CPU, gloo), 2 fake devices each, through the
unchanged launcher: they train like one process on the same global batch, write
one checkpoint, resume from it (on 2 processes or on 1), and a lost process stops
the other within a bounded time."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatrain_jax import train as train_lib

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "..", "experiments", "train.py")
# A small slice of the default data: enough for 5 steps of 8 x 128 tokens.
RUN = dict(batch_size=8, log_every=1, max_data_bytes=200_000, progress=False)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(workdir, steps, save_every, heartbeat_s=30, extra=()):
  """Starts the launcher in two processes of 2 CPU devices each."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "MEGATRAIN_HUGE_PAGES": "0"}
  args = [f"--config.workdir={workdir}", f"--config.steps={steps}", f"--config.save_every={save_every}",
          "--config.batch_size=8", "--config.log_every=1", "--config.max_data_bytes=200000", "--config.progress=false",
          f"--coordinator_address=localhost:{_free_port()}", "--num_processes=2",
          f"--heartbeat_timeout_s={heartbeat_s}", *extra]
  return [subprocess.Popen([sys.executable, TRAIN, *args, f"--process_id={p}"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for p in range(2)]


def _finish(procs, timeout=300):
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]
  return outs


def _losses(path):
  with open(path, encoding="utf-8") as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _close(got, want):
  assert got.keys() == want.keys(), (got, want)
  for step, loss in want.items():
    assert abs(got[step] - loss) <= 1e-5 * abs(loss), (step, got, want)


def test_two_processes_train_like_one_and_resume_from_one_checkpoint(tmp_path):
  ref = train_lib.run(train_lib.TrainConfig(workdir=str(tmp_path / "one"), steps=5,
                                            save_every=0, **RUN))
  want = {r["step"]: r["loss"] for r in ref}

  work = tmp_path / "two"
  # Both processes stop after step 3 (as a cluster job's time limit would have it).
  _finish(_launch(work, steps=5, save_every=5, extra=["--config.stop_after=3"]))
  first = _losses(work / "metrics.jsonl")
  _close(first, {s: want[s] for s in (1, 2, 3)})
  assert _losses(work / "process_1" / "metrics.jsonl") == first  # one update, everywhere
  # One checkpoint for the run, written once: by process 0 alone.
  ckpt = work / "checkpoints" / "step_00000003"
  with open(ckpt / "meta.json", encoding="utf-8") as f:
    assert json.load(f)["processes"] == 2
  written = [n for _, dirs, files in os.walk(ckpt) for n in dirs + files]
  assert any("process_0" in n for n in written), written
  assert not any("process_1" in n for n in written), written
  shutil.copytree(work, tmp_path / "alone")

  # The same command again resumes on both.
  outs = _finish(_launch(work, steps=5, save_every=5))
  assert all("Resumed from step 3" in out for out in outs), outs[0][-3000:]
  _close(_losses(work / "metrics.jsonl"), want)
  assert _losses(work / "process_1" / "metrics.jsonl") == _losses(work / "metrics.jsonl")

  # The state is the same in every process, so one process resumes it as well: the
  # global batches do not depend on the process count.
  alone = train_lib.run(train_lib.TrainConfig(workdir=str(tmp_path / "alone"), steps=5,
                                              save_every=5, **RUN))
  _close({r["step"]: r["loss"] for r in alone}, want)


def test_a_lost_process_stops_the_other_with_its_id_within_60_s(tmp_path):
  procs = _launch(tmp_path, steps=100_000, save_every=0, heartbeat_s=10)
  log = tmp_path / "process_1" / "metrics.jsonl"
  deadline = time.monotonic() + 240
  try:
    while not (log.exists() and len(log.read_text().splitlines()) >= 2):
      assert time.monotonic() < deadline and procs[0].poll() is None, "no step ran"
      time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    out = procs[0].communicate(timeout=60)[0]
    waited = time.monotonic() - t0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert procs[0].returncode != 0, out[-3000:]
  assert waited < 60, waited
  # JAX's coordination service names the lost task, which is the process id.
  assert re.search(r"unhealthy \(stopped sending heartbeats\):\s*1\b", out), out[-3000:]


def test_inconsistent_process_flags_are_refused_with_the_missing_ones():
  from megatrain_jax import distributed  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="--coordinator_address"):
    distributed.DistributedConfig(num_processes=2, process_id=0).validate()
  with pytest.raises(ValueError, match="not in 0 .. 1"):
    distributed.DistributedConfig("h:1", 2, 2).validate()
  assert distributed.cluster_from_env({"SLURM_NTASKS": "4"}) == "SLURM"
  assert distributed.cluster_from_env({"SLURM_NTASKS": "1"}) is None
