"""The planner's GRPO iteration (`planner.rl`, `experiments/plan.py --grpo`)."""

import dataclasses

import jax.numpy as jnp
import pytest

from megatrain_jax import planner
from megatrain_jax.engine import EngineConfig
from megatrain_jax.models.config import preset
from megatrain_jax.optim import adamw
from megatrain_jax.planner import rl

EC = EngineConfig(compute_dtype=jnp.bfloat16)
H200 = planner.hardware("h200")


def test_generation_is_resident_when_the_weights_fit_and_bound_by_memory():
  cfg = preset("7b")
  e = rl.grpo_iteration(cfg, adamw(1e-6), EC, H200, 4, 8, 128, 256)
  assert e.generation == "1 call(s) of 32 rows; resident weights, KV cache in device memory"
  # A decode step reads the bf16 weights from device memory at least once.
  floor = 256 * 2 * cfg.param_count() / H200.memory_bytes_per_s
  assert floor < e.generate_s < 3 * floor
  longer = rl.grpo_iteration(cfg, adamw(1e-6), EC, H200, 4, 8, 128, 512)
  assert longer.generate_s > 1.9 * e.generate_s
  # Without a reference, one log-prob pass instead of two.
  alone = rl.grpo_iteration(cfg, adamw(1e-6), EC, H200, 4, 8, 128, 256, reference=False)
  assert alone.logprobs_s == pytest.approx(e.logprobs_s / 2)
  assert e.total_s == pytest.approx(e.generate_s + e.logprobs_s + e.train_s)


def test_a_model_over_the_device_streams_its_weights_every_decode_step():
  cfg = preset("70b")
  e = rl.grpo_iteration(cfg, adamw(1e-6), EC, H200, 4, 8, 128, 256)
  assert "streamed weights" in e.generation
  assert e.generate_s >= 256 * 2 * cfg.param_count() / H200.h2d_bytes_per_s


def test_a_cache_over_the_device_waits_in_host_memory_unless_fewer_rows_decode_at_once():
  args = (preset("7b"), adamw(1e-6), EC, H200, 32, 8, 256, 768)
  whole = rl.grpo_iteration(*args)
  assert whole.generation.endswith("resident weights, KV cache in host memory")
  split = rl.grpo_iteration(*args, generate_rows=64)
  assert split.generation == "4 call(s) of 64 rows; resident weights, KV cache in device memory"
  assert split.generate_s < whole.generate_s / 10  # the cache no longer crosses the link


def test_a_profile_without_memory_bandwidth_is_refused():
  hw = dataclasses.replace(H200, memory_bytes_per_s=0.0)
  with pytest.raises(ValueError, match="states no device memory bandwidth"):
    rl.grpo_iteration(preset("7b"), adamw(1e-6), EC, hw, 4, 8, 128, 256)
