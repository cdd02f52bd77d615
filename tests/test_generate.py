"""Generation with a KV cache (`models.decode`, `megatrain_jax.generation`): the cached
block equals the full forward, greedy tokens equal `transformers`' generate, resident
and streamed, and sampling, EOS, the host cache and bad input behave as documented."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import megatrain_jax as mt
from megatrain_jax import hf
from megatrain_jax.models import decode, llama
from megatrain_jax.models.lora import LoraConfig

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
            max_seq_len=32)
DECODE_CASES = {
    "dense_gqa": {},
    "window": {"sliding_window": 3, "layer_types": ("sliding_attention", "full_attention")},
    "moe": {"n_experts": 4, "n_experts_per_tok": 2, "moe_d_ff": 32,
            "moe_layers": (True, False)},
    "qwen3_tied_lora": {"qk_norm": True, "attn_head_dim": 16, "qkv_bias": True,
                        "tie_embeddings": True,
                        "lora": LoraConfig(rank=4, alpha=8.0)},
}


def _perturbed(cfg, seed=0):
  """Random parameters (numpy: no compiles) whose logits are O(1): norm scales near 1,
  the rest, adapters included, normal with std 0.1."""
  shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, s: ((path[-1].key == "scale") + 0.1 * rng.standard_normal(s.shape)
                       ).astype(np.float32), shapes)


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_prefill_then_steps_equal_the_full_forward(case):
  cfg = mt.LlamaConfig(**BASE, **DECODE_CASES[case])
  params = _perturbed(cfg)
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
  forward = jax.jit(llama.forward, static_argnums=0)

  @jax.jit
  def logits(params, ids, positions, caches, lengths):
    x, caches = decode.model_decode(cfg, params, ids, positions, caches, lengths)
    return llama.logits_apply(cfg, params["head"], params["embed"], x), caches

  want = [np.asarray(forward(cfg, params, jnp.asarray(ids[r:r + 1])))[0] for r in range(2)]
  assert np.abs(want[0]).max() > 1.0  # logits large enough for the tolerance to mean much
  # Row 0 prefills 6 tokens, row 1 only 3 (its slots 3..5 get padding): then each row
  # steps one token at a time from its own position.
  lengths = np.array([6, 3], np.int32)
  caches = [decode.empty_cache(cfg, 2, 12, jnp.float32) for _ in range(cfg.n_layers)]
  positions = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))
  padded = ids[:, :6].copy()
  padded[1, 3:] = 0
  got, caches = logits(params, padded, positions, caches, lengths)
  for r in range(2):
    np.testing.assert_allclose(np.asarray(got)[r, :lengths[r]], want[r][:lengths[r]],
                               rtol=0, atol=2e-5)
  for _ in range(4):
    pos = lengths.copy()
    lengths = lengths + 1
    got, caches = logits(params, ids[np.arange(2), pos][:, None], pos[:, None], caches,
                         lengths)
    for r in range(2):
      np.testing.assert_allclose(np.asarray(got)[r, 0], want[r][pos[r]], rtol=0, atol=2e-5)


# -- parity with transformers --------------------------------------------------------

HF_SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-5)
HF_CASES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16})}
PROMPTS = [[3, 17, 42, 5, 9, 60, 2], [7, 8], [11, 12, 13, 14]]
NEW = 12


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def checkpoint(request, tmp_path_factory):
  """A tiny random checkpoint and `transformers`' greedy tokens and logits of PROMPTS."""
  config_cls, model_cls, extra = HF_CASES[request.param]
  torch.manual_seed(0)
  ref = getattr(transformers, model_cls)(
      getattr(transformers, config_cls)(**HF_SHAPE, **extra)).eval()
  with torch.no_grad():
    for p in ref.parameters():
      p.add_(0.05 * torch.randn_like(p))
  d = str(tmp_path_factory.mktemp(request.param))
  ref.save_pretrained(d)
  tokens, logits = [], []
  for prompt in PROMPTS:  # row by row: no padding on the reference's side
    out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                       max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                       pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    tokens.append(out.sequences[0, len(prompt):].tolist())
    logits.append(torch.cat(out.logits).numpy())
  assert all(len(t) == NEW for t in tokens)
  return d, tokens, logits


@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_greedy_equals_transformers(checkpoint, mode):
  d, want, ref_logits = checkpoint
  if mode == "resident":
    _, source = hf.from_pretrained(d)
    g = mt.generate(source, PROMPTS, max_new_tokens=NEW, temperature=0.0)
  else:
    with hf.streaming_trainer(d, optax.sgd(0.0),
                              mt.EngineConfig(compute_dtype=jnp.float32)) as source:
      g = mt.generate(source, PROMPTS, max_new_tokens=NEW, temperature=0.0)
      layers = sum(a.nbytes for u in range(1, source.cfg.n_layers + 2)
                   for a in jax.tree.leaves(source.unit_params(u)))
    # Each model call streamed every block and the head once (plus embedding rows).
    calls = g.stats["calls"]
    assert calls == NEW
    assert calls * layers <= g.stats["weight_h2d_bytes"] < calls * (layers + 4096)
  assert g.tokens == want
  assert g.eos == [False] * len(PROMPTS)
  for r in range(len(PROMPTS)):  # the log-probs are log_softmax of the raw logits
    ref_lp = torch.log_softmax(torch.tensor(ref_logits[r]), -1).numpy()
    np.testing.assert_allclose(g.logprobs[r], ref_lp[np.arange(NEW), want[r]], atol=1e-4)


# -- sampling, EOS, the host cache, compiles -----------------------------------------

# Tied embeddings and a sliding window (4 tokens, shorter than the rows) on layer 0: the
# streamed path's head and windows are checked against the resident one.
SAMPLE_CFG = mt.LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=64, max_seq_len=48, tie_embeddings=True, sliding_window=4,
                            layer_types=("sliding_attention", "full_attention"))
SAMPLE_PROMPTS = [[1, 2, 3, 4, 5], [9], [30, 31, 32]]
SAMPLE_NEW = 12  # one shape for the tests below: each compiles nothing the others did not


@pytest.fixture(scope="module")
def sample_model():
  return mt.Llama(SAMPLE_CFG, params=_perturbed(SAMPLE_CFG, seed=3))


def test_sampling_follows_the_key_and_reports_the_raw_logprobs(sample_model):
  run = lambda key, **kw: mt.generate(sample_model, SAMPLE_PROMPTS, SAMPLE_NEW,
                                      **{"temperature": 1.0, "key": key, **kw})
  forward = functools.partial(jax.jit(llama.forward, static_argnums=0), SAMPLE_CFG,
                              sample_model.param_tree())

  def teacher_forced(g):
    """Each generated token's log-prob, and the mass of the tokens likelier than it."""
    out, seqs = [], np.zeros((len(SAMPLE_PROMPTS), 24), np.int32)  # right-padded
    for r, prompt in enumerate(SAMPLE_PROMPTS):
      seqs[r, :len(prompt) + len(g.tokens[r])] = prompt + g.tokens[r]
    all_lp = np.asarray(jax.nn.log_softmax(forward(seqs), -1))
    for r, prompt in enumerate(SAMPLE_PROMPTS):
      lp = all_lp[r, len(prompt) - 1:len(prompt) + len(g.tokens[r]) - 1]
      mine = lp[np.arange(len(g.tokens[r])), g.tokens[r]]
      out.append((mine, np.where(lp > mine[:, None], np.exp(lp), 0.0).sum(-1)))
    return out

  a, b, c = run(jax.random.key(0)), run(jax.random.key(0)), run(jax.random.key(1))
  assert a.tokens == b.tokens
  assert all(x != y for x, y in zip(a.tokens, c.tokens))
  cool = run(jax.random.key(0), temperature=0.5)  # log-probs stay those of the raw logits
  for g in (a, cool):
    for r, (lp, _) in enumerate(teacher_forced(g)):
      np.testing.assert_allclose(g.logprobs[r], lp, atol=1e-5)
  # top_p: every draw is from the nucleus (the likelier tokens weigh less than top_p),
  # which at full temperature is not the case without it.
  assert any((above >= 0.3).any() for _, above in teacher_forced(a))
  assert all((above < 0.3).all() for _, above in teacher_forced(run(jax.random.key(5),
                                                                    top_p=0.3)))
  # A vanishing nucleus keeps only the most likely token: greedy decoding.
  greedy = mt.generate(sample_model, SAMPLE_PROMPTS, SAMPLE_NEW, temperature=0.0)
  assert run(jax.random.key(5), top_p=1e-6).tokens == greedy.tokens


def test_eos_ends_its_row_and_max_new_tokens_bounds_the_rest(sample_model):
  greedy = mt.generate(sample_model, SAMPLE_PROMPTS, SAMPLE_NEW, temperature=0.0).tokens
  assert all(len(t) == SAMPLE_NEW for t in greedy)
  eos = next(t for t in greedy[0][2:] if t not in greedy[1])
  g = mt.generate(sample_model, SAMPLE_PROMPTS, SAMPLE_NEW, temperature=0.0, eos_id=eos,
                  pad_id=-1)
  for r, row in enumerate(greedy):
    end = row.index(eos) + 1 if eos in row else len(row)
    assert g.tokens[r] == row[:end]
    assert g.eos[r] == (eos in row)
    assert len(g.logprobs[r]) == end
  assert g.tokens[0][-1] == eos and len(g.tokens[0]) < SAMPLE_NEW and g.eos[0]
  assert len(g.tokens[1]) == SAMPLE_NEW and not g.eos[1]
  tokens, logprobs, mask = g.padded()
  assert tokens.shape == (3, SAMPLE_NEW) and mask.sum() == sum(map(len, g.tokens))
  assert (tokens[0, len(g.tokens[0]):] == -1).all() and (logprobs[mask == 0] == 0).all()


@pytest.fixture(scope="module")
def trainer():
  tr = mt.StreamingTrainer(mt.Llama(SAMPLE_CFG, params=_perturbed(SAMPLE_CFG, seed=3)),
                           optax.sgd(0.0), mt.EngineConfig(compute_dtype=jnp.float32))
  yield tr
  tr.close()


def test_host_kv_cache_equals_device_kv_cache(trainer, sample_model):
  kw = dict(temperature=0.7, top_p=0.9, key=jax.random.key(2))
  run = lambda source, **more: mt.generate(source, SAMPLE_PROMPTS, SAMPLE_NEW, **kw, **more)
  on_device, on_host = run(trainer), run(trainer, kv_cache="host")
  resident = run(sample_model)
  # Resident weights (moved once) beside a cache in host memory.
  kept = run(sample_model, streamed=False, kv_cache="host")
  trained = run(mt.ResidentTrainer(sample_model, optax.sgd(0.0)))
  assert on_host.tokens == on_device.tokens == resident.tokens == trained.tokens == kept.tokens
  for x, y in zip(on_host.logprobs, on_device.logprobs):
    np.testing.assert_array_equal(x, y)
  moved = lambda g: g.stats["weight_h2d_bytes"]
  assert moved(kept) < moved(on_host) / 3  # once, not once per decode step


def test_placement_keeps_what_fits_on_the_device():
  cfg, f32 = mt.LlamaConfig(**BASE).replace(n_layers=4), jnp.float32
  weights = cfg.param_count() * 4
  layer_cache = 2 * 1 * 8 * cfg.n_kv_heads * cfg.head_dim * 4  # one row of 8 slots
  place = lambda budget: decode.placement(cfg, f32, 1, 8, budget)
  assert place(weights + cfg.n_layers * layer_cache) == (False, "device")
  assert place(weights + 2 * layer_cache) == (False, "host")
  assert place(weights - 1) == (True, "device")
  assert place(layer_cache) == (True, "host")
  # A StreamingTrainer whose device budget holds the weights and cache generates
  # resident (every weight moved once), one whose budget does not, streamed.
  prompts = [[1, 2, 3]] * 2
  for budget, once in ((10**9, True), (weights - 1, False)):
    with mt.StreamingTrainer(mt.Llama(cfg, params=_perturbed(cfg, seed=3)), optax.sgd(0.0),
                             mt.EngineConfig(device_budget_bytes=budget)) as tr:
      g = mt.generate(tr, prompts, 6, temperature=0.0)
    assert (g.stats["weight_h2d_bytes"] <= weights) == once, (budget, g.stats)


def test_top_p_keeps_exactly_the_nucleus_when_tokens_tie():
  """With every logit equal, top_p=0.3 keeps the first 77 of 256 tokens (their mass
  reaches 0.3), not every token tied with the last one kept."""
  params = _perturbed(SAMPLE_CFG, seed=3)
  params["embed"]["embedding"] = np.zeros_like(params["embed"]["embedding"])  # tied head
  flat = mt.Llama(SAMPLE_CFG, params=params)
  draw = lambda top_p: np.concatenate([mt.generate(
      flat, [[1]] * 16, 3, temperature=1.0, top_p=top_p, key=jax.random.key(k)).padded()[0]
      for k in range(4)])
  assert draw(0.3).max() < 77 and draw(1.0).max() >= 77


@pytest.mark.parametrize("streamed", [False, True])
def test_compiles_once_per_shape_not_per_step(sample_model, streamed):
  traces = []
  listen = lambda event, *_, **__: traces.append(event)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    run = lambda: mt.generate(sample_model, [[4, 5, 6], [7]], 12, temperature=0.0,
                              streamed=streamed)
    run()
    first = traces.count("/jax/core/compile/jaxpr_trace_duration")
    run()
    second = traces.count("/jax/core/compile/jaxpr_trace_duration") - first
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert first < 12 and second == 0, (first, second)


# -- bad input -----------------------------------------------------------------------

BAD = {
    "no prompts": (dict(prompts=[]), "prompts is empty"),
    "empty prompt": (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
    "id too big": (dict(prompts=[[1, 256]]), "outside \\[0, vocab_size=256\\)"),
    "negative id": (dict(prompts=[[-1, 3]]), "outside \\[0, vocab_size=256\\)"),
    "too long": (dict(prompts=[[1] * 40], max_new_tokens=9), "max_seq_len=48"),
    "no new tokens": (dict(max_new_tokens=0), "max_new_tokens=0"),
    "top_p zero": (dict(top_p=0.0), "top_p=0.0 must be in \\(0, 1\\]"),
    "top_p above one": (dict(top_p=1.5), "top_p=1.5"),
    "negative temperature": (dict(temperature=-0.5), "temperature=-0.5"),
    "sampling without a key": (dict(temperature=1.0, key=None), "PRNG key"),
    "int key": (dict(key=0), "not a PRNG key"),
    "eos outside": (dict(eos_id=999), "eos_id=999"),
    "unknown cache": (dict(kv_cache="disk"), "kv_cache='disk'"),
    "tiny temperature": (dict(temperature=1e-6), "temperature=1e-06 is below"),
    "bool temperature": (dict(temperature=True), "temperature=True"),
    "fractional pad": (dict(pad_id=0.5), "pad_id=0.5"),
    "fractional eos": (dict(eos_id=2.5), "eos_id=2.5"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_naming_it(sample_model, case):
  kw, message = BAD[case]
  args = dict(prompts=[[1, 2, 3]], max_new_tokens=4, temperature=1.0,
              key=jax.random.key(0))
  args.update(kw)
  with pytest.raises(ValueError, match=message):
    mt.generate(sample_model, **args)


def test_only_models_and_trainers_generate():
  with pytest.raises(TypeError, match="mt.Llama, a ResidentTrainer or a StreamingTrainer"):
    mt.generate({"embed": {}}, [[1]], 2, temperature=0.0)


def test_a_lora_trainer_generates_as_its_model_from_its_own_fetches():
  """A StreamingTrainer's units come from its own fetch (base frozen in the compute
  dtype, adapters trained): no host copy of the model, the same tokens."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  cfg = mt.LlamaConfig(**BASE, lora=LoraConfig(rank=2, alpha=4))
  model = mt.Llama(cfg, params=_perturbed(cfg, seed=5))
  prompts = [[1, 2, 3], [4]]
  want = mt.generate(model, prompts, 6, temperature=0.0)
  with mt.StreamingTrainer(model, optax.sgd(0.0), mt.EngineConfig(),
                           trainable=nnx.LoRAParam) as tr:
    for streamed in (True, False):
      assert mt.generate(tr, prompts, 6, temperature=0.0, streamed=streamed).tokens == \
          want.tokens
  assert tr.closed  # closed, it generates from its masters on the host
  assert mt.generate(tr, prompts, 6, temperature=0.0).tokens == want.tokens
