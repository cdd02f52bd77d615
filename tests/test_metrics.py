"""Figures are computed from their stated formulas."""

import jax
import jax.numpy as jnp
import numpy as np

import pytest

from megatrain_jax import bench, metrics
from megatrain_jax.bench import host_memory as bench_memory
from megatrain_jax.bench import host_optimizer as bench_opt
from megatrain_jax.bench import link, steps, timing
from megatrain_jax.engine.host import adamw as host_adamw
from megatrain_jax.models.config import preset
from conftest import TINY


def test_model_flops_hand_count():
  # TINY: d=32, 4 heads of 8, 2 kv heads, d_ff=64, 2 layers, vocab 64, untied.
  block = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32  # = 9280
  non_embedding = 2 * block + 32  # + final norm
  head = 32 * 64
  attention = 12 * 2 * 16 * 32  # 12 x layers x T x d, T = 16
  assert metrics.model_flops_per_token(TINY, 16) == 6 * (non_embedding + head) + attention
  assert metrics.model_flops_per_token(TINY, 16) == 136128


def test_param_count_of_llama2_7b_is_exact():
  assert metrics.LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                               n_kv_heads=32, d_ff=11008).param_count() == 6_738_415_616


def test_host_opt_ratio_formula(monkeypatch):
  ran = {}

  def fake_median_times(fns, warmup, reps):
    ran.update({k: jax.block_until_ready(fn()) for k, fn in fns.items()})
    return {"opt": 2.0, "update": 4.0, "triad": 1.0}

  monkeypatch.setattr(bench_opt, "median_times", fake_median_times)
  out = bench_opt.host_optimizer_bandwidth(bench.Suite(opt_params=1024, host_chunk=256))
  # The engine's update: one part per thread, each a whole number of the suite's chunks.
  parts, _ = ran["opt"]
  assert len(parts) == min(host_adamw.host_threads(), 4)
  assert all(p.shape[0] % 256 == 0 for p in parts)
  # (28 B x n / 2 s) / (12 B x n / 1 s)
  assert out["host_opt_bw_ratio"] == pytest.approx(28 / 2 / 12)
  assert out["host_update_with_stream_copy_bw_ratio"] == pytest.approx(28 / 4 / 12)


def test_loop_fusions_counts_the_passes_over_a_buffer():
  n = 4096
  x = jnp.arange(n, dtype=jnp.float32)
  hlo = lambda fn: jax.jit(fn).lower(x).compile().as_text()
  assert bench_opt.loop_fusions(hlo(lambda b: b * 0.5 + 1.0), n) == 1
  # Two arrays of n written (the CPU backend makes no multi-output fusion), and a
  # reduction whose scalar output is not a pass over n elements.
  two = hlo(lambda b: (jnp.sin(b) * 2.0, jnp.cos(b) + 1.0, jnp.sum(b * b)))
  assert bench_opt.loop_fusions(two, n) == 2
  assert bench_opt.loop_fusions(two, n + 1) == 0


def test_host_optimizer_profile_formulas(monkeypatch):
  ran = {}

  def fake_median_times(fns, warmup, reps):
    ran.update({k: jax.block_until_ready(fn()) for k, fn in fns.items()})
    return {"fused": 2.0, "stock": 4.0, "slabs": 1.0, "in_cache": 0.5, "one_thread": 3.0,
            "triad": 1.0}

  monkeypatch.setattr(bench_opt, "median_times", fake_median_times)
  n, slab = 4096, 1024
  out = bench_opt.host_optimizer_profile(bench.Suite(opt_params=n, opt_slab=slab))
  triad_bw = 12 * n / 1.0
  assert out["host_opt_profile_fused_bw_ratio"] == pytest.approx(28 * n / 2.0 / triad_bw)
  assert out["host_opt_profile_stock_bw_ratio"] == pytest.approx(28 * n / 4.0 / triad_bw)
  assert out["host_opt_profile_slabs_bw_ratio"] == pytest.approx(28 * n / 1.0 / triad_bw)
  assert out["host_opt_profile_in_cache_bw_ratio"] == pytest.approx(28 * n / 0.5 / triad_bw)
  assert out["host_opt_profile_one_thread_bw_ratio"] == pytest.approx(28 * n / 3.0 / triad_bw)
  assert len(ran["one_thread"][0]) == 1  # the engine's update, in one part
  # The fused update's time at the triad's bandwidth, in bytes per parameter.
  assert out["host_opt_profile_bytes_per_param_at_triad_bw"] == pytest.approx(2.0 * 12)
  assert 1 <= out["host_opt_profile_passes"] <= 3  # it writes three arrays of n
  assert len(ran["slabs"]) == n // slab and ran["slabs"][0][0].shape == (slab,)
  assert int(ran["fused"][1][0].count) == 1  # each timed update ran once, donated
  with pytest.raises(ValueError, match="opt_slab=8192 must be between 1 and opt_params=4096"):
    bench_opt.host_optimizer_profile(bench.Suite(opt_params=n, opt_slab=2 * n))


def test_settled_timing_times_each_call_right_after_one_of_its_own(monkeypatch):
  calls, clock = [], iter(range(1000))
  monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
  fns = {k: (lambda k=k: calls.append(k)) for k in "ab"}
  timing.median_times(fns, warmup=1, reps=2, settle=1)
  # The warm-up round, then per round each fn twice in a row (the second one timed).
  assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 2
  calls.clear()
  timing.median_times(fns, warmup=0, reps=2)
  assert calls == ["a", "b", "a", "b"]


def test_step_ratio_formula(monkeypatch):
  times = {"stream": 3.0, "remat": 2.0, "plain": 1.5, "none": 1.65, "dots": 1.8}
  rounds = []

  def fake_median_times(fns, warmup, reps, settle=0):
    rounds.append((list(fns), reps, settle))
    return {k: times[k] for k in fns}

  monkeypatch.setattr(steps, "median_times", fake_median_times)
  suite = bench.Suite(model=TINY, batch_size=2, seq_len=8)
  out = steps.step_ratios(suite)
  # The goal's pair is timed by itself, over more rounds; then the kept-residual
  # engines beside the resident step without remat. Each step after two of its own.
  assert rounds == [(["stream", "remat"], steps.pair_reps(suite), 2),
                    (["none", "dots", "plain"], suite.reps, 2)]
  assert steps.pair_reps(suite) > suite.reps
  assert out["stream_over_resident_remat"] == pytest.approx(1.5)
  assert out["stream_over_resident"] == pytest.approx(2.0)
  assert out["stream_over_resident_noremat"] == pytest.approx(1.1)
  assert out["stream_over_resident_dots"] == pytest.approx(1.2)
  assert out["tokens_per_s"] == pytest.approx(16 / 3.0)
  assert out["model_tflops_per_s"] == pytest.approx(
      metrics.model_flops_per_token(TINY, 8) * 16 / 3.0 / 1e12)


def test_link_ratio_formulas(monkeypatch):
  turns, links = [], []

  def samples(trainers, batch, warmup, reps, before_turn):
    turns.append(list(trainers))
    marks = []
    for _ in range(warmup + reps):
      marks.append(before_turn())
      links.append([t.gb_per_s for t in made])
    # Three timed turns, their links set from backwards of 0.1, 0.2 and 0.1 s.
    return ({"compute": [2.0, 2.0, 2.0], "prefetch": [2.5, 6.5, 2.5],
             "none": [4.0, 13.0, 4.0], "deeper": [2.0, 6.0, 2.0],
             "host": [2.6, 6.5, 2.6]}, marks[warmup:])

  backward_times = iter([0.05, 0.1, 0.1, 0.2, 0.1])  # the first, then each turn's

  monkeypatch.setattr(link, "steady_step_samples", samples)
  monkeypatch.setattr(link, "layer_backward_timer",
                      lambda *a: lambda warmup, reps: next(backward_times))
  made = []
  real_link = link.SimulatedLink

  def fake_link(gbps):
    made.append(real_link(gbps))
    return made[-1]

  monkeypatch.setattr(link, "SimulatedLink", fake_link)

  class FakeTrainer:
    def __init__(self, *a, **k):
      pass
    def __enter__(self):
      return self
    def __exit__(self, *exc):
      pass
    def step(self, batch):
      return {}
    def wait(self):
      pass
    def stats(self):
      return {"last_step": {"h2d_bytes": 3000}, "layer_bytes": 100}

  monkeypatch.setattr(link, "StreamingTrainer", FakeTrainer)
  out = link.link_ratios(bench.Suite(model=TINY, batch_size=2, seq_len=8))
  # Each turn resets every link from the backward timed then: 100 B per layer in
  # 0.1 s = 1e-6 GB/s.
  assert len(made) == 4
  assert links == [[pytest.approx(1e-6)] * 4, [pytest.approx(1e-6)] * 4,
                   [pytest.approx(5e-7)] * 4, [pytest.approx(1e-6)] * 4]
  # The step without the link takes its turns with the linked ones, not before them.
  assert turns == [["compute", "prefetch", "none", "deeper", "host"]]
  # Per turn: 3000 B take 3 s (6 s at the slower link) against 2 s of compute.
  assert out["link_transfer_s"] == pytest.approx(3.0)
  assert out["link_layer_backward_s"] == pytest.approx(0.1)
  assert out["link_compute_s"] == 2.0
  # Medians of each turn's ratio: 3/2.5, 6/6.5, 3/2.5.
  assert out["overlap_efficiency"] == pytest.approx(3.0 / 2.5)
  assert out["overlap_efficiency_turns"] == pytest.approx([3.0 / 2.5, 6.0 / 6.5, 3.0 / 2.5])
  assert out["link_layer_backward_turns_s"] == [0.1, 0.2, 0.1]
  assert out["no_prefetch_over_prefetch"] == pytest.approx(4.0 / 2.5)
  assert out["overlap_efficiency_deeper_prefetch"] == pytest.approx(3.0 / 2.0)
  assert out["link_deeper_prefetch_depth"] == link.EngineConfig().prefetch_depth + 1
  assert out["activation_offload_overhead"] == pytest.approx(2.6 / 2.5)


def test_gpu_check_script_runs_in_quick_mode(tmp_path):
  import json
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "g.json"
  r = subprocess.run([sys.executable, os.path.join(repo, "experiments", "gpu_check.py"),
                      "--quick", f"--out={out}"], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  d = json.loads(out.read_text())
  for key in ("h2d_gb_per_s_numpy_pageable", "h2d_gb_per_s_pinned_host",
              "fits_stream_over_resident_remat", "fits_on_fetch_over_keep",
              "big_tokens_per_s", "big_mfu"):
    assert d[key] > 0, key
  assert d["disk_copies_equal_kept"] is True and len(d["disk_copies_losses"]) == 3


def test_steady_step_times_times_the_second_step_of_each_turn(monkeypatch):
  clock = {"t": 0.0}
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["t"])

  class Fake:
    def __init__(self, durations):
      self.durations, self.calls = iter(durations), []
    def step(self, batch):
      clock["t"] += next(self.durations)
      self.calls.append("step")
    def wait(self):
      self.calls.append("wait")

  # Per turn: an untimed step, then the timed one; warm-up turns are not timed.
  a = Fake([9, 9, 9, 1, 9, 3, 9, 2])
  b = Fake([9, 9, 9, 5, 9, 4, 9, 6])
  t = timing.steady_step_times({"a": a, "b": b}, None, warmup=1, reps=3)
  assert t == {"a": 2, "b": 5}
  assert a.calls[:3] == ["step", "step", "wait"] and len(a.calls) == 12


def test_host_bytes_per_param_formula(monkeypatch):
  # (peak RSS of the training process - RSS before the model existed) / parameters.
  monkeypatch.setattr(bench_memory, "rss_bytes", lambda: 1_000_000)
  monkeypatch.setattr(bench_memory, "peak_rss_bytes", lambda: 5_120_000)
  out = bench_memory.host_memory_child("tiny", steps=1)
  n = preset("tiny").param_count()
  assert out["rss_param_count"] == n
  assert out["host_bytes_per_param"] == (5_120_000 - 1_000_000) / n


def test_a_child_measures_its_own_peak_not_its_parents():
  # The host-memory figure runs in a child of the benchmark; a parent that had used
  # 1 GiB more than the child ever does must not show in the child's peak.
  big = np.ones(2**27)  # 1 GiB, touched
  code = ("import json, sys; from megatrain_jax.bench import host_memory as m; "
          "json.dump({'peak': m.peak_rss_bytes()}, open(sys.argv[1], 'w'))")
  peak = timing.child_figures(["-c", code], "peak")["peak"]
  assert 0 < peak < big.nbytes // 2, peak


def test_host_memory_reports_both_streaming_copy_settings(monkeypatch):
  runs = []
  monkeypatch.setattr(bench_memory, "host_memory_run", lambda model, copy: (
      runs.append((model, copy)) or {"host_bytes_per_param": {"auto": 13.0, "keep": 15.0}[copy]}))
  out = bench_memory.host_memory(bench.Suite(rss_model="tiny"))
  assert runs == [("tiny", "auto"), ("tiny", "keep")]
  assert out["host_bytes_per_param"] == 13.0 and out["host_bytes_per_param_kept_copies"] == 15.0


def test_run_suite_runs_the_named_parts_only(monkeypatch):
  ran = []
  table = {"steps": lambda s: ran.append("steps") or {"stream_over_resident_remat": 1.0},
           "link": lambda s: ran.append("link") or {"overlap_efficiency": 1.0}}
  out = bench.run_suite(bench.Suite(model=TINY), ("link",), table=table)
  assert ran == ["link"] and out["overlap_efficiency"] == 1.0 and out["parts"] == ["link"]
  assert "stream_over_resident_remat" not in out
  with pytest.raises(ValueError, match=r"Unknown benchmark parts \['step'\]"):
    bench.run_suite(bench.Suite(model=TINY), ("step",), table=table)
  assert sorted(bench.parts()) == sorted(bench.PART_NAMES)


def test_template_profile_formula(monkeypatch):
  calls = {}

  def fake_median_times(fns, warmup, reps, settle=0):
    calls["out"] = [jax.block_until_ready(fn()) for fn in fns.values()]  # both run
    return {"templates": 3.0, "remat": 2.0}

  monkeypatch.setattr(steps, "median_times", fake_median_times)
  out = steps.template_times(bench.Suite(model=TINY, batch_size=2, seq_len=8))
  assert out["templates_over_resident_remat"] == pytest.approx(1.5)
  g_embed, ok = calls["out"][0]  # the templates ran through to the embedding's gradient
  assert g_embed.shape == (TINY.vocab_size * TINY.d_model,) and bool(ok)
  assert out["block_fwd_scratch_bytes"] > 0 and out["block_bwd_scratch_bytes"] > 0
  # The tail (last layer and head in one call) holds the most: the layer's and the
  # logits'.
  assert out["tail_scratch_bytes"] >= out["block_bwd_scratch_bytes"]


def test_a_child_measurement_returns_what_it_wrote_and_a_failure_is_raised():
  from megatrain_jax.bench.timing import child_figures
  code = "import json, sys; json.dump({'x': 2}, open(sys.argv[1], 'w'))"
  assert child_figures(["-c", code], "test") == {"x": 2}
  with pytest.raises(RuntimeError, match="(?s)The broken measurement failed:.*ZeroDivision"):
    child_figures(["-c", "1 / 0"], "broken")


def test_the_plot_draws_the_held_out_loss_beside_the_training_loss(tmp_path):
  records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0},
             {"step": 2, "eval_loss": 4.5, "eval_perplexity": 90.0}, {"step": 3, "loss": 3.5}]
  lines = metrics.plot_loss(records, str(tmp_path / "loss.png"))
  assert lines == {"train": [(1, 5.0), (2, 4.0), (3, 3.5)], "held out": [(2, 4.5)]}
  assert (tmp_path / "loss.png").stat().st_size > 1000
  assert list(metrics.plot_loss(records[:2], str(tmp_path / "t.png"))) == ["train"]
