"""Shared fixtures: tiny configs and batches."""

import time

import jax
import numpy as np
import pytest

from megatrain_jax import data as data_lib
from megatrain_jax.engine.device import transport as transport_lib
from megatrain_jax.models import LlamaConfig

import os
import tempfile

jax.config.update("jax_default_matmul_precision", "highest")
# Many tests build trainers for the same tiny shapes; a persistent compilation cache
# lets them share XLA executables across jit objects within one pytest run, and
# (through the environment) with the launcher subprocesses the tests start.
_CACHE_DIR = os.path.join(tempfile.gettempdir(), "megatrain_jax_test_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Launchers started by tests run as started: the restart for huge pages has its own
# test (test_launch.py::test_use_huge_pages_restarts_once_with_the_tunable) and would
# add a second interpreter start to every other one.
os.environ.setdefault("MEGATRAIN_HUGE_PAGES", "0")

TINY = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                   d_ff=64, max_seq_len=32)


def random_batch(cfg, batch_size=2, seq_len=16, seed=0, mask_fraction=0.0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
  mask = (rng.random((batch_size, seq_len)) >= mask_fraction).astype(np.float32)
  mask[0, 0] = 1.0
  return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask}


@pytest.fixture(scope="session")
def stdlib_windows():
  docs = data_lib.read_documents("stdlib", max_bytes=400_000)
  return data_lib.pack(docs, 64)


class SlowGradients(transport_lib.DeviceTransport):
  """Gradients take 20 ms each to leave, many times a tiny layer's compute: the
  gradient queue fills (the worst case the device model assumes)."""

  def d2h(self, device_array):
    time.sleep(0.02)
    return super().d2h(device_array)
