"""The disk tier (`EngineConfig(state_tier="disk")`): each unit's master and optimizer
state in a file, read ahead of its update and written behind it.

It must give the host tier's bits, and every way its files can go wrong (a missing,
read-only, full or shared directory; a file truncated, changed or from another run)
must be one clear error naming the path, never a silently wrong update.
"""

import errno
import os
import subprocess

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import checkpoint as ckpt_lib
from megatrain_jax.engine.host import disk, disk_support

from conftest import TINY, random_batch

CFG = TINY.replace(n_layers=3)
BATCHES = [random_batch(CFG, 4, 16, seed=s) for s in range(5)]
SETTINGS = {"model": CFG.to_dict()}
OPTIMIZERS = {
    "fused_adamw": lambda: mt.optim.adamw(1e-2, weight_decay=0.1),
    "optax_lion": lambda: optax.lion(1e-3),
    "split_clip": lambda: mt.optim.clip_by_global_norm(0.05, mt.optim.adamw(1e-2)),
    "whole_tree": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
}


def _disk(path, **kw):
  return mt.EngineConfig(state_tier="disk", state_dir=str(path), **kw)


def _run(ec, tx, batches=BATCHES, trainable=None):
  kw = {} if trainable is None else {"trainable": trainable}
  with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), tx(), ec, **kw) as eng:
    losses = [eng.step(batches[0])["loss"]]
    eng.wait()
    first = eng.stats()
    losses += [eng.step(b)["loss"] for b in batches[1:]]
    eng.wait()
    return losses, eng.params(), {**eng.stats(), "first": first}


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("name, kw", [
    ("fused_adamw", {}),
    ("fused_adamw", {"grad_accum": 2, "state_in_flight": 1}),
    ("optax_lion", {"host_threads": 1}),
    ("split_clip", {}),
    ("whole_tree", {}),
], ids=["fused_adamw", "grad_accum2_depth1", "optax_lion", "split_clip", "whole_tree"])
def test_disk_tier_gives_the_host_tiers_bits(tmp_path, name, kw):
  tx = OPTIMIZERS[name]
  want_losses, want, host = _run(mt.EngineConfig(stream_copy="keep", **kw), tx)
  losses, got, st = _run(_disk(tmp_path, **kw), tx)
  assert losses == want_losses
  assert _same(got, want)
  assert st["optimizer_mode"] == host["optimizer_mode"]
  assert st["state_tier"] == "disk" and host["state_tier"] == "host"
  # Every step after the first found each unit's state read ahead of its update (the
  # first one guesses the order: the backward's, which clipped and whole-tree
  # updates do not follow).
  assert st["disk"]["read_misses"] == st["first"]["disk"]["read_misses"] <= CFG.n_layers + 2
  assert st["disk"]["write_bytes"] == (len(BATCHES) + 1) * st["disk"]["file_bytes"]
  assert not os.listdir(tmp_path) or set(os.listdir(tmp_path)) <= {disk_support.LOCK_NAME}


def test_disk_tier_equals_the_resident_trainer(tmp_path):
  tx = lambda: optax.adamw(1e-3, weight_decay=0.1)
  ref = mt.ResidentTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), tx())
  want = [ref.step(b)["loss"] for b in BATCHES[:3]]
  losses, got, _ = _run(_disk(tmp_path), tx, BATCHES[:3])
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref.params()), strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * max(np.abs(b).max(), 1e-6))


def test_frozen_units_and_striping_over_two_directories(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir(), b.mkdir()
  trainable = lambda path: path[0] != "embed"
  tx = lambda: mt.optim.adamw(1e-2)
  want_losses, want, _ = _run(mt.EngineConfig(stream_copy="keep"), tx, BATCHES[:3], trainable)
  with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), tx(),
                           _disk(f"{a},{b}"), trainable=trainable) as eng:
    files = sorted(os.listdir(a)) + sorted(os.listdir(b))
    assert len([f for f in files if f.endswith(".mtstate")]) == CFG.n_layers + 2
    assert len([f for f in os.listdir(a) if f.endswith(".mtstate")]) == 3  # units 0, 2, 4
    losses = [eng.step(x)["loss"] for x in BATCHES[:3]]
    assert losses == want_losses
    assert _same(eng.params(), want)


@pytest.mark.parametrize("src, dst", [("disk", "host"), ("host", "disk")])
def test_a_checkpoint_resumes_exactly_into_either_tier(tmp_path, src, dst):
  # On disk in pieces of 512 elements (18 to a block), joined whole in the checkpoint.
  ec = lambda tier, d: (_disk(tmp_path / d, host_chunk=256, state_piece_mb=512 * 4 / 2**20)
                        if tier == "disk" else mt.EngineConfig())
  (tmp_path / "s1").mkdir(), (tmp_path / "s2").mkdir()
  make = lambda tier, d, seed: mt.StreamingTrainer.from_config(
      CFG, mt.optim.adamw(1e-2), ec(tier, d), jax.random.key(seed))
  with make(src, "s1", 0) as a:
    for b in BATCHES[:2]:
      a.step(b)
    mgr = ckpt_lib.CheckpointManager(str(tmp_path / "ckpt"))
    mgr.save(a, SETTINGS)
    want = [a.step(b)["loss"] for b in BATCHES[2:]]
    mgr.wait()
    final = a.params()
  with make(dst, "s2", 1) as b:
    ckpt_lib.CheckpointManager(str(tmp_path / "ckpt")).restore_latest(b, SETTINGS)
    assert [b.step(x)["loss"] for x in BATCHES[2:]] == want
    assert _same(b.params(), final)


def _trainer(path, **kw):
  return mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), mt.optim.adamw(1e-2),
                             _disk(path, **kw))


def test_bad_directories_are_named_before_anything_is_written(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="needs state_dir"):
    mt.EngineConfig(state_tier="disk")
  with pytest.raises(ValueError, match="stream_copy='on_fetch'"):
    mt.EngineConfig(state_tier="disk", state_dir=str(tmp_path), stream_copy="on_fetch")
  missing = tmp_path / "nope"
  with pytest.raises(disk.DiskStateError, match=f"{missing} does not exist"):
    _trainer(missing)
  monkeypatch.setattr(disk_support.os, "access", lambda path, mode: False)
  with pytest.raises(disk.DiskStateError, match=f"{tmp_path} is not writable"):
    _trainer(tmp_path)
  monkeypatch.undo()
  small = lambda path: type("Usage", (), {"free": 1000})()
  monkeypatch.setattr(disk_support.shutil, "disk_usage", small)
  with pytest.raises(disk.DiskStateError, match=rf"{tmp_path} needs 0\.\d\d GiB .* has 0\.00 GiB"):
    _trainer(tmp_path)
  assert not os.listdir(tmp_path)


def test_a_directory_is_one_runs_at_a_time(tmp_path):
  with _trainer(tmp_path) as a:
    with pytest.raises(disk.DiskStateError, match=f"{tmp_path} is in use by another"):
      _trainer(tmp_path)
    a.step(BATCHES[0])


def test_stale_files_of_a_killed_run_are_replaced(tmp_path):
  (tmp_path / disk.FILE_PATTERN.format(1)).write_bytes(b"x" * 10000)
  losses, _, _ = _run(_disk(tmp_path), OPTIMIZERS["fused_adamw"], BATCHES[:2])
  want, _, _ = _run(mt.EngineConfig(), OPTIMIZERS["fused_adamw"], BATCHES[:2])
  assert losses == want


def _damage(path, how):
  if how == "truncated":
    os.truncate(path, os.path.getsize(path) - disk.PAGE)
  elif how == "modified":
    with open(path, "r+b") as f:
      f.seek(disk.PAGE + 5)
      byte = f.read(1)
      f.seek(disk.PAGE + 5)
      f.write(bytes([byte[0] ^ 0xFF]))
  elif how == "other_run":  # another trainer's file of the same unit, written over it
    other = path.parent.parent / "other"
    other.mkdir()
    with _trainer(other) as t:
      t.step(BATCHES[0])
      t.wait()
      theirs = (other / path.name).read_bytes()
    with open(path, "r+b") as f:  # in place: the trainer's open file sees it
      f.write(theirs)


@pytest.mark.parametrize("how, why", [
    ("truncated", "truncated or replaced"),
    ("modified", "does not match its checksum"),
    ("other_run", "written by another run"),
])
def test_a_damaged_state_file_stops_training_naming_it(tmp_path, how, why):
  d = tmp_path / "state"
  d.mkdir()
  eng = _trainer(d)
  start = None
  try:
    eng.step(BATCHES[0])
    eng.wait()
    start = eng.params()
    path = d / disk.FILE_PATTERN.format(2)  # a block: read during the backward
    _damage(path, how)
    with pytest.raises(disk.DiskStateError, match=f"{path}.*{why}"):
      for b in BATCHES[1:4]:
        eng.step(b)
      eng.wait()
  finally:
    try:
      eng.close()
    except disk.DiskStateError:
      pass
  assert start is not None


def test_a_real_full_disk_is_one_clear_error(tmp_path, monkeypatch):
  # A 256 KiB tmpfs: too small for the state files. The check of free space refuses
  # it; past that check (told the disk has room), the first write meets the file
  # system's own ENOSPC and says so, naming the file.
  small = tmp_path / "small"
  small.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                           capture_output=True, text=True)
  if mounted.returncode:
    pytest.skip("mounting a small tmpfs is not permitted here: "
                f"{mounted.stderr.strip()} (the error path itself is covered by "
                "test_a_full_disk_during_a_step_is_one_clear_error)")
  try:
    with pytest.raises(disk.DiskStateError, match=f"{small} needs .* GiB"):
      _trainer(small)
    roomy = lambda path: type("Usage", (), {"free": 1 << 40})()
    monkeypatch.setattr(disk_support.shutil, "disk_usage", roomy)
    with pytest.raises(disk.DiskStateError, match=rf"to {small}/unit_\d+\.mtstate failed: No "
                                                  r"space left on device\. The disk is full"):
      _trainer(small)
  finally:
    subprocess.run(["umount", str(small)], check=False)


def test_a_full_disk_during_a_step_is_one_clear_error(tmp_path, monkeypatch):
  eng = _trainer(tmp_path)
  try:
    eng.step(BATCHES[0])
    eng.wait()
    real = os.pwritev

    def full(fd, buffers, offset):
      if os.readlink(f"/proc/self/fd/{fd}").endswith(disk.FILE_PATTERN.format(3)):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
      return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "pwritev", full)
    with pytest.raises(disk.DiskStateError,
                       match=r"unit 3 to .*unit_00003\.mtstate failed: No space left on "
                             r"device\. The disk is full"):
      for b in BATCHES[1:4]:
        eng.step(b)
      eng.wait()
  finally:
    monkeypatch.undo()
    try:
      eng.close()
    except disk.DiskStateError:
      pass


def test_each_unit_is_on_disk_before_the_next_one_is_read(tmp_path):
  # The model never exists whole in RAM: a unit's file is written before the
  # next unit's parameters are asked for.
  from megatrain_jax.engine.build import host_units
  sizes_when_asked = []

  def units():
    for u, tree in enumerate(host_units(CFG, jax.random.key(0))):
      files = sorted(p for p in os.listdir(tmp_path) if p.endswith(".mtstate"))
      sizes_when_asked.append([os.path.getsize(tmp_path / p) for p in files])
      yield tree

  with mt.StreamingTrainer.from_units(CFG, mt.optim.adamw(1e-2), _disk(tmp_path),
                                      units()) as eng:
    layout = eng.stats()["disk"]["file_bytes"]
    eng.step(BATCHES[0])
  assert [len(s) for s in sizes_when_asked] == [CFG.n_layers + 2] * (CFG.n_layers + 2)
  for u, sizes in enumerate(sizes_when_asked):  # files opened at once, filled in turn
    assert all(size > disk.PAGE for size in sizes[:u]) and not any(sizes[u:])
  assert layout > 0


def test_a_hugging_face_checkpoint_loads_into_the_disk_tier(tmp_path):
  model = mt.Llama(CFG, rngs=nnx.Rngs(3))
  mt.hf.save_pretrained(model, CFG, str(tmp_path / "hf"))
  (tmp_path / "state").mkdir()
  tx = lambda: mt.optim.adamw(1e-2)
  with mt.hf.streaming_trainer(str(tmp_path / "hf"), tx(), mt.EngineConfig()) as host, \
       mt.hf.streaming_trainer(str(tmp_path / "hf"), tx(), _disk(tmp_path / "state")) as dsk:
    assert _same(dsk.params(), model.param_tree())
    assert [dsk.step(b)["loss"] for b in BATCHES[:2]] == [host.step(b)["loss"]
                                                          for b in BATCHES[:2]]
    assert _same(dsk.params(), host.params())


def test_disk_bench_formulas(monkeypatch, tmp_path):
  from megatrain_jax import bench
  from megatrain_jax.bench import disk as bench_disk
  rounds = []

  def fake_median_times(fns, warmup, reps, settle=0):
    rounds.append((sorted(fns), settle))
    for fn in fns.values():
      fn()  # both trainers step (the disk one also writes out its state)
    return {"host": 2.0, "disk": 2.5}

  monkeypatch.setattr(bench_disk, "median_times", fake_median_times)
  monkeypatch.setattr(bench_disk, "disk_seconds", lambda layouts, d, threads: (1.5, 1.5))
  monkeypatch.setattr(bench_disk, "host_memory_run", lambda model, copy, state_dir,
                      grad_accum=1: {"host_bytes_per_param": 3.0 + grad_accum,
                                     "rss_peak_bytes": 7, "state_dir": state_dir})
  out = bench_disk.disk_tier(bench.Suite(model=CFG, batch_size=2, seq_len=8, warmup=1, reps=1,
                                         state_dir=str(tmp_path)))
  assert rounds == [(["disk", "host"], 2)]
  assert out["disk_over_host_step"] == pytest.approx(1.25)
  assert out["disk_io_s_per_step"] == 3.0  # a write and a read of every unit
  assert out["disk_over_host_goal"] == pytest.approx(1.15 * 1.5)
  # The steps' bytes over the disk's busy time, over the raw rate (2 x the files in 3 s).
  assert out["disk_raw_gb_per_s"] == pytest.approx(2 * out["disk_bytes"] / 3.0 / 1e9)
  assert 0 < out["disk_achieved_gb_per_s"] and out["disk_io_efficiency"] == pytest.approx(
      out["disk_achieved_gb_per_s"] / out["disk_raw_gb_per_s"])
  assert out["host_bytes_per_param_disk_tier"] == 4.0
  assert out["host_bytes_per_param_disk_tier_accum2"] == 5.0
  assert out["disk_bytes"] > 0 and not os.listdir(tmp_path)  # its files removed


def test_disk_calibration_writes_and_reads_the_layouts(tmp_path):
  from megatrain_jax.bench import disk as bench_disk
  layouts = [disk.FileLayout.of([((3000,), "float32"), ((), "int32")])] * 3
  write_s, read_s = bench_disk.disk_seconds(layouts, str(tmp_path), threads=2, reps=2)
  assert write_s > 0 and read_s > 0 and not os.listdir(tmp_path)


def test_units_that_are_not_the_configs_are_refused(tmp_path):
  from megatrain_jax.engine.build import host_units
  units = list(host_units(CFG, jax.random.key(0)))
  make = lambda trees: mt.StreamingTrainer.from_units(CFG, mt.optim.adamw(1e-2),
                                                      _disk(tmp_path), iter(trees))
  with pytest.raises(ValueError, match=r"Expected 5 units \(embed, 3 blocks, head\), got 4"):
    make(units[:-1])
  with pytest.raises(ValueError, match="got more"):
    make(units + [units[-1]])
  with pytest.raises(ValueError, match="Unit 4's parameters do not have the layout"):
    make(units[:-1] + [units[1]])


def test_the_buffer_pool_reuses_the_largest_buffer_for_smaller_reads():
  page = disk.PAGE
  pool = disk_support.Buffers(keep=1)
  for n in (10 * page, 12 * page, 10 * page, 12 * page):  # a block's, the head's, ...
    with pool(n) as buf:
      assert buf.size >= n and buf.ctypes.data % page == 0
  assert pool.held_bytes() == 12 * page  # one buffer, of the largest size
  with pool(1000) as small:  # a write's bounce buffer: never the unit-sized one
    assert small.size == page
  assert pool.held_bytes() == 12 * page  # keep=1: the smaller one is not kept
  with pool(12 * page) as a, pool(10 * page) as b:  # two at once: two buffers
    assert a.ctypes.data != b.ctypes.data
  assert pool.held_bytes() == 12 * page
  with pool(30 * page):  # more than twice a kept one: a new one, kept in its place
    pass
  assert pool.held_bytes() == 30 * page


def test_reads_keep_one_buffer_per_read_ahead_not_one_per_unit_size(tmp_path):
  from megatrain_jax.engine.plan import memory
  cfg = CFG.replace(vocab_size=320)  # the embedding's and head's states outsize a block's
  # One read at a time (one update thread: a piece per thread is read at once).
  ec = _disk(tmp_path, state_in_flight=1, host_threads=1)
  tx = mt.optim.adamw(1e-2)
  with mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), tx, ec) as eng:
    for b in BATCHES[:3]:
      eng.step(b)
    eng.wait()
    held = eng.stats()["disk"]["read_buffer_bytes"]
  planned = memory.host_bytes(cfg, tx, ec)["read_buffers"]
  # One buffer, the largest unit state's (each unit here is one piece; the planner's
  # figure, up to each leaf's rounding to whole pages), where one of each size held
  # nearly three times it.
  assert planned <= held <= planned + 4 * disk.PAGE


@pytest.mark.parametrize("name, kw", [
    ("fused_adamw", {}),
    ("fused_adamw", {"grad_accum": 2, "state_in_flight": 1, "host_threads": 1}),
    ("split_clip", {}),
], ids=["fused_adamw", "grad_accum2_depth1", "split_clip"])
def test_units_stream_through_the_update_a_piece_at_a_time(tmp_path, name, kw):
  # Pieces of 512 elements: each block's state (about 9k elements) streams through
  # its update in 18 pieces, and the bits are still the host tier's.
  kw = {"host_chunk": 256, "host_threads": 2, "state_in_flight": 2, **kw}
  want_losses, want, _ = _run(mt.EngineConfig(stream_copy="keep", **kw), OPTIMIZERS[name])
  losses, got, st = _run(_disk(tmp_path, state_piece_mb=512 * 4 / 2**20, **kw),
                         OPTIMIZERS[name])
  assert losses == want_losses
  assert _same(got, want)
  # RAM held at most the pieces in flight: a wave updating, the next one read and the
  # written ones behind: 3 x state_in_flight pieces of 3 arrays, each piece 512
  # elements and at most a chunk more (`part_bounds`); never a block's whole state.
  depth, piece = kw["state_in_flight"], 3 * 4 * (512 + 256)
  assert 0 < st["disk"]["piece_peak_bytes"] <= 3 * depth * (piece + 64)  # + counts
  assert st["disk"]["piece_peak_bytes"] < 3 * 4 * CFG.block_param_count() / 2
  assert st["disk"]["read_misses"] == st["first"]["disk"]["read_misses"]
  assert st["disk"]["write_bytes"] == (len(BATCHES) + 1) * st["disk"]["file_bytes"]
