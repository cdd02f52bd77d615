"""Each way of updating a unit (`engine.host.updaters`), the probe that picks it, and
the store beside them (`engine.host.store`): each against plain Optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megatrain_jax import optim
from megatrain_jax.engine.host import updaters as U
from megatrain_jax.engine.host.flat import FlatSpec
from megatrain_jax.engine.host.optimizer import HostOptimizer
from megatrain_jax.engine.host.probe import resolve_mode
from megatrain_jax.engine.host.store import SHARED, HostStore

HOST = jax.local_devices(backend="cpu")[0]
SHARDING = jax.sharding.SingleDeviceSharding(HOST)
# Three units of two leaves each, of different sizes.
TREES = [{"a": np.zeros((7, 5), np.float32), "b": np.zeros(11, np.float32)},
         {"a": np.zeros((13, 3), np.float32), "b": np.zeros(2, np.float32)},
         {"a": np.zeros((4, 4), np.float32), "b": np.zeros(9, np.float32)}]


def _flat(spec, tree):  # the whole flat fp32 vector: trained leaves, then frozen ones
  trained, frozen = spec.split_np(tree)
  return trained if frozen is None else np.concatenate([trained, frozen])


def _values(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return [jax.tree.map(lambda x: (scale * rng.standard_normal(x.shape)).astype(np.float32), t)
          for t in TREES]


def _store(updater, seed=0, masks=None):
  masks = masks or [None] * len(TREES)
  specs = [FlatSpec(t, m) for t, m in zip(TREES, masks)]
  masters = [_flat(s, v) for s, v in zip(specs, _values(seed))]
  return HostStore(updater, specs, masters, HOST), specs


def _reference(tx, steps, grads, params):
  """`steps` updates of plain optax, jitted as a training step would be."""
  @jax.jit
  def step(params, state, g):
    upd, state = tx.update(g, state, params)
    return optax.apply_updates(params, upd), state

  state = tx.init(params)
  for g in grads[:steps]:
    params, state = step(params, state, g)
  return params


def _unit_trees(store, specs):
  return [s.unflatten(store.master(u)) for u, s in enumerate(specs)]


def test_fused_adamw_is_optax_adamw_bit_for_bit_in_any_split():
  tx = optim.adamw(1e-2, weight_decay=0.1)
  grads = [_values(10 + k, 3.0) for k in range(3)]
  for threads, chunk in ((1, 64), (3, 4), (2, 7)):
    updater = U.FusedAdamW(SHARDING, tx.hyper, threads, chunk)
    store, specs = _store(updater)
    want = [_reference(optax.adamw(1e-2, weight_decay=0.1), 3,
                       [jnp.asarray(_flat(specs[u], g[u])) for g in grads],
                       jnp.asarray(_flat(specs[u], _values(0)[u])))
            for u in range(3)]
    for g in grads:
      for u, spec in enumerate(specs):
        flat = jnp.asarray(_flat(spec, g[u]))
        updated = updater.update(spec, store.take(u), flat, None)
        store.put(u, updated.state)
        assert updated.sumsq is None  # one micro-batch: the device sums it
    for u in range(3):
      np.testing.assert_array_equal(store.master(u), want[u])
    updater.close()


def test_optax_units_runs_an_element_wise_transform_on_each_unit_tree():
  tx = optax.lion(1e-3, weight_decay=0.01)
  updater = U.OptaxUnits(SHARDING, tx)
  store, specs = _store(updater)
  grads = [_values(20 + k) for k in range(3)]
  for g in grads:
    for u, spec in enumerate(specs):
      store.put(u, updater.update(spec, store.take(u), jnp.asarray(_flat(spec, g[u])), None).state)
  for u, tree in enumerate(_unit_trees(store, specs)):
    want = _reference(tx, 3, [g[u] for g in grads], _values(0)[u])
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("inner", ["fused_adamw", "sgd"])
def test_global_norm_clip_equals_the_optax_chain_over_the_whole_tree(inner):
  make = {"fused_adamw": lambda: U.FusedAdamW(SHARDING, optim.adamw(1e-2).hyper, 2, 8, 0.5),
          "sgd": lambda: U.OptaxUnits(SHARDING, optax.sgd(0.1), 0.5)}[inner]
  tx_inner = {"fused_adamw": optax.adamw(1e-2), "sgd": optax.sgd(0.1)}[inner]
  updater = U.GlobalNormClip(make())
  assert updater.deferred and updater.mode == "clipped"
  store, specs = _store(updater)
  grads = [_values(30 + k, 10.0) for k in range(2)]  # norms far above 0.5: the clip engages
  for g in grads:
    for u, spec in enumerate(specs):
      store.accumulate(u, jnp.asarray(_flat(spec, g[u])))
    sums = {}
    updater.sweep(store, [store.take_gradient(u) for u in range(3)],
                  lambda u, ss: sums.update({u: ss}))
    # Each unit's sum of squares is of its gradient before the clip.
    np.testing.assert_allclose(np.sqrt(sum(sums.values())), optax.global_norm(g), rtol=1e-6)
  want = _reference(optax.chain(optax.clip_by_global_norm(0.5), tx_inner), 2, grads,
                    _values(0))
  for a, b in zip(jax.tree.leaves(_unit_trees(store, specs)), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  updater.close()


def test_whole_tree_runs_a_transform_that_mixes_units_on_the_whole_tree():
  # Labels by unit: what no per-unit update can do.
  tx = optax.multi_transform({"fast": optax.adam(1e-2), "slow": optax.sgd(1e-3)},
                             lambda tree: [jax.tree.map(lambda _: "fast" if i else "slow", t)
                                           for i, t in enumerate(tree)])
  updater = U.WholeTree(SHARDING, tx, list, list)
  store, specs = _store(updater)
  assert store.state_names() == [0, 1, 2, SHARED]
  grads = [_values(40 + k) for k in range(3)]
  for g in grads:
    for u, spec in enumerate(specs):
      store.accumulate(u, jnp.asarray(_flat(spec, g[u])))
    done = []
    updater.sweep(store, [store.take_gradient(u) for u in range(3)],
                  lambda u, ss: done.append((u, float(ss))))
    assert [u for u, _ in done] == [0, 1, 2]
    np.testing.assert_allclose(np.sqrt(sum(ss for _, ss in done)), optax.global_norm(g),
                               rtol=1e-6)
  want = _reference(tx, 3, grads, _values(0))
  for a, b in zip(jax.tree.leaves(_unit_trees(store, specs)), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tx, kind, clipped", [
    (optim.adamw(1e-3), U.FusedAdamW, False),
    (optim.clip_by_global_norm(1.0, optim.adamw(1e-3)), U.FusedAdamW, True),
    (optim.clip_by_global_norm(1.0, optax.lion(1e-3)), U.OptaxUnits, True),
    (optax.lion(1e-3), U.OptaxUnits, False),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), U.WholeTree, False),
], ids=["adamw", "clip_adamw", "clip_lion", "lion", "optax_clip_chain"])
def test_the_probe_returns_the_updater_to_use(tx, kind, clipped):
  r = resolve_mode(tx, [FlatSpec(t).abstract() for t in TREES], "auto", assemble=list)
  assert r.kind is kind and (r.max_norm is not None) == clipped
  updater = r.make(HOST, threads=2, chunk=8, assemble=list, split=list)
  want = U.GlobalNormClip if clipped else kind
  assert type(updater) is want
  assert updater.deferred == (clipped or kind is U.WholeTree)


def test_frozen_elements_have_no_master_state_or_gradient_and_round_trip():
  # Unit 1's "a" is frozen: its elements come after the trained ones, kept in the
  # frozen dtype, outside the update; the checkpoint carries them.
  masks = [None, {"a": False, "b": True}, {"a": False, "b": False}]
  opt = HostOptimizer.of_buffers(optim.adamw(1e-2), [np.zeros(1)])  # any updater
  store, specs = _store(opt.updater, masks=masks)
  assert [s.train_size for s in specs] == [46, 2, 0]
  assert [store.parts[u][0].size for u in range(3)] == [46, 2, 0]
  layout = store.state_layout(1)
  assert layout["master"] == ((2,), "float32") and layout["frozen"] == ((39,), "float32")
  before = [store.master(u) for u in range(3)]
  g = jnp.ones(2)
  store.put(1, opt.updater.update(store.trained[1], store.take(1), g, None).state)
  after = store.master(1)
  np.testing.assert_array_equal(after[2:], before[1][2:])  # the frozen part: untouched
  assert not np.array_equal(after[:2], before[1][:2])
  other, _ = _store(opt.updater, seed=5, masks=masks)
  for u in range(3):
    other.load_state(u, store.copy_state(u))
    np.testing.assert_array_equal(other.master(u), store.master(u))
  # A fetch casts the master's parts and the frozen elements, in the flat order.
  tree = specs[1].unflatten(np.concatenate([np.asarray(p) for p in store.fetch_parts(1)]))
  np.testing.assert_array_equal(tree["a"], _values(0)[1]["a"])
  opt.close()


@pytest.mark.parametrize("make", [lambda: U.FusedAdamW(SHARDING, optim.adamw(1e-2).hyper, 3, 4),
                                  lambda: U.OptaxUnits(SHARDING, optax.lion(1e-3))],
                         ids=["fused_adamw", "optax_units"])
def test_an_update_of_an_accumulated_gradient_reads_its_sum_of_squares(make):
  # The fused AdamW's chunk loop (and Optax's call) sums the squares of acc + grad,
  # the gradient the update applies, in the same pass.
  updater = make()
  store, specs = _store(updater)
  for u, spec in enumerate(specs):
    acc = jnp.asarray(_flat(spec, _values(50 + u)[u]))
    grad = jnp.asarray(_flat(spec, _values(60 + u)[u]))
    want = float(np.sum(np.square(np.asarray(acc) + np.asarray(grad))))
    updated = updater.update(spec, store.take(u), grad, acc)
    store.put(u, updated.state)
    np.testing.assert_allclose(float(updated.sumsq), want, rtol=1e-5)
  updater.close()
