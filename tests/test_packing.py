"""Packed documents: segment ids keep them apart and positions restart in each."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import megatrain_jax as mt
from megatrain_jax.models import llama

from conftest import TINY

LENGTHS = (5, 9, 3, 7)  # four documents packed into one row of 24 tokens


def _packed(cfg, seed=0):
  rng = np.random.default_rng(seed)
  docs = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in LENGTHS]
  ids = np.concatenate(docs)[None]
  seg = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(LENGTHS)])[None]
  pos = np.concatenate([np.arange(n, dtype=np.int32) for n in LENGTHS])[None]
  return docs, ids, seg, pos


@pytest.mark.parametrize("attention_block", [None, 4])
def test_each_packed_document_has_its_own_logits(attention_block):
  cfg = TINY.replace(attention_block=attention_block, sliding_window=4,
                     layer_types=("sliding_attention", "full_attention"))
  model = mt.Llama(cfg, rngs=nnx.Rngs(0))
  docs, ids, seg, pos = _packed(cfg)
  packed = llama.forward(cfg, model.param_tree(), jnp.asarray(ids),
                         positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))[0]
  # Each document alone: one row each, padded at the end (causal: the padding after a
  # token does not change its logits).
  rows = np.zeros((len(docs), max(LENGTHS)), np.int32)
  for i, doc in enumerate(docs):
    rows[i, :len(doc)] = doc
  alone_all = model(jnp.asarray(rows))
  start = 0
  for i, doc in enumerate(docs):
    alone = alone_all[i, :len(doc)]
    got = packed[start:start + len(doc)]
    assert np.abs(got - alone).max() <= 1e-5 * np.abs(alone).max()
    start += len(doc)
  # Without the segment ids the documents would see each other.
  mixed = llama.forward(cfg, model.param_tree(), jnp.asarray(ids),
                        positions=jnp.asarray(pos))[0]
  assert np.abs(mixed[5:] - packed[5:]).max() > 1e-3


@pytest.mark.parametrize("kw", [dict(checkpoint_every=2),
                                dict(recompute="none", activations="host")],
                         ids=["groups", "kept_residuals_on_host"])
def test_streamed_equals_resident_on_packed_batches(kw):
  # With kept residuals the positions and segment ids are residuals of the layer too.
  cfg = TINY.replace(n_layers=3, attention_block=8)
  ref = mt.ResidentTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3))
  eng = mt.StreamingTrainer(mt.Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3),
                            mt.EngineConfig(**kw))
  with eng:
    for s in range(3):
      _, ids, seg, pos = _packed(cfg, seed=s)
      ids = np.concatenate([ids, ids[:, ::-1]])
      batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1),
               "loss_mask": np.ones(ids.shape, np.float32),
               "segment_ids": np.concatenate([seg, seg[:, ::-1]]),
               "positions": np.concatenate([pos, pos])}
      np.testing.assert_allclose(eng.step(batch)["loss"], ref.step(batch)["loss"], rtol=1e-5)
    err = jax.tree.map(lambda a, b: float(np.abs(a - b).max() / np.abs(a).max()),
                       ref.params(), eng.params())
    assert max(jax.tree.leaves(err)) < 1e-4


@pytest.mark.parametrize("change, message", [
    ({"segment_ids": np.zeros((1, 4), np.float32)}, "must hold integers"),
    ({"positions": np.full((1, 4), 10_000, np.int32)}, "outside [0, max_seq_len"),
    ({"position_ids": np.zeros((1, 4), np.int32)}, "unknown keys ['position_ids']"),
    ({"segment_ids": np.zeros((1, 3), np.int32)}, "every batch entry"),
])
def test_bad_packing_keys_are_named(change, message):
  batch = {"input_ids": np.zeros((1, 4), np.int32), "labels": np.zeros((1, 4), np.int32),
           "loss_mask": np.ones((1, 4), np.float32), **change}
  with pytest.raises(ValueError) as e:
    mt.check_batch(TINY, batch)
  assert message in str(e.value)


# --- Packing data ------------------------------------------------------------

def _conversations(n, seed=0):
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", "gamma", "delta", "x", "yz"]
  say = lambda k: " ".join(rng.choice(words, k))
  return [[{"role": "user", "content": say(rng.integers(1, 5))},
           {"role": "assistant", "content": say(rng.integers(1, 6))}]
          + ([{"role": "user", "content": say(2)}, {"role": "assistant", "content": say(3)}]
             if i % 3 == 0 else [])
          for i in range(n)]


def test_pack_rows_places_every_example_whole_and_once():
  rng = np.random.default_rng(1)
  examples = [(list(rng.integers(3, 50, n)), [1.0] * n) for n in rng.integers(1, 20, 40)]
  tokens, mask, seg = mt.data.pack_rows(examples, 24, pad_id=0)
  assert len(tokens) < len(examples) // 2  # several per row
  found = []
  for r in range(len(tokens)):
    for s in range(1, seg[r].max() + 1):
      found.append(tuple(tokens[r][seg[r] == s]))
    assert (tokens[r][seg[r] == 0] == 0).all() and (mask[r][seg[r] == 0] == 0).all()
  assert sorted(found) == sorted(tuple(ids) for ids, _ in examples)
  with pytest.raises(ValueError, match="more than a row's 24"):
    mt.data.pack_rows([([1] * 25, [1.0] * 25)], 24, pad_id=0)


def test_packed_instruction_loss_is_the_token_weighted_loss_unpacked():
  tok = mt.data.ByteTokenizer()
  cfg = TINY.replace(vocab_size=tok.vocab_size, max_seq_len=160)
  convs = _conversations(12)
  seq_len = 159
  rows, rmask = mt.data.build_sequences(convs, tok, seq_len)
  packed, pmask, seg = mt.data.build_sequences(convs, tok, seq_len, pack=True)
  assert len(packed) <= len(rows) // 2
  one = mt.data.PackedDataset(rows, len(rows), 0, rmask).next_batch()
  many = mt.data.PackedDataset(packed, len(packed), 0, pmask, seg).next_batch()
  assert many["loss_mask"].sum() == one["loss_mask"].sum()
  # Positions restart in each conversation and no label crosses into the next.
  starts = np.diff(many["segment_ids"], axis=1) != 0
  assert (many["positions"][:, 1:][starts] == 0).all()
  assert (many["loss_mask"][:, :-1][starts] == 0).all()
  params = mt.Llama(cfg, rngs=nnx.Rngs(3)).param_tree()
  # Both batches as 12 rows (the packed one padded with empty rows): one compile.
  pad = len(rows) - len(packed)
  many = {k: np.concatenate([v, np.zeros((pad, v.shape[1]), v.dtype)]) for k, v in many.items()}
  one = {**one, "segment_ids": np.ones_like(one["input_ids"]),
         "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), one["input_ids"].shape)}
  loss = jax.jit(lambda b: mt.models.loss.model_loss(cfg, params, b))
  np.testing.assert_allclose(float(loss(many)), float(loss(one)), rtol=1e-5)


def test_text_documents_packed_with_boundaries():
  docs = ["first doc", "two", "the third one"]
  windows, seg = mt.data.pack(docs, 8, segments=True)
  assert (windows == mt.data.pack(docs, 8)).all()
  b = mt.data.PackedDataset(windows, len(windows), 0, segments_NxT1=seg).next_batch()
  tok = mt.data.ByteTokenizer()
  ends = [d + tok.decode([tok.EOS]) for d in docs]
  for ids, s, pos in zip(b["input_ids"], b["segment_ids"], b["positions"]):
    for doc_seg in np.unique(s):  # each segment is a piece of one document
      assert any(tok.decode(ids[s == doc_seg]) in d for d in ends)
      assert (pos[s == doc_seg] == np.arange((s == doc_seg).sum())).all()
  # The label at the last token of a piece starts the next document: not trained.
  boundary = np.diff(b["segment_ids"], axis=1) != 0
  assert boundary.sum() == 2
  assert (b["loss_mask"][:, :-1][boundary] == 0).all()
  assert b["loss_mask"][:, :-1][~boundary].all() and b["loss_mask"][:, -1].all()
