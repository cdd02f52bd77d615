"""Streaming copies on disk (`EngineConfig(stream_copy="disk")`): with the disk tier,
each unit's compute-dtype copy in a file beside its state, read at each fetch and
rewritten after each update, so RAM holds no copy of the model.

It must give the bits of the copies kept in RAM, hold none of them in RAM, read one
copy per fetch and write one per update, survive a restore, and stop with the
copy file's path when one is damaged.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import checkpoint as ckpt_lib
from megatrain_jax import planner
from megatrain_jax.engine.host import copies, disk, disk_copies, disk_support
from megatrain_jax.models.config import preset
from megatrain_jax.optim import adamw

from conftest import TINY, random_batch

CFG = TINY.replace(n_layers=3)
BATCHES = [random_batch(CFG, 4, 16, seed=s) for s in range(4)]
SETTINGS = {"model": CFG.to_dict()}


def _copies_on_disk(path, **kw):
  return mt.EngineConfig(state_tier="disk", state_dir=str(path), stream_copy="disk", **kw)


def _run(ec, tx, batches=BATCHES, trainable=None):
  kw = {} if trainable is None else {"trainable": trainable}
  with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), tx(), ec, **kw) as eng:
    losses = [eng.step(b)["loss"] for b in batches]
    eng.wait()
    return losses, eng.params(), eng.stats()


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("tx, kw", [
    (lambda: mt.optim.adamw(1e-2, weight_decay=0.1), {}),
    (lambda: mt.optim.adamw(1e-2), {"grad_accum": 2, "compute_dtype": jnp.bfloat16}),
    (lambda: optax.lion(1e-3), {"host_threads": 1}),
    (lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)), {}),
    (lambda: mt.optim.adamw(1e-2), {"stream_embed_head": False, "trainable": "frozen"}),
    (lambda: mt.optim.adamw(1e-2), {"nonfinite": "skip"}),
], ids=["fused_adamw", "grad_accum2_bf16", "optax_lion", "whole_tree",
        "resident_embed_head_frozen_layer", "updates_after_the_sweep"])
def test_copies_on_disk_give_the_bits_of_copies_in_ram(tmp_path, tx, kw):
  # The last case: the embedding and head stay on the device (refreshed from their
  # files after each update), and the first block's attention is frozen (its elements
  # in the copy files, written once, never updated).
  kw = dict(kw)
  frozen = kw.pop("trainable", None)
  trainable = (lambda path: path[:3] != ("blocks", 0, "attn")) if frozen else None
  want_losses, want, _ = _run(mt.EngineConfig(stream_copy="keep", **kw), tx,
                              trainable=trainable)
  losses, got, st = _run(_copies_on_disk(tmp_path, **kw), tx, trainable=trainable)
  assert losses == want_losses
  assert _same(got, want)
  assert st["stream_copy"] == "disk" and st["stream_bytes"] == 0  # none in RAM
  d = st["disk"]
  # One copy file per unit, written when built and after each step's update.
  cd = jnp.dtype(kw.get("compute_dtype", jnp.float32)).itemsize
  assert st["param_count"] * cd <= d["copy_file_bytes"]
  assert d["copy_write_bytes"] == (len(BATCHES) + 1) * d["copy_file_bytes"]
  # Every unit is fetched at least once a micro-batch, each fetch a read of its file.
  assert d["copy_read_bytes"] > kw.get("grad_accum", 1) * len(BATCHES) * d["copy_file_bytes"]
  assert set(os.listdir(tmp_path)) <= {disk_support.LOCK_NAME}  # removed on close


def test_each_fetch_reads_its_units_copy_file_once(tmp_path):
  # The copies on disk are read exactly where copies kept in RAM are fetched (with no
  # prefetch, so that no fetch of a next step, made or not by the time the trainer
  # closes, depends on the timing).
  reads, fetches = [], []
  read, to_device = disk_copies.CopyFiles.read, copies.UnitStore.to_device
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(disk_copies.CopyFiles, "read", lambda self, u, *a: (reads.append(u),
                                                                    read(self, u, *a))[1])
    mp.setattr(copies.UnitStore, "to_device", lambda self, u: (fetches.append(u),
                                                               to_device(self, u))[1])
    for ec in (mt.EngineConfig(stream_copy="keep", prefetch_depth=0),
               _copies_on_disk(tmp_path, prefetch_depth=0)):
      with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), mt.optim.adamw(1e-2),
                               ec) as eng:
        for b in BATCHES[:2]:
          eng.step(b)
        eng.wait()
      if not reads:
        in_ram, fetches[:] = list(fetches), []
  assert reads == fetches == in_ram
  assert sorted(set(reads)) == list(range(CFG.n_layers + 2))


def test_a_checkpoint_restores_into_copies_on_disk(tmp_path):
  (tmp_path / "state").mkdir()
  make = lambda ec, seed: mt.StreamingTrainer.from_config(CFG, mt.optim.adamw(1e-2), ec,
                                                          jax.random.key(seed))
  with make(mt.EngineConfig(), 0) as a:
    a.step(BATCHES[0])
    mgr = ckpt_lib.CheckpointManager(str(tmp_path / "ckpt"))
    mgr.save(a, SETTINGS)
    mgr.wait()
    want = [a.step(b)["loss"] for b in BATCHES[1:]]
    final = a.params()
  with make(_copies_on_disk(tmp_path / "state"), 1) as b:
    ckpt_lib.CheckpointManager(str(tmp_path / "ckpt")).restore_latest(b, SETTINGS)
    # The restore rewrote every copy from the restored masters.
    assert [b.step(x)["loss"] for x in BATCHES[1:]] == want
    assert _same(b.params(), final)


def test_a_damaged_copy_file_stops_training_naming_it(tmp_path):
  eng = mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), mt.optim.adamw(1e-2),
                            _copies_on_disk(tmp_path))
  try:
    eng.step(BATCHES[0])
    eng.wait()
    path = tmp_path / disk_copies.COPY_PATTERN.format(2)
    with open(path, "r+b") as f:
      f.seek(disk.PAGE + 5)
      byte = f.read(1)
      f.seek(disk.PAGE + 5)
      f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(disk.DiskStateError,
                       match=f"streaming copy file {path}.*does not match its checksum"):
      eng.step(BATCHES[1])
  finally:
    try:
      eng.close()
    except disk.DiskStateError:
      pass


def test_free_space_counts_the_copy_files_and_bad_configs_are_refused(tmp_path,
                                                                      monkeypatch):
  with pytest.raises(ValueError, match="stream_copy='disk' .* set state_tier='disk'"):
    mt.EngineConfig(stream_copy="disk")
  asked, figures = [], []
  real = disk_support.check_space
  monkeypatch.setattr("megatrain_jax.engine.host.disk_store.check_space",
                      lambda dirs, need: (asked.append(sum(need)), real(dirs, need)))
  for ec in (_copies_on_disk(tmp_path), mt.EngineConfig(state_tier="disk",
                                                        state_dir=str(tmp_path))):
    with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), mt.optim.adamw(1e-2),
                             ec) as eng:
      figures.append(eng.stats()["disk"])
  # The check before anything is written asked for the state and the copies.
  assert asked == [figures[0]["file_bytes"] + figures[0]["copy_file_bytes"],
                   figures[1]["file_bytes"]]
  assert "copy_file_bytes" not in figures[1]


def test_the_plan_for_123b_on_a_workstation_fits_with_the_copies_on_disk():
  cfg, hw = preset("123b").replace(max_seq_len=4096), planner.PROFILES["workstation"]
  ec = lambda copies: mt.EngineConfig(state_tier="disk", state_dir="x", host_threads=16,
                                      stream_copy=copies, compute_dtype=jnp.bfloat16)
  ram, files = (planner.plan(cfg, adamw(1e-4), ec(c), hw, 1, 4096) for c in ("keep", "disk"))
  n = sum(planner.cost.sizes.unit_sizes(cfg))
  # In RAM, the bf16 copies alone nearly fill the host; on disk, RAM holds 4 units'.
  assert not ram.fits and ram.host["pinned_copies"] >= 2 * n
  assert files.fits and files.host["pinned_copies"] == 0
  assert files.host["total"] < 0.5 * hw.host_bytes
  assert files.disk["copy files"] == 2 * n and ram.disk["copy files"] == 0
  # Each step reads every copy at each fetch and writes each once; the drives' time
  # grows by those bytes.
  read, written = files.disk["read per step"], files.disk["written per step"]
  assert written - ram.disk["written per step"] == 2 * n
  assert read - ram.disk["read per step"] == planner.cost.step_bytes(cfg, ec("disk"))["h2d"]
  assert files.times["disk"] > ram.times["disk"] and files.bottleneck == "disk"
  # The prefetch thread reads each copy before it sends it, and the update thread
  # writes each new one after its update: in turn, on the same thread.
  rate = lambda what: hw.disk_drives * getattr(hw, f"disk_{what}_bytes_per_s")
  assert files.times["h2d"] == pytest.approx(ram.times["h2d"] + (read - ram.disk[
      "read per step"]) / rate("read"))
  assert files.times["host_opt"] == pytest.approx(ram.times["host_opt"] + 2 * n / rate("write"))
  assert "disk (copy files)" in files.table()


def test_auto_puts_the_copies_on_disk_only_where_ram_is_short(tmp_path, monkeypatch):
  from megatrain_jax.engine.plan import preflight
  got = {}
  for free in (1 << 40, 1 << 20):  # a machine with room for them, one without
    monkeypatch.setattr(preflight, "available_host_bytes", lambda free=free: free)
    with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), mt.optim.adamw(1e-2),
                             mt.EngineConfig(state_tier="disk",
                                             state_dir=str(tmp_path))) as eng:
      got[free] = eng.stats()["stream_copy"]
  assert got == {1 << 40: "keep", 1 << 20: "disk"}
  # The planner decides the same way for the machine it plans.
  cfg, hw = preset("123b").replace(max_seq_len=4096), planner.PROFILES["workstation"]
  auto = lambda model: planner.plan(model, adamw(1e-4), mt.EngineConfig(
      state_tier="disk", state_dir="x", compute_dtype=jnp.bfloat16), hw, 1, 4096)
  assert auto(cfg).fits and auto(cfg).disk["copy files"] > 0
  small = preset("7b").replace(max_seq_len=4096)
  assert auto(small).fits and auto(small).disk["copy files"] == 0


def test_the_copies_bench_part(monkeypatch, tmp_path):
  from megatrain_jax import bench
  from megatrain_jax.bench import disk as bench_disk
  rounds = []

  def fake_median_times(fns, warmup, reps, settle=0):
    rounds.append((sorted(fns), settle))
    for fn in fns.values():
      fn()  # each trainer steps once: the one with the copies in files reads them
    return {"kept": 2.0, "files": 2.2}

  monkeypatch.setattr(bench_disk, "median_times", fake_median_times)
  monkeypatch.setattr(bench_disk, "host_memory_run", lambda model, copy, state_dir: (
      {"host_bytes_per_param": 1.5 if copy == "disk" and os.path.isdir(state_dir) else 9}))
  s = bench.Suite(model=CFG, batch_size=2, seq_len=8, warmup=1, reps=1,
                  state_dir=str(tmp_path))
  out = bench_disk.disk_copies(s)
  assert rounds == [(["files", "kept"], 2)]
  assert out["disk_copies_over_kept_step"] == pytest.approx(1.1)
  assert out["host_bytes_per_param_disk_copies"] == 1.5
  # One step's copies: read at each fetch, each written once.
  assert out["disk_copy_write_bytes_per_step"] > 0
  assert out["disk_copy_read_bytes_per_step"] > out["disk_copy_write_bytes_per_step"] / 4
  assert not os.listdir(tmp_path)  # its files removed


def test_the_launcher_decides_where_the_copies_go_knowing_the_batch(tmp_path, caplog):
  from megatrain_jax import train as train_lib
  from megatrain_jax.engine.plan import memory
  common = dict(steps=3, batch_size=4, seq_len=32, max_data_bytes=200_000, log_every=1,
                progress=False, model="tiny")
  tc = lambda d, ec, **kw: train_lib.TrainConfig(workdir=str(tmp_path / d),
                                                 engine=ec, **common, **kw)
  on_disk = lambda copies: mt.EngineConfig(state_tier="disk", state_dir=str(tmp_path),
                                           stream_copy=copies)
  cfg, opt = tc("x", on_disk("auto")).model_config(), train_lib.make_optimizer(tc("x", None))
  # What the run needs with the copies in RAM and on disk, batch and device included
  # (the "device" is host memory here); a limit between the two.
  need = {c: memory.host_bytes(cfg, opt, on_disk(c), batch_size=4, seq_len=32)["total"]
          + memory.device_bytes(cfg, on_disk(c), 4, 32)["total"] for c in ("keep", "disk")}
  assert need["disk"] < need["keep"]
  limit = (need["disk"] + need["keep"]) // 2
  with caplog.at_level("WARNING"):
    got = train_lib.run(tc("a", on_disk("auto"), host_memory_limit_bytes=limit))
  assert "they go to files beside the state" in caplog.text
  want = train_lib.run(tc("b", mt.EngineConfig(stream_copy="keep")))
  assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_a_failed_copy_write_is_the_error_the_run_stops_with(tmp_path, monkeypatch):
  real = disk_copies.CopyFile.write

  def full_after_build(self, arrays, generation, bounce):
    if generation > 1:  # an update's copy, not the build's: half written, then full
      with open(self.path, "r+b") as f:
        f.seek(disk.PAGE)
        f.write(b"\xff" * 64)
      raise disk.DiskStateError(28, f"Writing the streaming copy of unit {self.unit} to "
                                f"{self.path} failed: No space left on device.")
    return real(self, arrays, generation, bounce)

  monkeypatch.setattr(disk_copies.CopyFile, "write", full_after_build)
  eng = mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), mt.optim.adamw(1e-2),
                            _copies_on_disk(tmp_path))
  try:
    with pytest.raises(disk.DiskStateError, match="No space left on device") as info:
      for b in BATCHES:
        eng.step(b)
      eng.wait()
    assert "checksum" not in str(info.value)
  finally:
    try:
      eng.close()
    except disk.DiskStateError:
      pass
  assert set(os.listdir(tmp_path)) <= {disk_support.LOCK_NAME}


def test_reads_reuse_their_buffers_and_never_one_a_transfer_still_reads(tmp_path,
                                                                       monkeypatch):
  # A fresh buffer per read would fault its pages in at every fetch: the reads keep
  # their buffers. On this backend staging takes the read's buffer as it is, so a
  # buffer is reused only once the device copy made from it is ready: the bits of the
  # copies kept in RAM show that no fetch read a buffer a later read overwrote.
  import inspect
  made = []
  real = disk.aligned_buffer

  def counted(n):  # the buffers made for the copies' reads
    if any(f.function == "to_device" and f.filename.endswith("disk_copies.py")
           for f in inspect.stack()):
      made.append(n)
    return real(n)

  monkeypatch.setattr(disk_support, "aligned_buffer", counted)
  want, _, _ = _run(mt.EngineConfig(stream_copy="keep"), lambda: mt.optim.adamw(1e-2))
  losses, _, st = _run(_copies_on_disk(tmp_path), lambda: mt.optim.adamw(1e-2))
  assert losses == want
  fetches = st["disk"]["copy_read_bytes"] / (st["disk"]["copy_file_bytes"] / (CFG.n_layers + 2))
  # Smaller units' reads take a larger kept buffer: at most one buffer per read at
  # once, and per size on the way to the largest.
  assert fetches > 20 and 0 < len(made) <= disk_copies.READ_BUFFERS + 2


def test_a_copy_whose_write_failed_is_never_read(tmp_path, monkeypatch):
  # The end-to-end test above may stop on the update's error before any fetch reads
  # the half-written file; here the read comes after the failed write, always.
  files = disk_copies.CopyFiles([str(tmp_path)], [4096], np.float32,
                                {k: disk_support.Busy() for k in ("read", "write", "any")})
  files.open()
  buf = disk.aligned_buffer(files.layouts[0].data_bytes)
  files.write(0, np.arange(4096, dtype=np.float32))
  np.testing.assert_array_equal(files.read(0, buf), np.arange(4096, dtype=np.float32))

  def half_then_full(self, arrays, generation, bounce):
    with open(self.path, "r+b") as f:  # its data half replaced, its header not
      f.seek(disk.PAGE)
      f.write(b"\xff" * 64)
    raise disk.DiskStateError(28, "No space left on device.")

  monkeypatch.setattr(disk_copies.CopyFile, "write", half_then_full)
  with pytest.raises(disk.DiskStateError, match="No space"):
    files.write(0, np.zeros(4096, np.float32))
  with pytest.raises(disk.DiskStateError, match=r"streaming copy of unit 0 .* was not "
                     r"written \(.*No space left on device"):
    files.read(0, buf)
  for f in files.files:
    f.close()
