"""Which host-optimizer mode a transform gets, and that the choice never changes the result.

A transform updated unit by unit must give what it gives on the whole tree. The probe
that decides this must not be fooled by a learning rate that starts at zero, by
MultiSteps that applies nothing for a few steps, or by labels that depend on the
layer index.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax.engine.host import probe as probe_lib

from conftest import TINY, random_batch

CFG = TINY.replace(n_layers=3)


def _warmup(peak=1e-2, warmup=4, total=40):
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total)


def _zero_then(peak=1e-2, zero_steps=4):
  """No update at all for the first steps (a warmup that starts at zero and stays
  there a while), then a linear decay from `peak`."""
  return optax.join_schedules([optax.constant_schedule(0.0),
                               optax.linear_schedule(peak, peak / 10, 40)], [zero_steps])


def _layer0_frozen_labels(tree):
  """"frozen" for every leaf of the first block, "train" elsewhere (needs the whole tree)."""
  def label(path, _):
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    return "frozen" if keys[:2] == ["blocks", 0] else "train"
  return jax.tree_util.tree_map_with_path(label, tree)


# Each of these needs the whole tree (or may: the probe cannot prove otherwise), and a
# per-unit run of it trains something else than the resident reference.
HIDDEN = {
    "clip_warmup_from_zero": lambda: optax.chain(
        optax.clip_by_global_norm(0.01), optax.adamw(_warmup())),
    "clip_zero_lr_first": lambda: optax.chain(
        optax.clip_by_global_norm(0.01), optax.adamw(_zero_then())),
    "multisteps_5_clip": lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.01), optax.adamw(1e-2)), every_k_schedule=5),
    "labels_by_layer_warmup": lambda: optax.multi_transform(
        {"train": optax.adamw(_zero_then()), "frozen": optax.set_to_zero()},
        _layer0_frozen_labels),
}


@pytest.mark.parametrize("name", sorted(HIDDEN))
def test_hidden_whole_tree_transforms_match_the_resident_reference(name):
  opt = HIDDEN[name]
  ref = mt.ResidentTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), opt())
  with mt.StreamingTrainer(mt.Llama(CFG, rngs=nnx.Rngs(0)), opt()) as eng:
    assert eng.stats()["optimizer_mode"] == "whole_tree"
    for s in range(12):  # long enough for the rising learning rate and the clip to bite
      b = random_batch(CFG, 4, 16, seed=s)
      eng.step(b)
      ref.step(b)
    got, want = eng.params(), ref.params()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())


def test_the_common_llm_recipe_is_whole_tree():
  # Warmup from zero over 2000 steps: the learning rate is ~1e-7 in the first steps.
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, 3e-4, 2000, 10000)))
  with mt.StreamingTrainer.from_config(CFG, opt, mt.EngineConfig(), jax.random.key(0)) as eng:
    assert eng.stats()["optimizer_mode"] == "whole_tree"


def test_elementwise_transforms_keep_the_fast_path():
  for opt in (optax.adamw(_warmup()), optax.lion(1e-3), optax.sgd(0.1, momentum=0.9),
              optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2)):
    verdict = probe_lib.probe(opt, probe_lib.miniature_units(CFG))
    assert verdict.separable, verdict.reason


@pytest.mark.parametrize("opt, why", [
    (lambda: optax.chain(optax.clip_by_global_norm(0.01), optax.adamw(_warmup())),
     "differ"),
    (lambda: optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=100), "no update"),
])
def test_probe_says_why_it_is_not_per_unit(opt, why):
  verdict = probe_lib.probe(opt(), probe_lib.miniature_units(CFG))
  assert not verdict.separable and why in verdict.reason


def test_hand_set_per_unit_on_a_whole_tree_transform_is_refused():
  opt = optax.chain(optax.clip_by_global_norm(0.01), optax.adamw(_warmup()))
  with pytest.raises(ValueError, match=r"optimizer_mode='per_unit'.*whole_tree.*"
                                       r"mt\.optim\.clip_by_global_norm"):
    mt.StreamingTrainer.from_config(CFG, opt, mt.EngineConfig(optimizer_mode="per_unit"),
                                    jax.random.key(0))


def test_auto_logs_why_it_chose_whole_tree(caplog):
  opt = optax.chain(optax.clip_by_global_norm(0.01), optax.adamw(1e-3))
  with caplog.at_level("INFO"):
    with mt.StreamingTrainer.from_config(CFG, opt, mt.EngineConfig(), jax.random.key(0)):
      pass
  text = caplog.text
  assert "whole_tree" in text and "mt.optim.clip_by_global_norm" in text
