"""The host update path with the fused AdamW over parts: same bits as optax, in place,
any split; the store's checkpoint layout whatever the split."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from megatrain_jax import optim
from megatrain_jax.engine.host.adamw import chunked_adamw_update, part_bounds
from megatrain_jax.engine.host.optimizer import HostOptimizer

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)


def _opt(tx, sizes, threads, chunk, seed=0):
  rng = np.random.default_rng(seed)
  masters = [rng.standard_normal(n).astype(np.float32) for n in sizes]
  return HostOptimizer.of_buffers(tx, masters, threads=threads, chunk=chunk)


def _grads(sizes, steps, seed=1):
  rng = np.random.default_rng(seed)
  return [[jnp.asarray(3 * rng.standard_normal(n), jnp.float32) for n in sizes]
          for _ in range(steps)]


@pytest.mark.parametrize("size, parts, chunk", [
    (1000, 3, 64), (1000, 2, 1000), (1000, 4, 999), (10, 8, 4), (4096, 4, 1024), (5, 3, 64)])
def test_part_bounds_cover_the_buffer_in_whole_chunks(size, parts, chunk):
  b = part_bounds(size, parts, chunk)
  assert b[0][0] == 0 and b[-1][1] == size and 1 <= len(b) <= parts
  assert all(lo < hi for lo, hi in b)
  assert all(hi == lo2 for (_, hi), (lo2, _) in zip(b, b[1:]))
  assert all(lo % chunk == 0 for lo, _ in b)
  # Balanced: the parts differ by at most one chunk (the last also takes the remainder).
  whole = [(hi - lo) // chunk for lo, hi in b]
  assert max(whole) - min(whole) <= 1


@pytest.mark.parametrize("lr", [1e-3, SCHEDULE])
@pytest.mark.parametrize("threads, chunk", [(1, 64), (3, 64), (2, 100), (4, 7)])
def test_parts_update_is_optax_adamw_bit_for_bit(lr, threads, chunk):
  sizes = [1000, 37]
  tx = optim.adamw(lr, b1=0.8, b2=0.95, eps=1e-7, weight_decay=0.1)
  ref = optax.adamw(lr, b1=0.8, b2=0.95, eps=1e-7, weight_decay=0.1)
  opt = _opt(tx, sizes, threads, chunk)
  assert opt.updater.fused and len(opt.store.parts[0]) == min(threads, 1000 // chunk)
  p_ref = [jnp.asarray(opt.store.master(u)) for u in range(2)]
  s_ref = [ref.init(p) for p in p_ref]

  @jax.jit
  def stock(p, g, s):
    u, s = ref.update(g, s, p)
    return optax.apply_updates(p, u), s

  for grads in _grads(sizes, 4):
    for u, g in enumerate(grads):
      opt.update_unit(u, g, stream=False)
      p_ref[u], s_ref[u] = stock(p_ref[u], g, s_ref[u])
      np.testing.assert_array_equal(opt.store.master(u), p_ref[u])
      state = opt.store.copy_state(u)
      for i, x in enumerate(jax.tree.leaves(s_ref[u])):
        np.testing.assert_array_equal(state[f"state_{i:03d}"], x)
  opt.close()


def _micro_batch_steps(opt, grads):
  """Each step's gradient in two halves: one accumulated, one given to the update."""
  for g in grads:
    for u in range(len(g)):
      opt.store.accumulate(u, 0.5 * g[u])
      opt.update_unit(u, 0.5 * g[u], stream=False)


def test_accumulated_gradients_same_bits_whatever_the_split():
  # Summed inside the update, the gradient may round differently than optax given
  # the sum (XLA contracts multiply-adds into FMAs expression by expression), but
  # the split into parts changes nothing.
  sizes = [1000, 37]
  grads = _grads(sizes, 3)
  many, one = _opt(optim.adamw(1e-3), sizes, 3, 64), _opt(optim.adamw(1e-3), sizes, 1, 64)
  ref = optax.adamw(1e-3)
  p_ref = [jnp.asarray(one.store.master(u)) for u in range(2)]
  s_ref = [ref.init(p) for p in p_ref]
  _micro_batch_steps(many, grads)
  _micro_batch_steps(one, grads)
  for g in grads:
    for u in range(2):
      upd, s_ref[u] = ref.update(g[u], s_ref[u], p_ref[u])
      p_ref[u] = optax.apply_updates(p_ref[u], upd)
  for u in range(2):
    np.testing.assert_array_equal(many.store.master(u), one.store.master(u))
    np.testing.assert_allclose(many.store.master(u), p_ref[u], rtol=1e-6)
  many.close()


def test_clipped_parts_match_one_part_bit_for_bit():
  sizes = [1000, 300]
  tx = lambda: optim.clip_by_global_norm(0.5, optim.adamw(1e-3))
  many, one = _opt(tx(), sizes, 3, 64), _opt(tx(), sizes, 1, 64)
  assert many.updater.mode == one.updater.mode == "clipped"
  assert [len(p) for p in many.store.parts] == [3, 3]
  assert [len(p) for p in one.store.parts] == [1, 1]
  for grads in _grads(sizes, 3):
    for opt in (many, one):
      for u, g in enumerate(grads):
        opt.store.accumulate(u, g)
      done = []
      opt.update_all(stream=False, on_unit=lambda u, new: done.append(u))
      assert done == [0, 1]
  for u in range(2):
    np.testing.assert_array_equal(many.store.master(u), one.store.master(u))
  many.close()


def test_checkpoint_layout_does_not_depend_on_the_split():
  sizes = [1000, 37]
  tx = lambda: optim.adamw(1e-3)
  a, b = _opt(tx(), sizes, 3, 64), _opt(tx(), sizes, 1, 64)
  grads = _grads(sizes, 3)
  for opt in (a, b):
    for g in grads[:2]:
      for u in range(2):
        opt.update_unit(u, g[u], stream=False)
  for u in range(2):
    assert a.store.state_layout(u) == b.store.state_layout(u)
    sa, sb = a.store.copy_state(u), b.store.copy_state(u)
    assert sa.keys() == sb.keys()
    for k in sa:
      np.testing.assert_array_equal(sa[k], sb[k])
  # One split's state loaded into the other continues exactly as the other would.
  c = _opt(tx(), sizes, 2, 64, seed=7)
  for u in range(2):
    c.store.load_state(u, b.store.copy_state(u))
  for opt in (b, c):
    for u in range(2):
      opt.update_unit(u, grads[2][u], stream=False)
  for u in range(2):
    np.testing.assert_array_equal(c.store.master(u), b.store.master(u))
    assert c.store.state_layout(u) == b.store.state_layout(u)
  a.close()
  c.close()


def test_part_update_runs_in_place():
  # The moments are written, then read back for p: XLA then needs no copy of a
  # part (a copy would be another pass over memory and a second buffer).
  tx = optim.adamw(1e-3)
  part = jnp.zeros(600)
  update = jax.jit(chunked_adamw_update(tx.hyper, 400, 64), donate_argnums=(0, 1))
  hlo = update.lower(part, tx.init(part), jnp.zeros(1000), None, None).compile().as_text()
  assert "dynamic-update-slice" in hlo
  assert not re.search(r"= f32\[600\]\{0\} copy\(", hlo)


def test_bad_gradient_is_refused_and_a_thread_failure_reaches_the_caller():
  opt = _opt(optim.adamw(1e-3), [1000], 3, 64)
  before = opt.store.master(0).copy()
  with pytest.raises(ValueError, match=r"shape \(999,\).*\(1000,\)"):
    opt.update_unit(0, jnp.zeros(999), stream=False)
  g = jnp.ones(1000)
  g.delete()  # fails inside the jitted update, on an update thread
  with pytest.raises(RuntimeError, match="deleted"):
    opt.update_unit(0, g, stream=False)
  np.testing.assert_array_equal(opt.store.master(0), before)
  opt.close()


@pytest.mark.parametrize("kw", [dict(threads=0), dict(threads=1.5), dict(chunk=0)])
def test_bad_split(kw):
  with pytest.raises(ValueError, match=next(iter(kw))):
    _opt(optim.adamw(1e-3), [10], **{"threads": 1, "chunk": 4, **kw})
