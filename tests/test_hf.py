"""Parity with `transformers` (PyTorch, CPU, fp32) for Llama, Qwen2, Qwen3, Mistral, Mixtral,
Qwen2-MoE and Qwen3-MoE checkpoints."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import megatrain_jax as mt
from megatrain_jax import hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5)
CASES = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", "llama", {}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", "llama",
                   {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "qwen2_qkv_bias": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", {}),
    # Mistral's default sliding window (4096) is longer than any sequence here.
    "mistral": ("MistralConfig", "MistralForCausalLM", "mistral", {}),
    # Sliding windows shorter than the 24-token batches: every layer (Mistral), the
    # layers from max_window_layers on (Qwen2), the layers layer_types names (Qwen3).
    "mistral_window": ("MistralConfig", "MistralForCausalLM", "mistral",
                       {"sliding_window": 5}),
    "qwen2_window_layers": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", {
        "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3_layer_types": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {
        "head_dim": 16, "use_sliding_window": True, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"]}),
    # A head wider than hidden_size / heads (Mistral-Nemo's shape).
    "mistral_head_dim": ("MistralConfig", "MistralForCausalLM", "mistral", {"head_dim": 16}),
    # Qwen3: its own head width and RMS norms on queries and keys.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {"head_dim": 16}),
    # Rotary scalings, with a pretraining context short enough to matter at 24 tokens.
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", "llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM", "llama", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "llama_yarn_rope": ("LlamaConfig", "LlamaForCausalLM", "llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}}),
    # Mixture-of-experts, each with its load-balancing loss in the training loss.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "mixtral", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
        "router_aux_loss_coef": 0.05}),
    # A dense layer 0 (mlp_only_layers), a shared expert, top-k weights as routed.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2_moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 48, "mlp_only_layers": [0],
        "norm_topk_prob": False, "output_router_logits": True, "router_aux_loss_coef": 0.05}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe", {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "norm_topk_prob": True, "output_router_logits": True,
        "router_aux_loss_coef": 0.05}),
}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def _hf_model(case, **overrides):
  config_cls, model_cls, _, extra = CASES[case]
  config = getattr(transformers, config_cls)(**{**SHAPE, **extra, **overrides})
  torch.manual_seed(0)
  model = getattr(transformers, model_cls)(config).eval()
  with torch.no_grad():  # random biases and norm scales too, so each mapping matters
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
  d = str(tmp_path_factory.mktemp(request.param))
  model = _hf_model(request.param)
  model.save_pretrained(d)
  return request.param, d, model


def _batch(seed=0, b=2, t=24):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, SHAPE["vocab_size"], (b, t + 1)).astype(np.int32)
  mask = (rng.random((b, t)) > 0.3).astype(np.float32)
  return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": mask}


def _torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


def test_logits_match(checkpoint):
  _, d, ref = checkpoint
  cfg, model = hf.from_pretrained(d)
  ids = _batch()["input_ids"]
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), _torch_logits(ref, ids),
                             rtol=0, atol=1e-4)


def _grads_as_saved(ref, layer):
  """Layer `layer`'s gradients under the tensor names save_pretrained writes (in memory,
  transformers 5 holds each MoE layer's experts fused: gate_up_proj [E, 2F, D])."""
  out, mixtral = {}, isinstance(ref, transformers.MixtralForCausalLM)
  disk = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {}
  for n, p in ref.named_parameters():
    if not n.startswith(f"model.layers.{layer}."):
      continue
    g, pre = p.grad.numpy(), n.rsplit(".", 1)[0]
    if mixtral:
      pre = pre.replace(".mlp.", ".block_sparse_moe.").replace(".mlp", ".block_sparse_moe")
    if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj"):
      parts = ({"gate_proj": g[:, :g.shape[1] // 2], "up_proj": g[:, g.shape[1] // 2:]}
               if n.endswith("gate_up_proj") else {"down_proj": g})
      for kind, x in parts.items():
        for e in range(x.shape[0]):
          out[f"{pre}.{e}.{disk.get(kind, kind)}.weight"] = x[e]
    else:
      out[f"{pre}.{n.rsplit('.', 1)[1]}"] = g
  return out


def test_loss_and_layer_gradient_match_autograd(checkpoint):
  case, d, ref = checkpoint
  cfg, model = hf.from_pretrained(d)
  batch = _batch(1)
  loss, grads = mt.ResidentTrainer(model, optax.sgd(0.0)).loss_and_grads(batch)

  ref.zero_grad()
  logits = ref(torch.tensor(batch["input_ids"], dtype=torch.long)).logits
  ce = torch.nn.functional.cross_entropy(
      logits.reshape(-1, logits.shape[-1]), torch.tensor(batch["labels"], dtype=torch.long).reshape(-1),
      reduction="none")
  mask = torch.tensor(batch["loss_mask"]).reshape(-1)
  ref_loss = (ce * mask).sum() / mask.sum()
  if case in MOE:  # as the model's own training loss adds it
    aux = ref(torch.tensor(batch["input_ids"], dtype=torch.long),
              output_router_logits=True).aux_loss
    ref_loss = ref_loss + ref.config.router_aux_loss_coef * aux
  ref_loss.backward()
  np.testing.assert_allclose(loss, ref_loss.item(), rtol=1e-4)
  params = _grads_as_saved(ref, 1)
  names = hf.block_tensor_names(1, cfg, CASES[case][2])  # every tensor of layer 1
  if case not in MOE:
    assert len(names) == (12 if CASES[case][2] == "qwen2" else 11 if CASES[case][2] == "qwen3"
                          else 9)
  assert set(names) == set(params)
  for name, (path, transpose) in names.items():
    want = params[name]
    got = np.asarray(hf.tree_get(grads["blocks"][1], path))
    got = got.T if transpose else got
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-4 * scale, name


@pytest.mark.parametrize("case", MOE)
def test_load_balancing_loss_matches(case, tmp_path):
  ref = _hf_model(case)
  ref.save_pretrained(str(tmp_path))
  cfg, model = hf.from_pretrained(str(tmp_path))
  assert cfg.router_aux_loss_coef == 0.05 and cfg.n_experts == 4
  ids = _batch(3)["input_ids"]
  _, aux = mt.models.llama.forward_and_aux(cfg, model.param_tree(), jnp.asarray(ids))
  with torch.no_grad():
    want = ref(torch.tensor(ids, dtype=torch.long), output_router_logits=True).aux_loss
  assert want.item() > 0
  np.testing.assert_allclose(float(aux), want.item(), rtol=1e-5)


def test_export_loads_in_transformers_with_the_same_logits(checkpoint, tmp_path):
  case, d, ref = checkpoint
  cfg, model = hf.from_pretrained(d)
  out = str(tmp_path / "export")
  hf.save_pretrained(model, cfg, out, architecture=CASES[case][2])
  reloaded = getattr(transformers, CASES[case][1]).from_pretrained(out).eval()
  ids = _batch(2)["input_ids"]
  np.testing.assert_allclose(_torch_logits(reloaded, ids), _torch_logits(ref, ids),
                             rtol=0, atol=1e-4)


def test_export_round_trips_bit_for_bit(checkpoint, tmp_path):
  case, d, _ = checkpoint
  cfg, model = hf.from_pretrained(d)
  _, arch, _ = hf.read_config(d)
  out = str(tmp_path / "export")
  hf.save_pretrained(model, cfg, out, architecture=arch)
  cfg2, model2 = hf.from_pretrained(out)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, model2.param_tree(), model.param_tree())


def test_rope_scalings_are_read_into_the_config():
  base = json.loads(_hf_model("llama3_rope").config.to_json_string())  # as on disk
  cfg, _ = hf.config_from_hf(base)
  assert cfg.rope_scaling == mt.RopeScaling(
      rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=16)
  assert cfg.rope_theta == 500000.0
  old_style = {k: v for k, v in base.items() if k != "rope_parameters"}
  old_style.update(rope_theta=500000.0, rope_scaling={  # transformers 4's layout
      "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16})
  assert hf.config_from_hf(old_style)[0] == cfg


def test_sharded_checkpoint_streams_without_the_model_on_the_device(tmp_path):
  ref = _hf_model("llama_gqa", num_hidden_layers=16, hidden_size=64, intermediate_size=256)
  d = str(tmp_path / "sharded")
  ref.save_pretrained(d, max_shard_size="600KB")
  with open(os.path.join(d, "model.safetensors.index.json")) as f:
    assert len(set(json.load(f)["weight_map"].values())) >= 4
  cfg, model = hf.from_pretrained(d)
  batch = _batch(3)
  want = mt.ResidentTrainer(model, optax.sgd(0.1)).step(batch)["loss"]
  with hf.streaming_trainer(d, optax.sgd(0.1)) as eng:
    got = eng.step(batch)["loss"]
    stats = eng.stats()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    model_bytes = 4 * stats["param_count"]
    assert stats["device_peak_bytes"] < model_bytes / 2, (stats["device_peak_bytes"], model_bytes)
    # The export of a trainer is unit by unit, and splits into shards as asked.
    hf.save_pretrained(eng, cfg, str(tmp_path / "out"), max_shard_bytes=600_000)
  assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")
  assert hf.read_config(str(tmp_path / "out"))[0] == cfg


def test_sliding_windows_are_read_per_layer():
  qwen2 = json.loads(_hf_model("qwen2_window_layers", num_hidden_layers=4).config.to_json_string())
  cfg, _ = hf.config_from_hf(qwen2)
  assert [cfg.layer_window(i) for i in range(4)] == [None, 6, 6, 6]
  del qwen2["layer_types"]  # as transformers 4 wrote it: max_window_layers decides
  qwen2["max_window_layers"] = 2
  cfg, _ = hf.config_from_hf(qwen2)
  assert [cfg.layer_window(i) for i in range(4)] == [None, None, 6, 6]
  qwen2["use_sliding_window"] = False  # the window is off, whatever its width
  assert hf.config_from_hf(qwen2)[0].sliding_window is None
  mistral = json.loads(_hf_model("mistral_window").config.to_json_string())
  assert [hf.config_from_hf(mistral)[0].layer_window(i) for i in range(2)] == [5, 5]
  mixed = hf.config_from_hf(qwen2 | {"use_sliding_window": True})[0]
  with pytest.raises(ValueError, match="cannot be written as mistral"):
    hf.hf_config(mixed, "mistral")
  with pytest.raises(ValueError, match="cannot be written as llama"):
    hf.hf_config(mixed.replace(qkv_bias=False), "llama")


def test_moe_windows_are_read_as_transformers_builds_them():
  base = json.loads(_hf_model("qwen3_moe", num_hidden_layers=4).config.to_json_string())
  # Qwen3-MoE: every layer slides once the window is on; max_window_layers is unused.
  q3 = hf.config_from_hf(base | {"use_sliding_window": True, "sliding_window": 5,
                                 "max_window_layers": 2})[0]
  assert [q3.layer_window(i) for i in range(4)] == [5] * 4
  with pytest.raises(ValueError, match="cannot be written as qwen3_moe"):
    hf.hf_config(q3.replace(layer_types=("full_attention",) + ("sliding_attention",) * 3),
                 "qwen3_moe")
  # Qwen2-MoE without layer_types: the even-numbered layers below max_window_layers.
  q2 = json.loads(_hf_model("qwen2_moe", num_hidden_layers=4).config.to_json_string())
  del q2["layer_types"]
  q2.update(use_sliding_window=True, sliding_window=5, max_window_layers=3)
  assert [hf.config_from_hf(q2)[0].layer_window(i) for i in range(4)] == [5, None, 5, None]
  # A window as long as the context is no window (as Mistral 7B v0.1's configs had it).
  long = hf.config_from_hf(q2 | {"sliding_window": q2["max_position_embeddings"]})[0]
  assert long.sliding_window is None
  with pytest.raises(ValueError, match="mixture-of-experts model cannot be written as llama"):
    hf.hf_config(mt.preset("tiny_moe"), "llama")
  with pytest.raises(ValueError, match="Mixtral's layers are all MoE"):
    hf.hf_config(mt.preset("tiny_moe").replace(shared_expert_d_ff=None), "mixtral")


def test_older_top_level_rope_theta_is_read():
  cfg, arch = hf.config_from_hf({
      "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
      "hidden_act": "silu", "bos_token_id": 1, "use_cache": True})
  assert arch == "llama" and cfg.rope_theta == 500000.0 and cfg.n_kv_heads == 4


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "dynamic NTK scaling"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                          "frobnicate": 1}}, "with ['frobnicate']: not implemented"),
    ({"partial_rotary_factor": 0.5}, "partial rotary embeddings"),
    ({"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"]},
     "mistral slides every layer"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "sliding_window": 16},
     "llama has no sliding window"),
    ({"sliding_window": 0}, "sliding_window=0: expected a positive integer"),
    ({"hidden_act": "gelu"}, "only SiLU"),
    ({"attention_bias": True}, "attention biases"),
    ({"frobnication_level": 3}, "frobnication_level=3: unknown key"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "only ['LlamaForCausalLM'"),
])
def test_unimplemented_config_is_refused_by_name(change, message):
  base = json.loads(_hf_model("mistral").config.to_json_string())
  base.update(change)
  with pytest.raises(ValueError, match="does not implement") as e:
    hf.config_from_hf(base)
  assert message in str(e.value)


def _write_tokenizer(d):
  """A word-level tokenizer.json and a ChatML chat template, built here."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  words = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "\n"]
  words += [f"w{i}" for i in range(40)]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  tok.save(os.path.join(d, "tokenizer.json"))
  template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}"
              "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant "
              "{% endif %}")
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "chat_template": template}, f)


def test_hf_tokenizer_masks_every_assistant_turn(tmp_path):
  _write_tokenizer(str(tmp_path))
  tok = mt.data.HFTokenizer(str(tmp_path))
  conv = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"},
          {"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]
  ids, mask = mt.data.encode_conversation(tok, conv)
  trained = [tok.id_to_token(i) for i, m in zip(ids, mask) if m]
  assert trained == ["w3", "w4", "<|im_end|>", "w6", "<|im_end|>"]
  assert "".join(tok.id_to_token(i) for i in ids).count("<|im_start|>") == 4


def test_launcher_fine_tunes_and_exports_a_local_checkpoint(tmp_path):
  d = str(tmp_path / "base")
  _hf_model("qwen2_qkv_bias").save_pretrained(d)
  _write_tokenizer(d)
  data = tmp_path / "chat.jsonl"
  with open(data, "w") as f:
    for i in range(12):
      f.write(json.dumps({"conversations": [
          {"from": "human", "value": f"w{i} w{i + 1}"},
          {"from": "gpt", "value": f"w{i + 2} w{i + 3} w{i + 4}"}]}) + "\n")
  out = str(tmp_path / "export")
  r = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "train.py"), f"--config.workdir={tmp_path}/run",
       f"--config.hf_model_dir={d}", f"--config.data={data}", "--config.data_format=sharegpt", "--config.steps=4",
       "--config.batch_size=4", "--config.seq_len=16", "--config.lr=1e-3", f"--config.export_dir={out}", "--config.save_every=0"],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert r.returncode == 0, r.stderr[-3000:]
  tuned = transformers.Qwen2ForCausalLM.from_pretrained(out).eval()
  base = transformers.Qwen2ForCausalLM.from_pretrained(d).eval()
  ids = _batch()["input_ids"]
  assert np.abs(_torch_logits(tuned, ids) - _torch_logits(base, ids)).max() > 1e-4
  assert os.path.exists(os.path.join(out, "tokenizer.json"))


# --- Bad checkpoints: one clear message, before anything is built -------------------

def _saved(tmp_path, case="llama_gqa"):
  d = str(tmp_path / "ckpt")
  _hf_model(case).save_pretrained(d)
  return d


def _rewrite_tensor(d, name, value):
  from safetensors.numpy import load_file, save_file
  path = os.path.join(d, "model.safetensors")
  tensors = load_file(path)
  tensors[name] = value
  save_file(tensors, path, metadata={"format": "pt"})


def test_a_tensor_of_the_wrong_shape_is_named_when_read(tmp_path):
  d = _saved(tmp_path)
  _rewrite_tensor(d, "model.layers.1.mlp.down_proj.weight", np.zeros((32, 48), np.float32))
  for load in (lambda: hf.from_pretrained(d),
               lambda: hf.streaming_trainer(d, optax.sgd(0.1))):
    with pytest.raises(ValueError) as e:
      load()
    msg = str(e.value)
    assert "model.layers.1.mlp.down_proj.weight" in msg and "(32, 64)" in msg
    assert "(32, 48)" in msg and "model.safetensors" in msg


def test_a_tensor_of_an_unreadable_dtype_is_named(tmp_path):
  d = _saved(tmp_path)
  _rewrite_tensor(d, "model.norm.weight", np.zeros((32,), np.int32))
  with pytest.raises(ValueError, match=r"model\.norm\.weight.*int32.*floating"):
    hf.from_pretrained(d)


def test_a_truncated_safetensors_file_is_named(tmp_path):
  d = _saved(tmp_path)
  path = os.path.join(d, "model.safetensors")
  with open(path, "r+b") as f:
    f.truncate(100)
  with pytest.raises(ValueError) as e:
    hf.from_pretrained(d)
  assert path in str(e.value) and "cannot be read" in str(e.value)


def test_a_config_promising_more_layers_than_the_weights_is_named(tmp_path):
  d = _saved(tmp_path)
  with open(os.path.join(d, "config.json")) as f:
    config = json.load(f)
  config["num_hidden_layers"] = 3
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError) as e:
    hf.from_pretrained(d)
  msg = str(e.value)
  assert "num_hidden_layers=3" in msg and "model.layers.2." in msg and "missing" in msg


@pytest.mark.parametrize("damage, message", [
    ("shape", "model.layers.1.mlp.down_proj.weight"),
    ("truncated", "cannot be read"),
    ("layers", "num_hidden_layers=3"),
])
def test_the_launcher_prints_a_bad_checkpoint_as_one_message(tmp_path, damage, message):
  d = _saved(tmp_path)
  if damage == "shape":
    _rewrite_tensor(d, "model.layers.1.mlp.down_proj.weight", np.zeros((32, 48), np.float32))
  elif damage == "truncated":
    with open(os.path.join(d, "model.safetensors"), "r+b") as f:
      f.truncate(100)
  else:
    with open(os.path.join(d, "config.json")) as f:
      config = json.load(f)
    config["num_hidden_layers"] = 3
    with open(os.path.join(d, "config.json"), "w") as f:
      json.dump(config, f)
  r = subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "train.py"),
       f"--config.workdir={tmp_path}/run", f"--config.hf_model_dir={d}", "--config.steps=2", "--config.batch_size=2",
       "--config.seq_len=16", "--config.max_data_bytes=20000"],
      capture_output=True, text=True, timeout=300, cwd=REPO)
  assert r.returncode != 0
  assert message in r.stderr
  assert "Traceback" not in r.stderr and "--config.engine.prefetch_depth" not in r.stderr
