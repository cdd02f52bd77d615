"""Figures are computed from their stated formulas."""

import pytest

from megatrain_jax import benchmark, metrics
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
  assert benchmark.LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                               n_kv_heads=32, d_ff=11008).param_count() == 6_738_415_616


def test_host_opt_ratio_formula(monkeypatch):
  monkeypatch.setattr(benchmark, "median_times",
                      lambda fns, warmup, reps: {"opt": 2.0, "triad": 1.0})
  out = benchmark.host_optimizer_bandwidth(benchmark.Suite(opt_params=1024))
  # (28 B x n / 2 s) / (12 B x n / 1 s)
  assert out["host_opt_bw_ratio"] == pytest.approx(28 / 2 / 12)


def test_step_ratio_formula(monkeypatch):
  monkeypatch.setattr(benchmark, "median_times",
                      lambda fns, warmup, reps: {"stream": 3.0, "remat": 2.0, "plain": 1.5})
  suite = benchmark.Suite(model=TINY, batch_size=2, seq_len=8)
  out = benchmark.step_ratios(suite)
  assert out["stream_over_resident_remat"] == pytest.approx(1.5)
  assert out["stream_over_resident"] == pytest.approx(2.0)
  assert out["tokens_per_s"] == pytest.approx(16 / 3.0)
  assert out["model_tflops_per_s"] == pytest.approx(
      metrics.model_flops_per_token(TINY, 8) * 16 / 3.0 / 1e12)
