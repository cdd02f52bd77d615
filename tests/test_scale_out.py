"""Data parallel over local devices: 4 fake CPU devices equal one on the same batch."""

import json
import os
import subprocess
import sys

import jax
import optax
import pytest

import megatrain_jax as mt

from conftest import TINY

HERE = os.path.dirname(os.path.abspath(__file__))

# Run in a child whose CPU backend has 4 devices (the flag must be set before JAX
# starts, and only there).
CHILD = r"""
import json, sys
import jax, numpy as np, optax
sys.path.insert(0, sys.argv[1])
import megatrain_jax as mt
from conftest import TINY, random_batch

assert jax.local_device_count() == 4, jax.devices()
cfg = TINY.replace(n_layers=3)


def run(n, **kw):
  ec = mt.EngineConfig(data_parallel=n, **kw)
  with mt.StreamingTrainer.from_config(cfg, optax.adamw(1e-2), ec, jax.random.key(0)) as eng:
    b0 = random_batch(cfg, 8, 16, seed=9, mask_fraction=0.25)
    loss0, grads = eng.loss_and_grads(b0)
    losses = [eng.step(random_batch(cfg, 8, 16, seed=s, mask_fraction=0.25))["loss"]
              for s in range(3)]
    # Between steps the next step's first units are on the device already: on
    # every device of the mesh.
    spread = max(len(a.sharding.device_set) for a in jax.live_arrays())
    # What each device should move per step: every fetch of the schedule (each
    # micro-batch) and the batch in, every unit's gradient (each micro-batch) out.
    from megatrain_jax.engine.plan import memory, sizes
    fetched = memory.step_plan(cfg, ec, 8, 16).schedule.fetched_bytes(
        sizes.unit_param_bytes(cfg, ec))
    formula = {"h2d": ec.grad_accum * fetched + sum(v.nbytes for v in b0.values()),
               "d2h": ec.grad_accum * sum(sizes.unit_grad_bytes(cfg, ec))}
    return loss0, grads, losses, eng.params(), {**eng.stats(), "spread": spread,
                                                "formula": formula}


def rel(a, b):
  return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()
                   / max(np.abs(np.asarray(y)).max(), 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


out = {}
one = run(1)
for name, kw in (("dp4", {}), ("dp4_host_kept", dict(activations="host", recompute="dots")),
                 ("dp2_accum", dict(grad_accum=2))):
  n = 2 if name == "dp2_accum" else 4
  got = run(n, **kw)
  out[name] = {"loss0": [got[0], one[0]], "grad_rel": rel(got[1], one[1]),
               "losses": [got[2], one[2]], "param_rel": rel(got[3], one[3]),
               "devices": got[4]["data_parallel_devices"], "spread": got[4]["spread"],
               "h2d": [got[4]["last_step"]["h2d_bytes"], one[4]["last_step"]["h2d_bytes"]],
               "d2h": [got[4]["last_step"]["d2h_bytes"], one[4]["last_step"]["d2h_bytes"]],
               "formula": [got[4]["formula"], one[4]["formula"]]}
try:
  run(4, grad_accum=4)  # a batch of 8 does not split into 4 x 4
except ValueError as e:
  out["refused"] = str(e)
print("RESULT" + json.dumps(out))
"""


def test_four_devices_train_like_one_on_the_same_global_batch():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  proc = subprocess.run([sys.executable, "-c", CHILD, HERE], env=env, capture_output=True,
                        text=True, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  out = json.loads(lines[0][len("RESULT"):])
  for name in ("dp4", "dp4_host_kept", "dp2_accum"):
    r = out[name]
    assert r["devices"] == r["spread"] == (2 if name == "dp2_accum" else 4), r
    got, want = r["loss0"]
    assert abs(got - want) <= 1e-5 * abs(want), (name, r)
    assert r["grad_rel"] < 1e-5, (name, r)
    for got, want in zip(*r["losses"]):
      assert abs(got - want) <= 1e-5 * abs(want), (name, r)
    assert r["param_rel"] < 1e-4, (name, r)
    # Each device receives what one device would, and each gradient comes back once.
    if name == "dp4":
      assert r["h2d"][0] == r["h2d"][1] and r["d2h"][0] == r["d2h"][1], r
    if name in ("dp4", "dp2_accum"):  # and that is the formula (activations stay on the device)
      for i in (0, 1):
        assert [r["h2d"][i], r["d2h"][i]] == [r["formula"][i]["h2d"], r["formula"][i]["d2h"]], r
  assert "multiple of 16" in out["refused"]


def test_more_devices_than_the_process_has_is_refused_with_the_flag_to_use():
  n = jax.local_device_count() + 1
  with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
    mt.StreamingTrainer.from_config(TINY, optax.sgd(0.1), mt.EngineConfig(data_parallel=n),
                                    jax.random.key(0))
