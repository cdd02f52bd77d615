"""Long sequences: the device peak, XLA's scratch included, grows with T, not T^2."""

import subprocess
import sys

import jax
import optax
import pytest

import megatrain_jax as mt
from megatrain_jax.engine.plan import memory, preflight

from conftest import random_batch

# One narrow layer: attention's T x T work is what costs here, and it is kept small.
BASE = mt.LlamaConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=16,
                      max_seq_len=32768, attention_block=None)  # dense: the T x T scores
LONG = BASE.replace(attention_block=1024, mlp_chunk=8192)
BUDGET = 64 * 2**20


def test_scratch_is_counted_and_the_peak_is_linear_in_the_length():
  ec = mt.EngineConfig(activations="host", device_budget_bytes=BUDGET)
  # The full-matrix path needs the [T, T] scores (8.6 GB at 32K): the budget refuses it.
  assert memory.device_bytes(BASE, ec, 1, 32768)["total"] > 100 * BUDGET
  with pytest.raises(ValueError, match="over the device limit"):
    preflight.check_step(BASE, ec, random_batch(BASE, 1, 32768))  # what step() runs first
  peaks = {}
  with mt.StreamingTrainer.from_config(LONG, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    for t in (2048, 32768):
      eng.step(random_batch(LONG, 1, t))
      assert eng.stats()["template_scratch_bytes"] == {}  # measured only when asked
      eng.templates.measure_scratch()
      stats = eng.stats()
      scratch = stats["template_scratch_bytes"]
      assert scratch["block_bwd"] > 0 and scratch["head"] > 0
      peaks[t] = stats["device_peak_with_scratch_bytes"]
      assert peaks[t] == stats["device_peak_bytes"] + max(scratch.values())
      assert peaks[t] <= BUDGET
  assert peaks[32768] <= 10 * peaks[2048]  # 16x the tokens


def test_default_attention_memory_grows_linearly_with_sequence_length():
  # The acceptance measurement: one streaming step of a one-layer model with the
  # default LlamaConfig and EngineConfig; at 16K tokens the process's peak RSS grows by
  # at most 512 MB over the same step at 2K (the dense kernel's T x T scores alone
  # would be 4 heads x 16K^2 x 4 B = 4 GiB).
  code = """
import resource, jax, numpy as np, optax
import megatrain_jax as mt
cfg = mt.LlamaConfig(vocab_size=260, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2,
                     d_ff=128, max_seq_len=16384)
assert cfg.attention_block == "auto"
with mt.StreamingTrainer.from_config(cfg, optax.adamw(1e-3), mt.EngineConfig(),
                                     jax.random.key(0)) as t:
  peaks = []
  for n in (2048, 16384):
    ids = np.random.default_rng(0).integers(0, 260, (1, n + 1)).astype(np.int32)
    t.step({"input_ids": ids[:, :-1], "labels": ids[:, 1:],
            "loss_mask": np.ones((1, n), np.float32)})
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
print("GROWTH", peaks[1] - peaks[0])
"""
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  growth = int(out.stdout.split("GROWTH")[1])
  assert growth <= 512 * 2**20, f"peak RSS grew by {growth / 2**20:.0f} MB"
