"""LoRA (`megatrain_jax.lora`): adapters on a frozen base, in both trainers.

With `trainable=nnx.LoRAParam` the streaming trainer equals the resident one with
the same adapters, the base stays bit-identical, only the adapters' gradients cross
the link, and only they have an fp32 master and optimizer state.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import lora

from conftest import TINY, random_batch

CFG = TINY.replace(n_layers=3)
MOE = CFG.replace(n_experts=4, n_experts_per_tok=2, moe_d_ff=32, moe_layers=(False, True, True),
                  router_aux_loss_coef=0.01)
ATTN = lora.LoraConfig(rank=4, alpha=8, targets=lora.ATTENTION_TARGETS)
ALL = lora.LoraConfig(rank=4, alpha=8)
BATCHES = [random_batch(CFG, 4, 16, seed=s) for s in range(3)]
KEYS = [jax.random.key(100 + s) for s in range(3)]


def _model(cfg, lora_config, seed=0):
  return lora.apply(mt.Llama(cfg, rngs=nnx.Rngs(seed)), lora_config, rngs=nnx.Rngs(7))


def _adapters_close(got, want):
  """Each adapter leaf within 1e-4 of its norm (as test_engine's parameters: after Adam
  steps an element whose gradient sums to near zero moves by up to the learning rate
  on a last-bit difference of that sum, which micro-batches order differently), and
  every element within 1e-3 of the leaf's largest value."""
  got, want = lora.adapter_tree(got), lora.adapter_tree(want)
  assert got.keys() == want.keys() and got
  for k in want:
    assert np.linalg.norm(got[k] - want[k]) <= 1e-4 * np.linalg.norm(want[k]) + 1e-12, k
    np.testing.assert_allclose(got[k], want[k], rtol=0,
                               atol=1e-3 * max(np.abs(want[k]).max(), 1e-6), err_msg=str(k))


def _base(params):
  return [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(params)
          if not lora.is_adapter(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p))]


def _train_both(cfg, lora_config, ec, keys=(None,) * 3):
  start = _model(cfg, lora_config).param_tree()
  tx = lambda: optax.adamw(1e-2, weight_decay=0.1)
  ref = mt.ResidentTrainer(_model(cfg, lora_config), tx(), trainable=nnx.LoRAParam)
  want = [ref.step(b, k)["loss"] for b, k in zip(BATCHES, keys)]
  with mt.StreamingTrainer(_model(cfg, lora_config), tx(), ec, trainable=nnx.LoRAParam) as eng:
    got = [eng.step(b, k)["loss"] for b, k in zip(BATCHES, keys)]
    params, stats = eng.params(), eng.stats()
  return start, (want, ref.params()), (got, params), stats


@pytest.mark.parametrize("cfg, lora_config, kw, dropout", [
    (CFG, ALL, dict(grad_accum=2), False),
    # Kept residuals in the CPU backend's buffer pool, dropout masks among them.
    (CFG.replace(tie_embeddings=True), lora.LoraConfig(rank=4, alpha=8, dropout=0.25),
     dict(recompute="none"), True),
    (MOE, ATTN, {}, False),
    (CFG, lora.LoraConfig(rank=4, alpha=8, dropout=0.25), dict(grad_accum=2), True),
    (CFG, lora.LoraConfig(rank=2, alpha=4, dropout=0.25, targets=("v_proj", "down_proj")),
     dict(recompute="dots", activations="host"), True),
], ids=["all_accum2", "tied_kept_residuals_dropout", "moe_attention", "dropout_accum2",
        "dropout_dots_host"])
def test_streaming_lora_equals_resident_and_the_base_does_not_move(cfg, lora_config, kw,
                                                                   dropout):
  keys = KEYS if dropout else (None,) * 3
  start, (want, ref), (got, params), _ = _train_both(cfg, lora_config, mt.EngineConfig(**kw),
                                                     keys)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  _adapters_close(params, ref)
  for (path, a), (_, b) in zip(_base(params), _base(start), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  # The adapters trained: lora_b left zero.
  assert all(np.abs(v).max() > 0 for k, v in lora.adapter_tree(params).items()
             if k[-1] == "lora_b")


def test_dropout_masks_come_from_the_key_and_a_bad_key_is_refused():
  # Two keys give two different steps; no key (or not one key) with dropout on is
  # refused, naming it, before anything changes.
  cfg, lc = TINY, lora.LoraConfig(rank=4, alpha=8, dropout=0.5)
  ref = mt.ResidentTrainer(_model(cfg, lc), optax.sgd(0.0), trainable=nnx.LoRAParam)
  batch = BATCHES[0]
  # lora_b is zero at the start, so the loss cannot see dropout: the gradient can.
  _, g1 = ref.loss_and_grads(batch, KEYS[0])
  _, g2 = ref.loss_and_grads(batch, KEYS[1])
  _, g1_again = ref.loss_and_grads(batch, jax.random.key_data(KEYS[0]))  # raw data too
  b1, b2, b1_again = (g["blocks"][0]["attn"]["q"]["lora_b"] for g in (g1, g2, g1_again))
  np.testing.assert_array_equal(b1, b1_again)
  assert not np.allclose(b1, b2)
  with pytest.raises(ValueError, match="LoRA dropout"):
    ref.step(batch)
  with mt.StreamingTrainer(_model(cfg, lc), optax.sgd(0.0), mt.EngineConfig(),
                           trainable=nnx.LoRAParam) as eng:
    with pytest.raises(ValueError, match="LoRA dropout"):
      eng.step(batch)
    for bad in (3, jax.random.split(KEYS[0], 2)):
      with pytest.raises(ValueError, match="one PRNG key"):
        eng.step(batch, bad)
    eng.step(batch, KEYS[0])  # the refused steps changed nothing: the trainer goes on


def test_only_the_adapters_gradients_leave_and_only_they_have_state():
  cfg, lc = CFG, ATTN
  with mt.StreamingTrainer(_model(cfg, lc), optax.adam(1e-3), mt.EngineConfig(),
                           trainable=nnx.LoRAParam) as eng:
    eng.step(BATCHES[0])
    d2h = eng.stats()["last_step"]["d2h_bytes"]
    layout = eng.state_layout()
  n_adapter = cfg.n_layers * cfg.replace(lora=lc).adapter_param_count()
  assert d2h == 4 * n_adapter  # fp32 gradients of the adapters, nothing else
  size = lambda shape: int(np.prod(shape))
  masters = sum(size(part["master"][0]) for part in layout.values())
  state = sum(size(shape) for part in layout.values()
              for k, (shape, _) in part.items() if k.startswith("state_"))
  assert masters == n_adapter
  # Adam's two moments for each adapter element, and one step count per unit.
  assert state == 2 * n_adapter + len(layout)


def test_a_fresh_adapter_leaves_the_output_unchanged_and_merge_folds_it_in():
  model = mt.Llama(CFG, rngs=nnx.Rngs(0))
  ids = BATCHES[0]["input_ids"]
  before = np.asarray(model(ids))
  lora.apply(model, ALL, rngs=nnx.Rngs(1))
  np.testing.assert_array_equal(np.asarray(model(ids)), before)
  # Give the adapters a value, then merging must keep the output and drop them.
  params = model.param_tree()
  for b in params["blocks"]:
    for part, name in ALL.paths():
      b[part][name]["lora_b"] = 0.1 * np.ones_like(b[part][name]["lora_b"])
  model.load_param_tree(params)
  adapted = np.asarray(model(ids))
  assert not np.allclose(adapted, before)
  lora.merge(model)
  assert model.cfg.lora is None and not lora.adapter_tree(model.param_tree())
  np.testing.assert_allclose(np.asarray(model(ids)), adapted, rtol=1e-4, atol=1e-5)


def test_bad_lora_configs_are_refused_with_the_reason():
  with pytest.raises(ValueError, match="unknown"):
    lora.LoraConfig(targets=("qproj",))
  with pytest.raises(ValueError, match="rank"):
    lora.LoraConfig(rank=0)
  with pytest.raises(ValueError, match="dropout"):
    lora.LoraConfig(dropout=1.0)
  with pytest.raises(ValueError, match="MoE layers"):
    lora.apply(mt.Llama(MOE, rngs=nnx.Rngs(0)), ALL, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match="mlp_chunk"):  # a chunk mixes sequences' tokens
    CFG.replace(mlp_chunk=8, lora=lora.LoraConfig(dropout=0.1))
  model = _model(CFG, ATTN)
  with pytest.raises(ValueError, match="has adapters already"):
    lora.apply(model, ATTN, rngs=nnx.Rngs(1))


def test_the_config_records_the_adapters_and_reads_them_back():
  cfg = CFG.replace(lora=ATTN)
  back = mt.LlamaConfig(**cfg.to_dict())
  assert back == cfg and back.lora.targets == ATTN.targets
  assert "lora" not in CFG.to_dict()  # a config without adapters is written as before


def test_launcher_flags_choose_what_trains():
  from megatrain_jax.train_config import TrainConfig
  paths = [("embed", "embedding"), ("blocks", 0, "attn", "q", "kernel"),
           ("blocks", 1, "attn", "q", "kernel"), ("blocks", 1, "attn", "q", "lora_a"),
           ("blocks", 0, "mlp", "down", "lora_b"), ("head", "lm_head", "kernel")]
  trains = lambda tc: [tc.trainable()(p) for p in paths]
  assert TrainConfig().trainable() is None
  assert trains(TrainConfig(freeze="^embed/|^blocks/0/")) == [False, False, True, True,
                                                                False, True]
  assert trains(TrainConfig(lora_rank=8)) == [False, False, False, True, True, False]
  assert trains(TrainConfig(lora_rank=8, freeze="^blocks/0/")) == [False] * 3 + [True] + \
      [False] * 2
  tc = TrainConfig(lora_rank=8, lora_targets="v_proj, q_proj", lora_alpha=16)
  assert tc.model_config().lora == lora.LoraConfig(rank=8, alpha=16,  # any order: one config
                                                   targets=("q_proj", "v_proj"))
  for bad, message in ((dict(freeze="(["), "--config.freeze"),
                       (dict(lora_rank=4, lora_targets="qproj"), "--config.lora_"),
                       (dict(export_adapter_dir="x"), "--config.lora_rank")):
    with pytest.raises(ValueError, match=message):
      TrainConfig(**bad).validate()
