"""Pinned host memory on a GPU: counted from the plan, XLA's limit set and checked."""

import os
import subprocess
import sys

import pytest

import megatrain_jax as mt
from megatrain_jax.engine.plan import memory, pinned, sizes

GiB = 2**30


def test_pinned_bytes_are_the_kept_copies_and_the_sent_checkpoints():
  cfg = mt.preset("small")
  n, largest = sum(sizes.unit_sizes(cfg)), max(sizes.unit_sizes(cfg))
  act = 8 * 512 * cfg.d_model * 2
  groups = -(-cfg.n_layers // 2)
  for activations, kept in (("device", None), ("host", 1), ("auto", 1), ("host", None)):
    ec = mt.EngineConfig(compute_dtype="bfloat16", checkpoint_every=2,
                         activations=activations, device_checkpoints=kept)
    # All but the last group's inputs (or all but the last few that fit within the
    # device peak, by default) wait in pinned memory, counted where they might go.
    if activations == "host" and kept is None:
      kept = memory.step_plan(cfg, ec, 8, 512).schedule.device_checkpoints
      assert kept == 3  # of 4 groups: 3 within the peak
    ckpts = 0 if activations == "device" else (groups - kept) * act
    got = pinned.pinned_bytes(cfg, ec, 8, 512)
    assert got == {"stream_copies": 2 * (n + largest), "activation_checkpoints": ckpts,
                   "total": 2 * (n + largest) + ckpts}
  on_fetch = mt.EngineConfig(stream_copy="on_fetch", activations="device")
  assert pinned.pinned_bytes(cfg, on_fetch, 8, 512)["total"] == 0


def test_counting_them_starts_no_backend():
  # What lets a launcher set the limit before XLA's GPU client reads it.
  code = ("import megatrain_jax as mt; from megatrain_jax.engine.plan import pinned; "
          "from jax._src import xla_bridge; "
          "p = pinned.pinned_bytes(mt.preset('30b_a3b'), mt.EngineConfig("
          "compute_dtype='bfloat16'), 8, 4096); "
          "assert not xla_bridge.backends_are_initialized(); "
          "print(pinned.configure(p) // 2**30, pinned.os.environ[pinned.ENV])")
  env = {k: v for k, v in os.environ.items() if k != pinned.ENV}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  limit, var = out.stdout.split()
  # 30B-A3B in bf16 keeps 58 GiB of copies and sends 4.9 GiB of checkpoints (39 of its
  # 48 layers' inputs; the last 9 stay on the device within the peak): over 64 with
  # headroom.
  assert int(limit) == int(var) == pinned.limit_for(67_544_977_920) > pinned.DEFAULT_GIB


def test_a_user_setting_wins_and_is_checked(monkeypatch):
  need = {"stream_copies": 70 * GiB, "activation_checkpoints": 6 * GiB, "total": 76 * GiB}
  monkeypatch.setenv(pinned.ENV, "128")
  assert pinned.configure(need) == 128 * GiB
  monkeypatch.setenv(pinned.ENV, "64")
  with pytest.raises(ValueError) as e:
    pinned.configure(need)
  assert f"{pinned.ENV}=85" in str(e.value) and "stream_copies 70.00 GiB" in str(e.value)
  with pytest.raises(ValueError, match="over XLA's limit of 64 GiB"):
    pinned.check(need)
  monkeypatch.setenv(pinned.ENV, "lots")
  with pytest.raises(ValueError, match="not a positive whole number"):
    pinned.limit_bytes()


def test_left_unset_below_the_default(monkeypatch):
  monkeypatch.delenv(pinned.ENV, raising=False)
  monkeypatch.setattr(pinned, "_backends_started", lambda: False)
  assert pinned.configure({"total": 10 * GiB}) == 64 * GiB
  assert pinned.ENV not in os.environ


def test_the_preflight_refuses_a_run_over_the_limit_on_a_gpu(monkeypatch):
  import optax
  from megatrain_jax.engine.plan import preflight
  monkeypatch.setattr(preflight, "on_gpu", lambda: True)  # the check applies on a GPU
  monkeypatch.setenv(pinned.ENV, "1")
  cfg = mt.preset("300m")  # 0.59 GiB of bf16 copies and 0.78 GiB of checkpoints
  ec = mt.EngineConfig(compute_dtype="bfloat16", stream_copy="keep", activations="host")
  with pytest.raises(ValueError) as e:
    preflight.check_fits(cfg, optax.sgd(0.1), ec, 16, 1024, host_limit=2**50,
                         device_limit=2**50)
  text = str(e.value)
  assert pinned.ENV in text and "stream_copies 0.59 GiB" in text
  monkeypatch.setenv(pinned.ENV, "64")
  plan = preflight.check_fits(cfg, optax.sgd(0.1), ec, 16, 1024, host_limit=2**50,
                              device_limit=2**50)
  assert plan["pinned"]["total"] == pinned.pinned_bytes(cfg, ec, 16, 1024)["total"]
