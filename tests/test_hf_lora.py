"""LoRA adapters in and out of PEFT (`megatrain_jax.hf_lora`), against `peft` and
`transformers` on tiny random Llama and Qwen3 checkpoints (PyTorch, CPU, fp32)."""

import json
import os

import jax
import numpy as np
import optax
import peft
import pytest
import torch
from flax import nnx

import megatrain_jax as mt
from megatrain_jax import hf, lora

from test_hf import _hf_model

CASES = ("llama_gqa", "qwen3")  # tied embeddings: tests/test_lora.py
LORA = lora.LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "gate_proj",
                                                 "down_proj"))


@pytest.fixture(scope="module", params=CASES)
def base(request, tmp_path_factory):
  d = str(tmp_path_factory.mktemp(request.param))
  _hf_model(request.param).save_pretrained(d)
  return d


def _ids(seed=0):
  return np.random.default_rng(seed).integers(0, 96, (2, 12), dtype=np.int32)


def _ours(model, ids):
  return np.asarray(model(ids))


def _peft_logits(base_dir, adapter_dir, ids, merge=False):
  import transformers
  m = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
  pm = peft.PeftModel.from_pretrained(m, adapter_dir).eval()
  if merge:
    pm = pm.merge_and_unload()
  with torch.no_grad():
    return pm(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def _trained_adapters(model, seed=3):
  """Non-zero values in every adapter, as training would leave them."""
  params = model.param_tree()
  rng = np.random.default_rng(seed)
  for k, v in lora.adapter_tree(params).items():
    leaf = params
    for p in k[:-1]:
      leaf = leaf[p]
    leaf[k[-1]] = (0.05 * rng.standard_normal(v.shape)).astype(np.float32)
  model.load_param_tree(params)
  return model


def test_an_adapter_we_export_gives_peft_our_logits(base, tmp_path):
  _, model = hf.from_pretrained(base)
  _trained_adapters(lora.apply(model, LORA, rngs=nnx.Rngs(0)))
  out = str(tmp_path / "adapter")
  hf.save_adapter(model, model.cfg, out, base_model=base)
  ids = _ids()
  np.testing.assert_allclose(_peft_logits(base, out, ids), _ours(model, ids), atol=1e-4,
                             rtol=1e-4)
  assert json.load(open(os.path.join(out, "adapter_config.json")))["r"] == LORA.rank


def test_an_adapter_peft_made_loads_into_ours(base, tmp_path):
  import transformers
  m = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
  pm = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=16,
                                              target_modules=["k_proj", "up_proj", "o_proj"],
                                              task_type="CAUSAL_LM"))
  torch.manual_seed(1)
  with torch.no_grad():  # PEFT starts B at zero: give it values, so each one matters
    for name, p in pm.named_parameters():
      if "lora_B" in name:
        p.normal_(0, 0.05)
  adapter = str(tmp_path / "peft_adapter")
  pm.save_pretrained(adapter)
  _, model = hf.from_pretrained(base)
  hf.load_adapter(model, adapter)
  assert model.cfg.lora == lora.LoraConfig(rank=4, alpha=16,
                                           targets=("k_proj", "o_proj", "up_proj"))
  ids = _ids(1)
  with torch.no_grad():
    want = pm.eval()(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(_ours(model, ids), want, atol=1e-4, rtol=1e-4)
  # Saved in bf16, it reads back exactly (numpy has no bf16: the reader converts).
  bf16 = str(tmp_path / "peft_adapter_bf16")
  pm.to(torch.bfloat16).save_pretrained(bf16)
  hf.load_adapter(model, bf16)
  want_a = dict(pm.named_parameters())[
      "base_model.model.model.layers.1.self_attn.k_proj.lora_A.default.weight"]
  np.testing.assert_array_equal(model.param_tree()["blocks"][1]["attn"]["k"]["lora_a"],
                                want_a.float().detach().numpy().T)
  hf.load_adapter(model, adapter)
  # And into a streaming trainer from the base checkpoint, the adapter training.
  with hf.streaming_trainer(base, optax.adam(1e-3), mt.EngineConfig(),
                            adapter_dir=adapter) as eng:
    got = lora.adapter_tree(eng.params())
  for k, v in lora.adapter_tree(model.param_tree()).items():
    np.testing.assert_array_equal(got[k], v)


def test_the_merged_export_equals_merge_and_unload(base, tmp_path):
  _, model = hf.from_pretrained(base)
  _trained_adapters(lora.apply(model, LORA, rngs=nnx.Rngs(0)))
  adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
  hf.save_adapter(model, model.cfg, adapter)
  with pytest.raises(ValueError, match="merge_lora=True"):
    hf.save_pretrained(model, model.cfg, merged)
  with pytest.raises(ValueError, match="lora=None"):  # a config read before the adapters
    hf.save_pretrained(model, model.cfg.replace(lora=None), merged, merge_lora=True)
  hf.export(model, model.cfg, merged, source_dir=base, merge_lora=True)
  import transformers
  m = transformers.AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32)
  ids = _ids(2)
  with torch.no_grad():
    got = m(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(got, _peft_logits(base, adapter, ids, merge=True), atol=1e-4,
                             rtol=1e-4)


def test_unimplemented_peft_settings_are_refused_by_name(base, tmp_path):
  _, model = hf.from_pretrained(base)
  lora.apply(model, LORA, rngs=nnx.Rngs(0))
  out = str(tmp_path / "adapter")
  hf.save_adapter(model, model.cfg, out)
  path = os.path.join(out, "adapter_config.json")
  c = json.load(open(path))
  json.dump({**c, "use_dora": True, "use_rslora": True}, open(path, "w"))
  with pytest.raises(ValueError, match="use_dora=True.*use_rslora=True"):
    hf.read_adapter_config(out)
  json.dump({**c, "r": 8}, open(path, "w"))  # the tensors are rank 4
  _, fresh = hf.from_pretrained(base)
  with pytest.raises(ValueError, match="wrong shapes"):
    hf.load_adapter(fresh, out)


def test_fresh_adapters_on_a_checkpoint_train_the_adapters_only(base):
  start = hf.from_pretrained(base)[1].param_tree()
  batch = {"input_ids": _ids(), "labels": _ids(5), "loss_mask": np.ones((2, 12), np.float32)}
  with hf.streaming_trainer(base, optax.adam(1e-2), mt.EngineConfig(compute_dtype="bfloat16"),
                            lora=LORA, key=jax.random.key(4)) as eng:
    eng.step(batch)
    params, layout = eng.params(), eng.state_layout()
  # The base is kept frozen in bf16 (no fp32 master), and stays as it was there.
  assert all(part["frozen"][1] == "bfloat16" for part in layout.values())
  for a, b in zip(jax.tree.leaves(lora.strip_adapters(params)), jax.tree.leaves(start)):
    np.testing.assert_array_equal(a, np.asarray(b, np.float32).astype(jax.numpy.bfloat16)
                                  .astype(np.float32))
  assert all(np.abs(v).max() > 0 for k, v in lora.adapter_tree(params).items()
             if k[-1] == "lora_b")


def _launch(tmp_path, base_dir, *flags):
  import subprocess
  import sys
  from test_hf import REPO
  return subprocess.run(
      [sys.executable, os.path.join(REPO, "experiments", "train.py"),
       f"--config.workdir={tmp_path}/run", f"--config.hf_model_dir={base_dir}", "--config.data=stdlib",
       "--config.max_data_bytes=20000", "--config.batch_size=4", "--config.seq_len=16", "--config.lr=1e-2",
       "--config.lora_rank=4", "--config.lora_alpha=8", "--config.lora_targets=q_proj,v_proj,down_proj",
       "--config.lora_dropout=0.1", "--config.save_every=2", "--config.log_every=1", "--config.progress=false", *flags],
      capture_output=True, text=True, timeout=600, cwd=REPO)


def test_the_launcher_fine_tunes_lora_resumes_and_exports_for_peft(tmp_path):
  import transformers
  base = str(tmp_path / "base")
  _hf_model("llama_gqa", vocab_size=260).save_pretrained(base)
  adapter = str(tmp_path / "adapter")
  r = _launch(tmp_path, base, "--config.steps=4", f"--config.export_adapter_dir={adapter}")
  assert r.returncode == 0, r.stderr[-3000:]
  whole = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
  # A checkpoint holds the adapters and their state, not the base: a reference to it.
  ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
  meta = json.load(open(ckpt / "meta.json"))
  assert meta["base_checksums"] and all("frozen" not in part
                                        for part in meta["layout"].values())
  size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
  base_bytes = sum(f.stat().st_size for f in (tmp_path / "base").glob("*.safetensors"))
  assert size < base_bytes / 2
  # The exported adapter loads in PEFT and generates.
  m = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
  pm = peft.PeftModel.from_pretrained(m, adapter).eval()
  out = pm.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
  assert out.shape == (1, 7)
  # Stopped after 2 steps and resumed: the same losses as the run in one go.
  r = _launch(tmp_path / "again", base, "--config.steps=4", "--config.stop_after=2")
  assert r.returncode == 0, r.stderr[-3000:]
  r = _launch(tmp_path / "again", base, "--config.steps=4")
  assert r.returncode == 0, r.stderr[-3000:]
  resumed = [json.loads(x) for x in open(tmp_path / "again" / "run" / "metrics.jsonl")]
  assert [x["loss"] for x in resumed] == [x["loss"] for x in whole]
  # A changed base is refused on resume, naming it.
  with torch.no_grad():
    changed = _hf_model("llama_gqa", vocab_size=260)
    changed.model.layers[0].mlp.up_proj.weight.add_(1.0)
    changed.save_pretrained(base)
  r = _launch(tmp_path / "again", base, "--config.steps=4")
  assert r.returncode != 0 and "frozen values differ" in r.stderr, r.stderr[-2000:]
