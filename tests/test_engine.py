"""StreamingTrainer against ResidentTrainer, and its resource bounds."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import data as data_lib
from megatrain_jax.engine.plan import memory as engine_memory
from megatrain_jax.engine.device import transport as transport_lib
from conftest import TINY, random_batch

BASE = TINY.replace(n_layers=4)
ADAMW = lambda: optax.adamw(1e-3, weight_decay=0.1)
CLIPPED = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-3))
FUSED = lambda: mt.optim.adamw(optax.linear_schedule(1e-3, 1e-4, 10), weight_decay=0.1)
SPLIT_CLIP = lambda: mt.optim.clip_by_global_norm(0.05, mt.optim.adamw(1e-3))
SPLIT_CLIP_SGD = lambda: mt.optim.clip_by_global_norm(0.05, optax.sgd(0.1, momentum=0.9))


def _rel_err(a, b):
  return jax.tree.map(lambda x, y: float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30)),
                      a, b)


def _norm_err(a, b):
  """Each leaf's error relative to its norm. After Adam steps, a parameter whose
  gradient is near zero moves by up to the learning rate on a last-bit difference of
  that gradient (different reduction orders: micro-batches against the whole batch),
  so one element can differ far more than the rest; the norm weighs it by its size."""
  return jax.tree.map(lambda x, y: float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)),
                      a, b)


def _pair(cfg, opt, ec):
  ref = mt.ResidentTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), opt())
  eng = mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), opt(), ec)
  return ref, eng


MOE = BASE.replace(
    d_ff=48, n_experts=4, n_experts_per_tok=2, moe_d_ff=16, shared_expert_d_ff=24,
    norm_topk_prob=False, moe_layers=(True, False, True, True), router_aux_loss_coef=0.1,
    attention_block=8, mlp_chunk=7)
WINDOWED = BASE.replace(sliding_window=5, layer_types=(
    "full_attention", "sliding_attention", "sliding_attention", "full_attention"))

# Each case a different path; depth 1, checkpoint groups, grad_accum and tied
# embeddings are covered in combination by the last three.
CASES = {
    "default": (BASE, ADAMW, {}),
    "prefetch0": (BASE, ADAMW, dict(prefetch_depth=0)),
    "ckpt_all": (BASE, ADAMW, dict(checkpoint_every=BASE.n_layers)),
    "tied_resident_ends": (BASE.replace(tie_embeddings=True), ADAMW,
                           dict(stream_embed_head=False)),
    "qkv_bias": (BASE.replace(qkv_bias=True), ADAMW, {}),
    # Qwen3's query/key norms and own head width, Llama 3's rotary scaling, sliding
    # and full attention mixed (a checkpoint group recomputes each layer with its own).
    "qk_norm_head_dim_rope_windows": (BASE.replace(
        qk_norm=True, attn_head_dim=16, rope_scaling=mt.RopeScaling(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8), sliding_window=5, layer_types=(
                "full_attention", "sliding_attention", "sliding_attention",
                "full_attention")), ADAMW, dict(checkpoint_every=2)),
    # Mixture-of-experts layers (Qwen2-MoE's shape: a shared expert, no renormalized
    # top-k) mixed with a dense one, the load-balancing loss in the training loss;
    # attention in blocks of 8 tokens (its custom VJP inside the templates), the dense
    # layer's feed-forward in chunks of 7 tokens.
    "moe_mixed_shared_aux_blockwise": (MOE, ADAMW, dict(checkpoint_every=2)),
    # Checkpoints in host memory, with each recompute mode: the backward recomputes
    # groups of layers, the matmul outputs are kept (and MoE router gradients flow
    # through the kept residuals), or every residual is kept.
    "host_dots_moe": (MOE, ADAMW, dict(activations="host", recompute="dots")),
    "host_none_accum_prefetch2_kept_copies": (BASE, ADAMW, dict(
        activations="host", recompute="none", grad_accum=2, prefetch_depth=2,
        stream_copy="keep")),
    "device_none_windows": (WINDOWED, ADAMW, dict(recompute="none")),
    # Deferred updates land after the step returns: the next step's resident copies
    # must be the updated ones.
    "resident_ends_whole_tree": (BASE, CLIPPED, dict(stream_embed_head=False)),
    "clip_chain_host_dots_prefetch0": (BASE, CLIPPED, dict(
        activations="host", recompute="dots", prefetch_depth=0)),
    "fused_adamw_parts": (BASE, FUSED, dict(host_threads=3, host_chunk=64)),
    "split_clip_fused_parts": (BASE, SPLIT_CLIP, dict(host_threads=2, host_chunk=100)),
    "split_clip_sgd_accum_tied": (BASE.replace(tie_embeddings=True), SPLIT_CLIP_SGD,
                                  dict(grad_accum=2)),
    "fused_adamw_accum_tied": (BASE.replace(tie_embeddings=True), FUSED,
                               dict(grad_accum=2, prefetch_depth=1, host_threads=2,
                                    host_chunk=256)),
    "clip_accum_ckpt2_host_prefetch0": (BASE.replace(tie_embeddings=True), CLIPPED, dict(
        grad_accum=2, checkpoint_every=2, prefetch_depth=0, activations="host")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_resident_fp32(name):
  cfg, opt, kw = CASES[name]
  ref, eng = _pair(cfg, opt, mt.EngineConfig(**kw))
  with eng:
    b0 = random_batch(cfg, 4, 16, seed=0, mask_fraction=0.25)
    loss_r, g_r = ref.loss_and_grads(b0)
    loss_e, g_e = eng.loss_and_grads(b0)
    np.testing.assert_allclose(loss_e, loss_r, rtol=1e-5)
    assert max(jax.tree.leaves(_rel_err(g_r, g_e))) < 1e-5
    for s in range(3):
      b = random_batch(cfg, 4, 16, seed=s, mask_fraction=0.25)
      np.testing.assert_allclose(eng.step(b)["loss"], ref.step(b)["loss"], rtol=1e-5)
    assert max(jax.tree.leaves(_norm_err(ref.params(), eng.params()))) < 1e-4
    expected = {CLIPPED: "whole_tree", SPLIT_CLIP: "clipped", SPLIT_CLIP_SGD: "clipped"}
    assert eng.stats()["optimizer_mode"] == expected.get(opt, "per_unit")
    assert eng.stats()["fused_optimizer"] == (opt in (FUSED, SPLIT_CLIP))
    if "host_threads" in kw:  # the fused update ran in that many parts
      assert eng.stats()["host_update_parts"] == kw["host_threads"]


@pytest.mark.parametrize("tied,depth", [(False, 2), (True, 0)])
def test_last_layer_in_the_head_call(tied, depth):
  # The last layer's forward and backward in the head's call: the same step as with
  # the layer run by itself, one layer fewer fetched, and its buffers within the
  # plan (a tied embedding with no prefetch: the head's and the embedding's fetches
  # wait on two held buffers).
  cfg = BASE.replace(tie_embeddings=tied)
  runs = {}
  for fused in (True, False):
    ec = mt.EngineConfig(last_layer_in_head=fused, prefetch_depth=depth, timeout_s=60)
    with mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), ADAMW(), ec) as eng:
      losses = [eng.step(random_batch(cfg, 4, 16, seed=s))["loss"] for s in range(3)]
      plan = engine_memory.step_plan(cfg, ec, 4, 16)
      runs[fused] = (losses, eng.params(), eng.stats(), plan)
  (l_f, p_f, st_f, plan_f), (l_u, p_u, st_u, _) = runs[True], runs[False]
  assert plan_f.schedule.fused_tail
  np.testing.assert_allclose(l_f, l_u, rtol=1e-6)
  assert max(jax.tree.leaves(_rel_err(p_u, p_f))) < 1e-5
  assert st_u["last_step"]["h2d_bytes"] - st_f["last_step"]["h2d_bytes"] == (
      st_f["layer_bytes"])
  assert st_f["compiles"]["tail_fwd_bwd"] == 1 and "tail_fwd_bwd" not in st_u["compiles"]
  assert st_f["device_peak_bytes"] <= plan_f.peak["total"]


@pytest.mark.parametrize("tied", [False, True])
def test_last_layer_in_the_head_call_after_a_batch_of_another_shape(tied):
  # Another shape drops the next step's fetches queued ahead; without prefetch the
  # head's (and a tied embedding's) fetch still gets the buffers the held layer needs.
  cfg = BASE.replace(tie_embeddings=tied)
  ec = mt.EngineConfig(prefetch_depth=0, timeout_s=20)
  with mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), ADAMW(), ec) as eng:
    for s, t in enumerate((16, 8, 16)):
      assert np.isfinite(eng.step(random_batch(cfg, 4, t, seed=s))["loss"])


def test_load_balancing_loss_with_grad_accum_is_refused():
  cfg = BASE.replace(n_experts=4, router_aux_loss_coef=0.01)
  with pytest.raises(ValueError, match="router_aux_loss_coef=0.01 with grad_accum=2"):
    mt.StreamingTrainer.from_config(cfg, ADAMW(), mt.EngineConfig(grad_accum=2),
                                    jax.random.key(0))


def test_next_step_overlaps_the_last_updates():
  # A slow link: each step returns before its last units are updated, and the next
  # step fetches other units while those finish, each only once it is updated.
  ref, eng = _pair(BASE, ADAMW, mt.EngineConfig(transport=mt.SimulatedLink(0.001)))
  with eng:
    for s in range(4):
      b = random_batch(BASE, 4, 16, seed=s)
      np.testing.assert_allclose(eng.step(b)["loss"], ref.step(b)["loss"], rtol=1e-5)
    assert eng.stats()["out_of_order_fetches"] > 0
    assert max(jax.tree.leaves(_rel_err(ref.params(), eng.params()))) < 1e-4


def test_restore_between_steps_drops_the_fetches_started_for_the_next_step():
  with mt.StreamingTrainer.from_config(BASE, mt.optim.adamw(1e-2), mt.EngineConfig(),
                                       jax.random.key(0)) as eng:
    b0, b1 = random_batch(BASE, 2, 8, seed=0), random_batch(BASE, 2, 8, seed=1)
    eng.step(b0)
    snap = eng.snapshot()
    saved = {k: snap.take(k) for k in snap.keys}
    snap.close()
    first = eng.step(b1)["loss"]  # its end starts fetching for the next step
    eng.restore(lambda key: saved[key], 1)
    assert eng.step(b1)["loss"] == first  # from the restored state, not the fetched one


def test_sgd_update_is_exact():
  ref, eng = _pair(BASE, lambda: optax.sgd(0.5), mt.EngineConfig())
  with eng:
    b = random_batch(BASE, 2, 16)
    _, g = eng.loss_and_grads(b)
    before = eng.params()
    eng.step(b)
    after = eng.params()
    jax.tree.map(lambda a, p, gg: np.testing.assert_allclose(a, p - 0.5 * gg, atol=1e-7),
                 after, before, g)


def test_from_config_equals_model_init():
  key = jax.random.key(7)
  model = mt.Llama(BASE, rngs=nnx.Rngs(params=key))
  with mt.StreamingTrainer.from_config(BASE, optax.sgd(0.1), mt.EngineConfig(), key) as eng:
    jax.tree.map(np.testing.assert_array_equal, eng.params(),
                 jax.tree.map(np.asarray, model.param_tree()))


@pytest.mark.parametrize("windows", [None, 4])
def test_compiles_each_template_once_whatever_the_depth(windows):
  # One block template per layer structure: a stack alternating sliding and full
  # attention has two, however deep.
  cfg = TINY.replace(n_layers=32, d_model=16, n_heads=2, n_kv_heads=1, d_ff=32)
  if windows:
    cfg = cfg.replace(sliding_window=windows, layer_types=tuple(
        ("sliding_attention", "full_attention")[i % 2] for i in range(32)))
  with mt.StreamingTrainer.from_config(cfg, optax.adamw(1e-3), mt.EngineConfig(),
                                       jax.random.key(0)) as eng:
    for s in range(2):
      eng.step(random_batch(cfg, 2, 8, seed=s))
    compiles = eng.stats()["compiles"]
  n = 2 if windows else 1
  assert compiles["block_fwd"] == n and compiles["block_bwd"] == n, compiles
  assert all(v == 1 for k, v in compiles.items() if not k.startswith("block")), compiles


def test_bf16_tracks_fp32_on_stdlib(stdlib_windows):
  cfg = TINY.replace(vocab_size=260, max_seq_len=64)
  curves = {}
  for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
    ds = data_lib.PackedDataset(stdlib_windows, 8, 0)
    with mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(3e-3),
                             mt.EngineConfig(compute_dtype=dtype)) as eng:
      curves[name] = [eng.step(ds.next_batch())["loss"] for _ in range(100)]
  f32, bf16 = np.array(curves["f32"]), np.array(curves["bf16"])
  assert np.all(np.isfinite(bf16))
  assert bf16[-10:].mean() < 0.7 * bf16[:5].mean()
  assert abs(bf16[-10:].mean() - f32[-10:].mean()) / f32[-10:].mean() < 0.02


def _peak(n_layers, **kw):
  cfg = TINY.replace(n_layers=n_layers)
  with mt.StreamingTrainer.from_config(cfg, optax.adamw(1e-3), mt.EngineConfig(**kw),
                                       jax.random.key(0)) as eng:
    eng.step(random_batch(cfg, 4, 16))
    eng.step(random_batch(cfg, 4, 16, seed=1))
    return eng.stats(), cfg


def test_device_peak_flat_in_depth_and_bounded():
  s4, cfg = _peak(4)
  s16, _ = _peak(16)
  assert s16["device_peak_bytes"] <= 2 * s4["device_peak_bytes"]
  act = 4 * 16 * cfg.d_model * 4
  unit = max(s16["layer_bytes"], cfg.vocab_size * cfg.d_model * 4)
  grads_in_flight = 2 * unit
  # in flight: param slots, gradients, 16 checkpoints, running x and g, a few temporaries
  bound = s16["prefetch_slots"] * unit + grads_in_flight + (16 + 6) * act
  assert s16["device_peak_bytes"] <= bound
  assert s16["device_peak_bytes"] < s16["param_count"] * 4  # never the whole model


def test_transfer_bytes_per_step():
  cfg = BASE
  with mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3),
                           mt.EngineConfig(compute_dtype=jnp.bfloat16)) as eng:
    b = random_batch(cfg, 4, 16)
    eng.step(b)
    eng.step(b)
    last = eng.stats()["last_step"]
  params_cd = cfg.param_count() * 2
  batch_bytes = sum(v.nbytes for v in b.values())
  assert params_cd < last["h2d_bytes"] <= 2 * params_cd + batch_bytes
  # bf16 gradients for blocks and head, fp32 for the embedding's scatter-add.
  assert last["d2h_bytes"] <= cfg.param_count() * 2 + cfg.vocab_size * cfg.d_model * 2 + 64


def test_trains_under_a_budget_an_eighth_of_the_model():
  cfg = TINY.replace(n_layers=32)
  state_bytes = cfg.param_count() * 12  # fp32 params + Adam mu, nu
  budget = state_bytes // 8
  ec = mt.EngineConfig(prefetch_depth=1, device_budget_bytes=budget)
  with mt.StreamingTrainer.from_config(cfg, optax.adamw(1e-3), ec, jax.random.key(0)) as eng:
    for s in range(2):
      eng.step(random_batch(cfg, 2, 16, seed=s))
    assert 0 < eng.stats()["device_peak_bytes"] < budget


def test_refuses_config_over_budget():
  with pytest.raises(ValueError, match=r"parameters in flight.*device limit"):
    mt.StreamingTrainer.from_config(BASE, optax.sgd(0.1),
                                    mt.EngineConfig(device_budget_bytes=10_000),
                                    jax.random.key(0))
  ec = mt.EngineConfig(device_budget_bytes=300_000)
  with mt.StreamingTrainer.from_config(BASE, optax.sgd(0.1), ec, jax.random.key(0)) as eng:
    with pytest.raises(ValueError, match=r"MiB of device memory.*budget"):
      eng.step(random_batch(BASE, 32, 32))
    eng.step(random_batch(BASE, 2, 8))  # a batch that fits still trains


class _FailingLink(transport_lib.DeviceTransport):
  def __init__(self, where, after):
    super().__init__()
    self.where, self.after, self.calls = where, after, 0

  def _maybe_fail(self):
    self.calls += 1
    if self.calls > self.after:
      raise OSError(f"injected {self.where} fault")

  def h2d(self, staged):
    if self.where == "h2d":
      self._maybe_fail()
    return super().h2d(staged)

  def h2d_cast(self, master, dtype):
    if self.where == "h2d":
      self._maybe_fail()
    return super().h2d_cast(master, dtype)

  def d2h(self, device_array):
    if self.where == "d2h":
      self._maybe_fail()
    return super().d2h(device_array)


def _engine_threads():
  return [t for t in threading.enumerate() if t.name.startswith("megatrain-") and t.is_alive()]


@pytest.mark.parametrize("where, depth", [("h2d", 2), ("h2d", 0), ("d2h", 2)])
def test_transport_fault_raises_original_error(where, depth):
  before = len(_engine_threads())
  eng = mt.StreamingTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                            mt.EngineConfig(prefetch_depth=depth,
                                            transport=_FailingLink(where, after=8)))
  t0 = time.monotonic()
  with pytest.raises(OSError, match=f"injected {where} fault") as e:
    for s in range(3):
      eng.step(random_batch(BASE, 2, 8, seed=s))
  assert time.monotonic() - t0 < 10
  assert "now invalid: resume from the last checkpoint" in " ".join(e.value.__notes__)
  assert len(_engine_threads()) == before
  with pytest.raises(RuntimeError, match="invalid after an earlier failure"):
    eng.step(random_batch(BASE, 2, 8))


@pytest.mark.parametrize("mode", ["per_unit", "whole_tree"])
def test_optimizer_fault_raises_original_error(mode):
  # SGD that fails on the real model's arrays (not on the probe's miniature ones).
  def explode(updates, state, params=None):
    if any(x.size > 27 for x in jax.tree.leaves(updates)):
      raise ArithmeticError("injected optimizer fault")
    return jax.tree.map(lambda g: -0.1 * g, updates), state
  bad = optax.GradientTransformation(lambda p: optax.EmptyState(), explode)
  eng = mt.StreamingTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), bad,
                            mt.EngineConfig(optimizer_mode=mode))
  t0 = time.monotonic()
  with pytest.raises(ArithmeticError, match="injected optimizer fault"):
    eng.step(random_batch(BASE, 2, 8))
    # A whole-tree update runs on the optimizer thread after the step returns.
    eng.wait()
  # Nor does a next step go on: it raises that error, or says the trainer is invalid
  # because of it.
  with pytest.raises((ArithmeticError, RuntimeError), match="injected optimizer fault"):
    eng.step(random_batch(BASE, 2, 8))
  assert time.monotonic() - t0 < 10
  eng.close()
  assert not _engine_threads()


def test_close_stops_threads():
  with mt.StreamingTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), optax.sgd(0.1)) as eng:
    eng.step(random_batch(BASE, 2, 8))
    assert _engine_threads()
  assert not _engine_threads()
  with pytest.raises(RuntimeError, match="closed"):
    eng.step(random_batch(BASE, 2, 8))


def test_simulated_link_takes_its_time():
  link = mt.SimulatedLink(gb_per_s=0.01)
  x = jax.device_put(np.zeros(250_000, np.float32))  # 1 MB -> 0.1 s
  t0 = time.perf_counter()
  link.h2d(x)
  assert time.perf_counter() - t0 >= 0.1
  # A fetch that joins and casts the fp32 master's parts is charged the bf16 bytes
  # the link carries.
  before = link.bytes_moved["h2d"]
  parts = (jnp.arange(3.0), jnp.arange(3.0, 10.0))
  out = link.h2d_cast(parts, jnp.bfloat16)
  assert out.dtype == jnp.bfloat16 and link.bytes_moved["h2d"] - before == 10 * 2
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.arange(10.0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_streaming_copy_kept_or_made_at_fetch_gives_the_same_bits(dtype):
  # On the CPU backend "auto" makes each fetch's copy from the master; "keep" holds
  # one in pinned host memory. The bits the compute sees are the same either way.
  b = [random_batch(BASE, 2, 8, seed=s) for s in range(3)]
  runs = {}
  for mode in ("auto", "keep"):
    ec = mt.EngineConfig(compute_dtype=dtype, stream_copy=mode)
    with mt.StreamingTrainer.from_config(BASE, mt.optim.adamw(1e-2), ec,
                                         jax.random.key(0)) as eng:
      losses = [eng.step(x)["loss"] for x in b]
      st = eng.stats()  # stream_bytes: the kept copies' own arrays
      runs[mode] = (losses, eng.params(), st["stream_copy"], st["stream_bytes"])
  n_bytes = BASE.param_count() * jnp.dtype(dtype).itemsize
  assert runs["auto"][2:] == ("on_fetch", 0)
  assert runs["keep"][2:] == ("keep", n_bytes)
  assert runs["auto"][0] == runs["keep"][0]
  jax.tree.map(np.testing.assert_array_equal, runs["auto"][1], runs["keep"][1])


def test_host_bytes_count_streaming_copies_only_where_kept():
  ec = mt.EngineConfig(compute_dtype=jnp.bfloat16)
  n = BASE.param_count()
  copies = lambda ec, **kw: engine_memory.host_bytes(BASE, optax.adamw(1e-3), ec,
                                                      **kw)["pinned_copies"]
  assert copies(ec) == 0  # this machine: the CPU backend
  assert copies(ec, on_cpu=False) >= 2 * n  # an accelerator: bf16 copy of every unit
  assert copies(mt.EngineConfig(stream_copy="keep")) >= 4 * n
  assert copies(mt.EngineConfig(stream_copy="on_fetch"), on_cpu=False) == 0


@pytest.mark.parametrize("kw, field", [
    (dict(prefetch_depth=-1), "prefetch_depth"),
    (dict(checkpoint_every=0), "checkpoint_every"),
    (dict(grad_accum=0), "grad_accum"),
    (dict(compute_dtype=jnp.float16), "compute_dtype"),
    (dict(optimizer_mode="fast"), "optimizer_mode"),
    (dict(stream_copy="pinned"), "stream_copy"),
    (dict(host_threads=0), "host_threads"),
    (dict(host_chunk=2.5), "host_chunk"),
    (dict(recompute="some"), "recompute"),
    (dict(recompute="none", checkpoint_every=2), "checkpoint_every=1"),
])
def test_bad_engine_config(kw, field):
  with pytest.raises(ValueError, match=field):
    mt.EngineConfig(**kw)


def test_grad_accum_must_divide_batch():
  with mt.StreamingTrainer(mt.Llama(BASE, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                           mt.EngineConfig(grad_accum=3)) as eng:
    with pytest.raises(ValueError, match="grad_accum=3"):
      eng.step(random_batch(BASE, 4, 8))


def test_resident_units_are_read_after_their_deferred_update():
  # A whole-tree update that takes 0.3 s: the next step starts long before it is done,
  # and must still compute with the updated resident embedding and head.
  import time as time_lib

  def slow(tx):
    def update(updates, state, params=None):
      if max(x.size for x in jax.tree.leaves(updates)) > 27:  # not in the probe
        jax.debug.callback(lambda: time_lib.sleep(0.3))
      return tx.update(updates, state, params)
    return optax.GradientTransformation(tx.init, update)

  opt = lambda: slow(optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)))
  batches = [random_batch(TINY, 2, 8, seed=s) for s in range(3)]
  ref = mt.ResidentTrainer(mt.Llama(TINY, rngs=nnx.Rngs(0)), opt())
  want = [ref.step(b)["loss"] for b in batches]
  with mt.StreamingTrainer(mt.Llama(TINY, rngs=nnx.Rngs(0)), opt(),
                           mt.EngineConfig(stream_embed_head=False)) as eng:
    assert eng.stats()["optimizer_mode"] == "whole_tree"
    got = [eng.step(b)["loss"] for b in batches]  # back to back
  np.testing.assert_allclose(got, want, rtol=1e-5)
