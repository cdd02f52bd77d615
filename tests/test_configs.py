"""Experiments as config files: each one runs, and the README shows its command."""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from megatrain_jax import configs
from megatrain_jax import train as train_lib
from megatrain_jax.train_config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "experiments", "configs", "*.py")))
TRAIN = os.path.join(REPO, "experiments", "train.py")
# What makes any of them tiny: a few steps on little data.
TINY = dict(steps=2, log_every=1, save_every=0, progress=False, batch_size=2,
            max_data_bytes=20_000)


def _load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _commands(path):
  """The `python experiments/train.py ...` lines of a config's docstring."""
  doc = _load(path).__doc__
  joined = re.sub(r"\\\s*\n\s*", " ", doc)  # continued lines
  return [re.sub(r"\s+", " ", line.strip()) for line in joined.splitlines()
          if line.strip().startswith("python experiments/train.py")]


def test_the_experiments_are_there():
  assert {os.path.basename(p) for p in CONFIGS} >= {"default.py", "chat.py", "moe.py",
                                                     "lora.py"}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_each_config_docstring_gives_the_command_the_readme_shows(path):
  name = os.path.relpath(path, REPO)
  commands = _commands(path)
  assert commands, f"{name}: no command in its docstring"
  readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
  readme = re.sub(r"[ \t]+", " ", re.sub(r"\\\s*\n\s*", " ", readme))
  for command in commands:
    assert command in readme, f"README.md does not show {name}'s command: {command}"
  if not name.endswith("default.py"):
    assert any(f"--config={name}" in c for c in commands)


def test_no_arguments_is_the_main_job():
  assert configs.train_config(_load(CONFIGS[0] if CONFIGS[0].endswith("default.py") else
                                    os.path.join(REPO, "experiments", "configs",
                                                 "default.py")).get_config()) == TrainConfig()
  assert _load(TRAIN).DEFAULT == os.path.join(REPO, "experiments", "configs", "default.py")


def test_every_config_runs_at_tiny_size(tmp_path):
  base = tmp_path / "base"  # lora.py's base: the default model, exported
  for path in sorted(CONFIGS, key=lambda p: p.endswith("lora.py")):
    name = os.path.basename(path)[:-3]
    c = _load(path).get_config()
    tiny = dict(TINY, workdir=str(tmp_path / name), seq_len=min(c.seq_len, 64))
    if c.attention_block:
      tiny["attention_block"] = 16
    if c.eval_every:
      tiny.update(eval_every=1, eval_batches=1)
    if name == "default":
      tiny["export_dir"] = str(base)
    if c.hf_model_dir:
      tiny["hf_model_dir"] = str(base)
    if c.export_adapter_dir:
      tiny["export_adapter_dir"] = str(tmp_path / "adapter")
    c.update(tiny)
    records = train_lib.run(configs.train_config(c))
    assert [r["step"] for r in records if "loss" in r] == [1, 2], name
    if c.eval_every:
      assert [r["step"] for r in records if "eval_loss" in r] == [1, 2], name
    if c.lora_rank:
      assert json.load(open(tmp_path / "adapter" / "adapter_config.json"))["r"] == c.lora_rank


def test_overrides_reach_nested_fields_and_bad_ones_are_named(tmp_path):
  r = subprocess.run([sys.executable, TRAIN, "--describe",
                      "--config=" + os.path.join("experiments", "configs", "moe.py"),
                      "--config.engine.prefetch_depth=3",
                      "--config.host_memory_limit_bytes=8G", "--config.batch_size=auto",
                      "--config.model=tiny"],
                     capture_output=True, text=True, timeout=300, cwd=REPO)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "--config.engine.prefetch_depth=3 " in r.stdout
  assert f"--config.host_memory_limit_bytes={8 * 2**30} " in r.stdout
  assert "--config.batch_size='auto' " in r.stdout
  assert "--config.workdir='runs/moe' " in r.stdout  # the file's own value
  bad = subprocess.run([sys.executable, TRAIN, "--config.engine.prefetch_dept=3"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
  assert bad.returncode != 0 and "prefetch_depth" in bad.stderr  # "did you mean"
  assert "Traceback" not in bad.stderr


def test_a_config_dict_round_trips_every_field():
  from megatrain_jax.engine import EngineConfig
  tc = TrainConfig(model="tiny_moe", lora_rank=4, host_memory_limit_bytes=2**30,
                   engine=EngineConfig(compute_dtype="bfloat16", grad_accum=2))
  assert configs.train_config(configs.config_dict(tc)) == tc
  c = configs.config_dict(tc)
  c.engine.prefetch_depth = 0
  c.host_memory_limit_bytes = "1.5G"
  got = configs.train_config(c)
  assert got.engine.prefetch_depth == 0 and got.host_memory_limit_bytes == 3 * 2**29
  with pytest.raises(ValueError, match="host_memory_limit_bytes"):
    c.host_memory_limit_bytes = "lots"
    configs.train_config(c)
