"""Checkpoints: exact resume in-process and after SIGKILL, atomicity, bad checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import checkpoint as ckpt_lib
from megatrain_jax import train as train_lib
from megatrain_jax.metrics import read_metrics

from conftest import TINY, random_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "experiments", "train.py")

OPTIMIZERS = {
    "fused_adamw": lambda: mt.optim.adamw(1e-2),
    "optax_adamw": lambda: optax.adamw(1e-2),
    "whole_tree": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    "split_clip": lambda: mt.optim.clip_by_global_norm(0.5, mt.optim.adamw(1e-2)),
}
SETTINGS = {"model": TINY.to_dict()}


def _batches(n, seed=0):
  return [random_batch(TINY, 2, 16, seed=seed + i) for i in range(n)]


def _streaming(opt, seed=0):
  return mt.StreamingTrainer.from_config(TINY, opt, mt.EngineConfig(), jax.random.key(seed))


def _same_params(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_streaming_resume_is_exact(tmp_path, name):
  batches = _batches(5)
  with _streaming(OPTIMIZERS[name]()) as a:
    for b in batches[:2]:
      a.step(b)
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, SETTINGS)
    want = [a.step(b)["loss"] for b in batches[2:]]
    mgr.wait()
    final = a.params()
  with _streaming(OPTIMIZERS[name](), seed=1) as b:  # other init: all of it is restored
    meta = ckpt_lib.CheckpointManager(str(tmp_path)).restore_latest(b, SETTINGS)
    assert meta["step"] == 2 and b.step_count == 2
    assert [b.step(x)["loss"] for x in batches[2:]] == want
    assert _same_params(b.params(), final)


def test_resume_under_another_split_of_the_host_update_is_exact(tmp_path):
  # A checkpoint holds each unit whole, whatever number of parts its update ran in.
  batches = _batches(4)
  split = lambda threads: mt.EngineConfig(host_threads=threads, host_chunk=64)
  make = lambda threads, seed: mt.StreamingTrainer.from_config(
      TINY, mt.optim.adamw(1e-2), split(threads), jax.random.key(seed))
  with make(3, 0) as a:
    assert a.stats()["host_update_parts"] == 3
    a.step(batches[0])
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, SETTINGS)
    want = [a.step(b)["loss"] for b in batches[1:]]
    mgr.wait()
    final = a.params()
  with make(1, 1) as b:
    ckpt_lib.CheckpointManager(str(tmp_path)).restore_latest(b, SETTINGS)
    assert [b.step(x)["loss"] for x in batches[1:]] == want
    assert _same_params(b.params(), final)


def test_resident_resume_is_exact(tmp_path):
  batches = _batches(4)
  a = mt.ResidentTrainer(mt.Llama(TINY, rngs=nnx.Rngs(0)), optax.adamw(1e-2))
  a.step(batches[0])
  mgr = ckpt_lib.CheckpointManager(str(tmp_path))
  mgr.save(a, SETTINGS)
  mgr.wait()
  want = [a.step(b)["loss"] for b in batches[1:]]
  b = mt.ResidentTrainer(mt.Llama(TINY, rngs=nnx.Rngs(1)), optax.adamw(1e-2))
  ckpt_lib.CheckpointManager(str(tmp_path)).restore_latest(b, SETTINGS)
  assert [b.step(x)["loss"] for x in batches[1:]] == want


def test_save_is_a_snapshot_while_training_goes_on(tmp_path, monkeypatch):
  """Steps taken while the writer is still busy do not leak into the checkpoint."""
  monkeypatch.setenv(ckpt_lib.WRITE_DELAY_ENV, "0.1")
  batches = _batches(3)
  with _streaming(mt.optim.adamw(1e-2)) as a:
    a.step(batches[0])
    at_save = a.params()
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, SETTINGS)
    a.step(batches[1])
    a.step(batches[2])
    assert not mgr.steps()  # the writer was still at work during those steps
    mgr.wait()
    assert not _same_params(a.params(), at_save)
  monkeypatch.delenv(ckpt_lib.WRITE_DELAY_ENV)
  with _streaming(mt.optim.adamw(1e-2), seed=1) as b:
    ckpt_lib.CheckpointManager(str(tmp_path)).restore_latest(b, SETTINGS)
    assert _same_params(b.params(), at_save)


def test_keeps_the_last_n(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # a relative directory, as the launcher's default workdir
  with _streaming(optax.sgd(0.1)) as a:
    mgr = ckpt_lib.CheckpointManager("checkpoints", keep=2)
    for b in _batches(4):
      a.step(b)
      mgr.save(a, SETTINGS)
    mgr.wait()
  assert mgr.steps() == [3, 4]
  assert os.path.isdir(tmp_path / "checkpoints" / "step_00000004")


def test_config_mismatch_names_the_fields(tmp_path):
  with _streaming(optax.sgd(0.1)) as a:
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, {"model": TINY.to_dict(), "run": {"batch_size": 4}})
    mgr.wait()
    other = {"model": TINY.replace(rope_theta=500.0).to_dict(), "run": {"batch_size": 8}}
    with pytest.raises(ValueError) as e:
      mgr.restore_latest(a, other)
  msg = str(e.value)
  assert "model.rope_theta: checkpoint 10000.0, this run 500.0" in msg
  assert "run.batch_size: checkpoint 4, this run 8" in msg
  assert "d_model" not in msg


def test_other_optimizer_state_is_refused(tmp_path):
  with _streaming(optax.sgd(0.1)) as a:
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, SETTINGS)
    mgr.wait()
  with _streaming(optax.adamw(1e-3)) as b, pytest.raises(ValueError, match="another optimizer"):
    mgr.restore_latest(b, SETTINGS)


def _corrupt(step_dir):
  """Overwrites the data files of the newest checkpoint's head with garbage."""
  hit = 0
  for root, _, files in os.walk(os.path.join(step_dir, "head")):
    for f in files:
      if root.endswith(os.sep + "d"):
        path = os.path.join(root, f)
        with open(path, "r+b") as fh:
          size = os.path.getsize(path)
          fh.write(np.random.default_rng(0).bytes(size))
        hit += 1
  assert hit


@pytest.mark.parametrize("damage", ["garbage", "missing_part", "bad_meta"])
def test_damaged_checkpoint_falls_back_to_the_previous(tmp_path, damage, caplog):
  batches = _batches(2)
  with _streaming(mt.optim.adamw(1e-2)) as a:
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    a.step(batches[0])
    first = a.params()
    mgr.save(a, SETTINGS)
    a.step(batches[1])
    mgr.save(a, SETTINGS)
    mgr.wait()
  newest = mgr.path(2)
  if damage == "garbage":
    _corrupt(newest)
  elif damage == "missing_part":
    import shutil
    shutil.rmtree(os.path.join(newest, "block_0001"))
  else:
    with open(os.path.join(newest, "meta.json"), "w") as f:
      f.write("{truncated")
  with _streaming(mt.optim.adamw(1e-2), seed=1) as b:
    meta = ckpt_lib.CheckpointManager(str(tmp_path)).restore_latest(b, SETTINGS)
    assert meta["step"] == 1 and b.step_count == 1
    assert _same_params(b.params(), first)
  assert "Skipping checkpoint" in caplog.text and "step_00000002" in caplog.text


def test_no_readable_checkpoint_is_an_error(tmp_path):
  with _streaming(optax.sgd(0.1)) as a:
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, SETTINGS)
    mgr.wait()
    _corrupt(mgr.path(0))
    with pytest.raises(ckpt_lib.CheckpointError, match="No checkpoint .* could be read back"):
      mgr.restore_latest(a, SETTINGS)


def test_partial_directory_is_invisible_and_removed(tmp_path, caplog):
  os.makedirs(tmp_path / "step_00000007.partial" / "head")
  mgr = ckpt_lib.CheckpointManager(str(tmp_path))
  assert mgr.steps() == []
  assert not (tmp_path / "step_00000007.partial").exists()
  assert "incomplete checkpoint" in caplog.text


def test_write_failure_surfaces_in_the_caller(tmp_path, monkeypatch):
  class Broken:
    def save(self, *a, **k):
      raise OSError("injected disk full")
  monkeypatch.setattr(ckpt_lib.ocp, "PyTreeCheckpointer", Broken)
  with _streaming(optax.sgd(0.1)) as a:
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, SETTINGS)
    with pytest.raises(ckpt_lib.CheckpointError, match="injected disk full"):
      mgr.wait()
    a.step(random_batch(TINY))  # the trainer is unaffected
  assert mgr.steps() == []


@pytest.mark.parametrize("name", ["fused_adamw", "split_clip", "optax_adamw"])
def test_a_slow_writer_holds_a_bounded_number_of_copies(tmp_path, monkeypatch, name):
  # The disk is slower than a step: the updates copy units the writer has not read
  # yet, never more than the snapshot's bound, and wait for the writer beyond it.
  monkeypatch.setenv(ckpt_lib.WRITE_DELAY_ENV, "0.05")
  batches = _batches(4)
  with _streaming(OPTIMIZERS[name]()) as a:
    a.step(batches[0])
    at_save = a.params()
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, SETTINGS)
    for b in batches[1:]:
      a.step(b)
    mgr.wait()
    stats = a.stats()
    bound = mt.engine.memory.snapshot_copy_bytes(TINY, OPTIMIZERS[name](), mt.EngineConfig())
    assert 0 < stats["snapshot_copy_peak_bytes"] <= bound
    assert stats["snapshot_copy_bytes"] == 0  # all released once the writer is done
  monkeypatch.delenv(ckpt_lib.WRITE_DELAY_ENV)
  with _streaming(OPTIMIZERS[name](), seed=1) as b:
    ckpt_lib.CheckpointManager(str(tmp_path)).restore_latest(b, SETTINGS)
    assert _same_params(b.params(), at_save)


def test_a_failed_write_releases_the_snapshot(tmp_path, monkeypatch):
  class Broken:
    def save(self, *a, **k):
      time.sleep(0.05)
      raise OSError("injected disk full")
  monkeypatch.setattr(ckpt_lib.ocp, "PyTreeCheckpointer", Broken)
  with _streaming(mt.optim.adamw(1e-2)) as a:
    mgr = ckpt_lib.CheckpointManager(str(tmp_path))
    mgr.save(a, SETTINGS)
    with pytest.raises(ckpt_lib.CheckpointError, match="injected disk full"):
      mgr.wait()
    for b in _batches(3):  # no update copies anything for a writer that is gone
      a.step(b)
    a.wait()
    assert a.stats()["snapshot_copy_bytes"] == 0
    assert a.stats()["snapshot_copy_peak_bytes"] == 0


# --- The launcher, killed and rerun ------------------------------------------

ARGS = ["--config.steps=30", "--config.batch_size=4", "--config.seq_len=32", "--config.save_every=10", "--config.log_every=1",
        "--config.max_data_bytes=100000", "--config.lr=1e-3", "--config.warmup_steps=4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  tc = train_lib.TrainConfig(workdir=str(workdir), steps=30, batch_size=4, seq_len=32,
                             save_every=10, log_every=1, max_data_bytes=100_000, lr=1e-3,
                             warmup_steps=4, progress=False)
  return {r["step"]: r["loss"] for r in train_lib.run(tc)}


def _tier_args(workdir, tier):
  """The disk tier's flags (its state files in the run's own directory; "disk_copies":
  the streaming copies there too), or none."""
  if tier == "host":
    return []
  os.makedirs(os.path.join(workdir, "state"), exist_ok=True)
  return ["--config.engine.state_tier=disk",
          f"--config.engine.state_dir={os.path.join(workdir, 'state')}",
          *(["--config.engine.stream_copy=disk"] if tier == "disk_copies" else [])]


def _start(workdir, env_extra=None, tier="host"):
  env = dict(os.environ, **(env_extra or {}))
  return subprocess.Popen([sys.executable, TRAIN, f"--config.workdir={workdir}", *ARGS,
                           *_tier_args(workdir, tier)], cwd=REPO,
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)


def _wait_for(cond, proc, timeout=240):
  t0 = time.monotonic()
  while not cond():
    assert proc.poll() is None, f"training ended early: {proc.stderr.read()[-3000:]}"
    assert time.monotonic() - t0 < timeout, "timed out waiting for the training process"
    time.sleep(0.01)


def _logged_steps(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  try:
    return [json.loads(l)["step"] for l in open(path) if l.endswith("\n")]
  except (OSError, ValueError):
    return []


def _rerun_and_compare(workdir, uninterrupted, resumed_from, tier="host"):
  r = subprocess.run([sys.executable, TRAIN, f"--config.workdir={workdir}", *ARGS,
                      *_tier_args(workdir, tier)], cwd=REPO,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"Resumed from step {resumed_from} " in r.stderr
  assert ("streaming copies on disk" in r.stderr) == (tier == "disk_copies")
  got = {rec["step"]: rec["loss"] for rec in read_metrics(os.path.join(workdir, "metrics.jsonl"))}
  assert sorted(got) == list(range(1, 31))
  after = [s for s in got if s > resumed_from]
  assert [got[s] for s in after] == [uninterrupted[s] for s in after]  # bitwise
  assert not [d for d in os.listdir(os.path.join(workdir, "checkpoints")) if "partial" in d]


# The disk tier: the state files of the killed run are left behind (stale) and
# replaced by the resumed run, which then equals the uninterrupted run in RAM.
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_sigkill_while_saving_then_resume(tmp_path, uninterrupted, tier):
  ckpts = tmp_path / "checkpoints"
  proc = _start(tmp_path, {ckpt_lib.WRITE_DELAY_ENV: "0.15"}, tier)
  try:
    # The save at step 20 starts once the one at step 10 is complete.
    _wait_for(lambda: (ckpts / "step_00000020.partial" / "head").exists(), proc)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert sorted(os.listdir(ckpts)) == ["step_00000010", "step_00000020.partial"]
  _rerun_and_compare(tmp_path, uninterrupted, resumed_from=10, tier=tier)


@pytest.mark.parametrize("tier", ["host", "disk", "disk_copies"])
def test_sigkill_between_saves_then_resume(tmp_path, uninterrupted, tier):
  ckpts = tmp_path / "checkpoints"

  def between_saves():
    steps = _logged_steps(tmp_path)
    return (steps and steps[-1] >= 14 and steps[-1] % 10 >= 4
            and not any("partial" in d for d in os.listdir(ckpts)))

  proc = _start(tmp_path, tier=tier)
  try:
    _wait_for(between_saves, proc)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  killed_at = _logged_steps(tmp_path)[-1]
  assert killed_at < 30
  latest = max(int(d.split("_")[1]) for d in os.listdir(ckpts) if "partial" not in d)
  assert latest <= killed_at
  _rerun_and_compare(tmp_path, uninterrupted, resumed_from=latest, tier=tier)
