"""Long sequences: the device peak, XLA's scratch included, grows with T, not T^2."""

import jax
import optax
import pytest

import megatrain_jax as mt
from megatrain_jax.engine.plan import memory, preflight

from conftest import random_batch

# One narrow layer: attention's T x T work is what costs here, and it is kept small.
BASE = mt.LlamaConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=16,
                      max_seq_len=32768)
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
