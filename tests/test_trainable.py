"""`trainable=`: frozen parameters in both trainers (`models.trainable`).

A frozen leaf is fetched and computed like any other, but gets no gradient sent to the
host, no fp32 master (it is kept in `EngineConfig.frozen_dtype`) and no optimizer
state. The streaming trainer then equals the resident one with the same leaves frozen.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax.engine.plan import sizes

from conftest import TINY, random_batch

CFG = TINY.replace(n_layers=3)
# The embedding and the first layer: what a fine-tune often keeps fixed.
FROZEN = lambda path: path[0] == "embed" or path[:2] == ("blocks", 0)
TRAINABLE = lambda path: not FROZEN(path)
BATCHES = [random_batch(CFG, 4, 16, seed=s) for s in range(3)]


def _close(got, want):  # as test_engine: within 1e-4 of each leaf's largest value
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * max(np.abs(b).max(), 1e-6))


def _stream(cfg, ec, trainable, batches=BATCHES, tx=lambda: optax.adamw(1e-3,
                                                                            weight_decay=0.1)):
  with mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), tx(), ec,
                           trainable=trainable) as eng:
    losses = [eng.step(b)["loss"] for b in batches]
    return losses, eng.params(), eng.stats()


@pytest.mark.parametrize("cfg, kw", [
    (CFG, {}),
    (CFG, dict(recompute="none", grad_accum=2)),
    (CFG.replace(tie_embeddings=True), dict(stream_embed_head=False, activations="host")),
    (CFG.replace(tie_embeddings=True), dict(prefetch_depth=0, checkpoint_every=2,
                                            nonfinite="skip")),
], ids=["default", "kept_residuals_accum", "tied_resident_ends_host", "tied_depth0_skip"])
def test_frozen_leaves_stay_bit_identical_and_the_rest_trains_like_the_reference(cfg, kw):
  start = mt.Llama(cfg, rngs=nnx.Rngs(0)).param_tree()
  ref = mt.ResidentTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3, weight_decay=0.1),
                           trainable=TRAINABLE)
  want_losses = [ref.step(b)["loss"] for b in BATCHES]
  losses, got, _ = _stream(cfg, mt.EngineConfig(**kw), TRAINABLE)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  _close(got, ref.params())
  for name, tree in (("embed", lambda p: p["embed"]), ("layer 0", lambda p: p["blocks"][0])):
    for params in (got, ref.params()):
      for a, b in zip(jax.tree.leaves(tree(params)), jax.tree.leaves(tree(start))):
        np.testing.assert_array_equal(a, b, err_msg=name)
  assert not np.array_equal(got["blocks"][1]["attn"]["q"]["kernel"],
                            start["blocks"][1]["attn"]["q"]["kernel"])


def test_d2h_drops_by_exactly_the_frozen_gradients():
  ec = mt.EngineConfig()
  _, _, everything = _stream(CFG, ec, None)
  _, _, frozen = _stream(CFG, ec, TRAINABLE)
  grads = sizes.unit_grad_bytes(CFG, ec)
  # The embedding's (fp32, its scatter-add) and layer 0's gradients stay on the device.
  assert (everything["last_step"]["d2h_bytes"] - frozen["last_step"]["d2h_bytes"]
          == grads[0] + grads[1])
  assert everything["last_step"]["h2d_bytes"] == frozen["last_step"]["h2d_bytes"]


def test_leaves_frozen_inside_a_unit_and_an_nnx_filter():
  # Every norm scale frozen (a part of each unit), and the same through an NNX filter
  # on paths: the trainers still agree, and the scales do not move.
  start = mt.Llama(CFG, rngs=nnx.Rngs(0)).param_tree()
  no_scales = lambda path: path[-1] != "scale"
  ref = mt.ResidentTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-2),
                           trainable=no_scales)
  for b in BATCHES:
    ref.step(b)
  _, got, _ = _stream(CFG, mt.EngineConfig(), no_scales, tx=lambda: optax.adamw(1e-2))
  _, via_nnx, _ = _stream(CFG, mt.EngineConfig(),
                          nnx.All(nnx.Param, nnx.Not(nnx.PathContains("scale"))),
                          tx=lambda: optax.adamw(1e-2))
  _close(got, ref.params())
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(via_nnx)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(got["head"]["final_norm"]["scale"],
                                start["head"]["final_norm"]["scale"])


def test_frozen_leaves_are_kept_in_the_frozen_dtype_and_checkpointed():
  ec = mt.EngineConfig(compute_dtype="bfloat16")
  with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), optax.adamw(1e-2), ec,
                           trainable=TRAINABLE) as eng:
    eng.step(BATCHES[0])
    layout = eng.state_layout()
    snap = eng.snapshot()
    parts = {k: snap.take(k) for k in snap.keys}
    snap.close()
    params = eng.params()
  # No fp32 master, no optimizer state for the frozen embedding: its values, in bf16.
  assert layout["embed"]["master"] == ((0,), "float32")
  assert layout["embed"]["frozen"] == ((CFG.vocab_size * CFG.d_model,), "bfloat16")
  with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(1)), optax.adamw(1e-2), ec,
                           trainable=TRAINABLE) as other:
    other.restore(lambda k: parts[k], 1)
    for a, b in zip(jax.tree.leaves(other.params()), jax.tree.leaves(params)):
      np.testing.assert_array_equal(a, b)


def test_a_filter_that_selects_nothing_is_refused():
  with pytest.raises(ValueError, match="selects no parameter"):
    mt.StreamingTrainer.from_config(CFG, optax.sgd(0.1), mt.EngineConfig(), jax.random.key(0),
                                    trainable=nnx.LoRAParam)
