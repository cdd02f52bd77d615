"""The planner: memory arithmetic by hand, prediction against measurement, the figures."""

import csv
import dataclasses
import os
import subprocess
import sys

import jax
import optax
import pytest

import megatrain_jax as mt
from megatrain_jax import figures, planner
from megatrain_jax import train as train_lib
from megatrain_jax.bench import planner as bench_planner
from megatrain_jax.bench.timing import synthetic_batch
from megatrain_jax.engine.plan import sizes

from conftest import SlowGradients

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADAMW = mt.optim.adamw(1e-4)


def test_7b_memory_by_hand():
  cfg = mt.preset("7b")
  ec = mt.EngineConfig(compute_dtype="bfloat16")
  p = planner.plan(cfg, ADAMW, ec, planner.PROFILES["h200"], 8, 4096)
  n = 6_738_415_616  # Llama-2-7B: 32 x 202,383,360 + 2 x 32000 x 4096 + 4096
  assert p.params == n
  block = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
  assert sizes.unit_sizes(cfg)[1] == block
  assert p.host["masters"] == 4 * n
  assert p.host["optimizer_state"] == 8 * n + 34 * 4  # two fp32 moments, a count per unit
  assert p.host["pinned_copies"] == 2 * (n + block)  # + the largest unit being replaced
  act = 8 * 4096 * 4096 * 2
  # Every layer's input but the last one's, whose forward runs in the head's call.
  assert p.device["activation_checkpoints"] == 31 * act
  assert p.device["params_in_flight"] == 3 * 2 * block  # 3 slots of the largest unit
  # Bytes per step: every block twice but the last (its backward runs in the head's
  # call), embedding and head once; gradients once.
  b = planner.step_bytes(cfg, ec)
  assert b["h2d"] == 2 * ((2 * 32 - 1) * block + 32000 * 4096 + 32000 * 4096 + 4096)
  assert b["d2h"] == 2 * (n - 32000 * 4096) + 4 * 32000 * 4096


def test_step_bytes_follow_each_layers_size():
  # tiny_moe: a dense layer 0 and three MoE layers twice its size. The planner's bytes
  # per step are what the engine moves (the batch's own bytes aside).
  cfg, ec = mt.preset("tiny_moe"), mt.EngineConfig()
  counts = sizes.unit_param_bytes(cfg, ec)
  assert counts[2] > 1.5 * counts[1]
  batch = synthetic_batch(cfg, 2, 32)
  with mt.StreamingTrainer.from_config(cfg, ADAMW, ec, jax.random.key(0)) as eng:
    for _ in range(2):
      eng.step(batch)
    h2d = eng.stats()["last_step"]["h2d_bytes"]
  assert h2d - sum(v.nbytes for v in batch.values()) == planner.step_bytes(cfg, ec)["h2d"]


def test_step_time_is_the_slowest_resource_plus_what_cannot_overlap():
  cfg, ec = mt.preset("7b"), mt.EngineConfig(compute_dtype="bfloat16")
  # A host fast enough that the PCIe link, not the optimizer, limits small steps.
  hw = dataclasses.replace(planner.PROFILES["h100_pcie"], host_opt_bytes_per_s=1e13)
  p = planner.plan(cfg, ADAMW, ec, hw, 1, 2048)
  t = p.times
  assert p.bottleneck == "h2d" and t["h2d"] > t["compute"]
  assert p.step_s == pytest.approx(max(t["compute"], t["h2d"], t["d2h"], t["host_opt"])
                                   + t["not_overlapped"])
  # At the break-even tokens per step, compute takes as long as the transfers.
  tokens = p.break_even_tokens
  per_token = t["compute"] / (1 * 2048)
  assert per_token * tokens == pytest.approx(t["h2d"])
  big = planner.plan(cfg, ADAMW, ec, hw, 16, 2048)
  assert big.bottleneck == "compute" and 16 * 2048 > tokens
  no_prefetch = planner.plan(cfg, ADAMW, dataclasses.replace(ec, prefetch_depth=0), hw, 16,
                             2048)
  assert no_prefetch.step_s > big.step_s


def test_largest_batch_is_the_edge_of_the_device():
  cfg, ec = mt.preset("7b"), mt.EngineConfig(compute_dtype="bfloat16", grad_accum=2)
  hw = planner.PROFILES["rtx3090"]
  b = planner.largest_batch(cfg, ec, hw.device_bytes, 2048)
  assert b > 0 and b % 2 == 0
  total = lambda b: planner.device_total(cfg, ec, b, 2048, device_bytes=hw.device_bytes)
  assert total(b)["total"] <= hw.device_bytes < total(b + 2)["total"]


def test_largest_batch_is_the_edge_of_the_host_where_the_host_is_shorter():
  # 70B with its state on the workstation's drives, updated a whole unit at a time
  # (an Optax transform): the activation checkpoints that go to host memory grow with
  # the batch, and the host runs out before the device. (The copies kept in RAM: with
  # stream_copy "auto", the plan of a batch past the edge puts them on disk.)
  cfg, tx = mt.preset("70b"), optax.adamw(1e-4)
  ec = mt.EngineConfig(compute_dtype="bfloat16", state_tier="disk", state_dir="drives",
                       state_in_flight=1, stream_copy="keep")
  hw = planner.PROFILES["workstation"]
  device_only = planner.largest_batch(cfg, ec, hw.device_bytes, 4096)
  b = planner.largest_batch(cfg, ec, hw.device_bytes, 4096, optimizer=tx, hw=hw)
  assert 0 < b < device_only
  at, over = (planner.plan(cfg, tx, ec, hw, n, 4096) for n in (b, b + 1))
  assert at.fits and not over.fits and at.largest_batch == over.largest_batch == b
  assert over.host["total"] > hw.host_bytes >= at.host["total"]
  with pytest.raises(ValueError, match="both optimizer= and hw="):
    planner.largest_batch(cfg, ec, hw.device_bytes, 4096, optimizer=tx)


def test_predicted_device_peak_matches_the_engine_on_this_machine():
  """The plan's device peak against the engine's ledger (within 15%), three shapes,
  with gradients that wait for the link, the case the plan models. (Its step time
  against a measured step is the benchmark's `planner` part: a timed comparison has
  no place in a unit test.)"""
  hw = planner.PROFILES["h100_pcie"]
  for cfg, b, t in bench_planner.CONFIGS:
    p = planner.plan(cfg, ADAMW, mt.EngineConfig(), hw, b, t)
    ec = mt.EngineConfig(transport=SlowGradients())
    with mt.StreamingTrainer.from_config(cfg, ADAMW, ec, jax.random.key(0)) as eng:
      batch = synthetic_batch(cfg, b, t)
      for _ in range(2):
        eng.step(batch)
      peak = eng.stats()["device_peak_bytes"]
    assert 0.85 <= p.device_peak / peak <= 1.15, (cfg, p.device_peak, peak)


def test_plan_script_prints_the_table():
  r = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "plan.py"),
                      "--model=7b", "--hardware=gh200", "--batch_size=auto", "--seq_len=4096"],
                     capture_output=True, text=True, timeout=120, cwd=REPO)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "largest batch that fits" in r.stdout and "bottleneck" in r.stdout
  assert "break-even tokens/step" in r.stdout


def test_auto_batch_size_fills_the_budget(tmp_path):
  cfg = mt.preset("tiny")
  budget = 8 * 2**20
  ec = mt.EngineConfig(device_budget_bytes=budget)
  tc = train_lib.TrainConfig(workdir=str(tmp_path), steps=1, batch_size="auto", seq_len=64,
                             engine=ec, max_data_bytes=400_000,
                             save_every=0, progress=False)
  b = train_lib.auto_batch_size(tc, cfg)
  assert planner.device_total(cfg, ec, b, 64, flash_attention=False)["total"] <= budget
  assert planner.device_total(cfg, ec, b + 1, 64, flash_attention=False)["total"] > budget
  assert train_lib.run(tc)[0]["step"] == 1  # and the run goes through under the budget


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_figure_quick(tmp_path, name):
  csv_path, png_path = figures.FIGURES[name].make(str(tmp_path), quick=True)
  assert os.path.getsize(png_path) > 5000
  with open(csv_path) as f:
    rows = list(csv.DictReader(f))
  sources = {r["source"] for r in rows}
  assert "measured" in sources
  if name != "convergence":
    assert "predicted" in sources


def test_figure_script_runs(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "figures",
                                                   "host_memory.py"),
                      f"--out_dir={tmp_path}", "--quick"],
                     capture_output=True, text=True, timeout=300, cwd=REPO)
  assert r.returncode == 0, r.stderr[-2000:]
  assert (tmp_path / "host_memory.png").exists() and (tmp_path / "host_memory.csv").exists()
  scripts = sorted(f[:-3] for f in os.listdir(os.path.join(REPO, "experiments", "figures"))
                   if f.endswith(".py"))
  assert scripts == sorted(figures.FIGURES)


def test_the_plan_names_the_recompute_that_fits_and_is_fastest():
  # The dense kernel: its residuals include the [T, T] probabilities.
  cfg, hw = mt.preset("7b").replace(attention_block=None), planner.PROFILES["h200"]
  ec = mt.EngineConfig(compute_dtype="bfloat16")
  # On a host of 400 GB: every residual of 32 layers (15.5 GB a layer, the [T, T]
  # attention probabilities among them) does not fit, even in host memory; keeping
  # the matmul outputs does, and skips most recompute.
  p = planner.plan(cfg, ADAMW, ec, dataclasses.replace(hw, host_bytes=400e9), 8, 4096)
  full, dots, none = (p.recompute_options[m] for m in ("full", "dots", "none"))
  assert full[0] and dots[0] and not none[0]
  assert dots[1] < full[1]
  assert planner.fastest(p.recompute_options) == "dots"
  # With the paper's 1.5 TB it fits, but moving it all costs more than recomputing.
  p = planner.plan(cfg, ADAMW, ec, hw, 8, 4096)
  assert p.recompute_options["none"][0] and planner.fastest(p.recompute_options) == "dots"
  big = dataclasses.replace(hw, device_bytes=100 * hw.device_bytes,
                            host_bytes=100 * hw.host_bytes)
  options = planner.plan(cfg, ADAMW, ec, big, 8, 4096).recompute_options
  assert options["none"][0] and planner.fastest(options) == "none"
  assert "fastest recompute that fits" in p.table()


def test_data_parallel_plan_is_per_host_and_per_device_with_the_all_reduce():
  cfg = mt.preset("7b")
  ec = mt.EngineConfig(compute_dtype="bfloat16")
  hw = planner.PROFILES["h200"]
  one = planner.plan(cfg, ADAMW, ec, hw, 4, 4096)
  many = planner.plan(cfg, ADAMW, dataclasses.replace(ec, data_parallel=8), hw, 64, 4096,
                      hosts=2)
  # Each device holds what one device does with its 4 sequences; each host the state.
  assert many.device == one.device and many.device_peak == one.device_peak
  assert many.host["masters"] == one.host["masters"]
  assert many.host["optimizer_state"] == one.host["optimizer_state"]
  # The all-reduce of the bf16 gradient: inside each host over NVLink, then 1/8 of it
  # between the hosts over each device's adapter.
  grads = planner.step_bytes(cfg, ec)["d2h"]
  want = (2 * 7 / 8 * grads / hw.interconnect_bytes_per_s
          + 2 * 1 / 2 * grads / 8 / hw.network_bytes_per_s)
  assert many.times["collectives"] == pytest.approx(want) and one.times["collectives"] == 0
  assert many.times["compute"] == pytest.approx(one.times["compute"])
  assert many.step_s == pytest.approx(one.step_s + want)  # compute-bound: it adds
  assert many.tokens_per_s == pytest.approx(16 * 4 * 4096 / many.step_s)
  assert many.largest_batch == 16 * one.largest_batch
  with pytest.raises(ValueError, match="multiple of 16"):
    planner.plan(cfg, ADAMW, dataclasses.replace(ec, data_parallel=8), hw, 20, 4096, hosts=2)


TPU_AND_AMD = ("tpu_v5p", "tpu_v6e", "mi300x")


def _largest_model(hw) -> str:
  """The largest of the paper's models whose plan fits `hw` at 1 x 4096 tokens."""
  ec = mt.EngineConfig(compute_dtype="bfloat16")
  fitting = [name for name, cfg in figures.common.PAPER_MODELS.items()
             if planner.plan(cfg, ADAMW, ec, hw, 1, 4096).fits]
  return fitting[-1]


@pytest.mark.parametrize("name", TPU_AND_AMD)
def test_tpu_and_amd_profiles_plan_a_7b_model(name):
  hw = planner.hardware(name)
  assert hw is planner.PROFILES[name] and hw.source
  # cuDNN's fused kernel is NVIDIA's: the plan counts the blockwise kernel.
  assert not hw.flash_attention
  cfg, ec = mt.preset("7b"), mt.EngineConfig(compute_dtype="bfloat16")
  p = planner.plan(cfg, ADAMW, ec, hw, 1, 4096)
  assert p.fits and p.largest_batch >= 1 and p.step_s > 0
  assert p.host["total"] <= hw.host_bytes and p.device_peak <= hw.device_bytes
  blocked = planner.plan(cfg.replace(attention_block=1024), ADAMW, ec, hw, 1, 4096)
  assert blocked.attention == "blockwise"


def test_plan_script_lists_every_profile():
  with open(os.path.join(REPO, "experiments", "plan.py"), encoding="utf-8") as f:
    doc = f.read().split('"""')[1]
  assert all(name in doc for name in planner.PROFILES), doc


def test_tpu_and_amd_profiles_follow_their_published_figures():
  cfg, ec = mt.preset("7b"), mt.EngineConfig(compute_dtype="bfloat16")
  p = {n: planner.plan(cfg, ADAMW, ec, planner.PROFILES[n], 1, 4096)
       for n in TPU_AND_AMD + ("h100_pcie",)}
  # More HBM, a larger batch: MI300X 192 GB against H100 PCIe 80 GB; v5p 95 GB
  # against v6e 32 GB.
  assert p["mi300x"].largest_batch > p["h100_pcie"].largest_batch
  assert p["tpu_v5p"].largest_batch > p["tpu_v6e"].largest_batch
  # Twice the peak (918 against 459 TFLOPS), half the compute time (plus the same
  # per-call overhead).
  assert p["tpu_v6e"].times["compute"] == pytest.approx(p["tpu_v5p"].times["compute"] / 2,
                                                        rel=0.01)
  # Host RAM decides the largest model: 1.5 TB (MI300X) against 512 GB (H100 PCIe),
  # 1,536 GiB (a v6e host) against 448 GB (a v5p VM).
  order = list(figures.common.PAPER_MODELS)
  largest = {n: order.index(_largest_model(planner.PROFILES[n])) for n in p}
  assert largest["mi300x"] > largest["h100_pcie"]
  assert largest["tpu_v6e"] > largest["tpu_v5p"]


def test_the_disk_tier_plan_moves_the_state_to_the_drives():
  cfg = mt.preset("7b")
  hw = planner.PROFILES["workstation"]
  host_ec = mt.EngineConfig(compute_dtype="bfloat16", host_threads=2)
  disk_ec = dataclasses.replace(host_ec, state_tier="disk", state_dir="drives")
  in_ram, on_disk = (planner.plan(cfg, ADAMW, ec, hw, 1, 2048) for ec in (host_ec, disk_ec))
  n = on_disk.params
  # Masters and moments leave RAM for the files. With the fused AdamW the state
  # streams through the update in pieces: in RAM about 3 x 2 pieces of 64 MiB of
  # master (a wave updating, the next read, one written behind; 12 bytes an element
  # with the moments), and a read buffer for each piece read at once.
  assert in_ram.host["masters"] == 4 * n and on_disk.host["masters"] == 0
  assert on_disk.host["optimizer_state"] == 0
  piece = 12 * (64 << 20) // 4
  assert 6 * piece <= on_disk.host["state_in_flight"] <= 6 * piece * 1.2
  assert 2 * piece <= on_disk.host["read_buffers"] <= 2 * piece * 1.2
  # Any other transform updates whole units: the largest units' states in flight (2
  # read ahead, 1 updating, 2 written behind: here 5 blocks), and a reused read
  # buffer for each read ahead at once, of the largest unit state's size (here a
  # block's), not one of each size.
  tx = optax.adamw(1e-3)
  whole = planner.plan(cfg, tx, disk_ec, hw, 1, 2048)
  block = sizes.unit_sizes(cfg)[1]
  assert whole.host["state_in_flight"] == 5 * (12 * block + 4)  # moments' count
  units = sizes.unit_sizes(cfg)
  assert block == max(units) and len(set(units)) == 3
  assert whole.host["read_buffers"] == 2 * (12 * block + 4)
  one = dataclasses.replace(disk_ec, state_in_flight=1)
  assert planner.plan(cfg, tx, one, hw, 1, 2048).host["read_buffers"] == 12 * block + 4
  assert on_disk.disk_bytes == 12 * n and in_ram.disk_bytes == 0
  state = 12 * n  # read, then written, over 4 drives
  assert on_disk.times["disk"] == pytest.approx(
      state / (4 * hw.disk_read_bytes_per_s) + state / (4 * hw.disk_write_bytes_per_s))
  assert "disk" not in in_ram.times
  # At one sequence the drives are the slowest part of the step.
  assert on_disk.bottleneck == "disk" and on_disk.step_s > on_disk.times["compute"]
  assert "disk (state files)" in on_disk.table() and "host RAM" in in_ram.table()
  small = dataclasses.replace(hw, disk_bytes=state // 8)  # 4 drives hold half the files
  assert not planner.plan(cfg, ADAMW, disk_ec, small, 1, 2048).fits
  with pytest.raises(ValueError, match="'H200 \\+ 1.5 TB host' states no NVMe drives"):
    planner.plan(cfg, ADAMW, disk_ec, planner.PROFILES["h200"], 1, 2048)
