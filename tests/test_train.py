import json
import math
import os
import subprocess
import sys

import pytest

import megatrain_jax as mt
from megatrain_jax import progress
from megatrain_jax import train as train_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "experiments", "train.py")


def _run(*args):
  return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True,
                        timeout=300, cwd=REPO)


@pytest.mark.parametrize("trainer", ["streaming", "resident"])
def test_launcher_writes_metrics_evaluations_events_and_plot(tmp_path, trainer):
  tb = tmp_path / "tb"
  if trainer == "streaming":  # the script itself, overrides and all
    r = _run(f"--config.workdir={tmp_path}", f"--config.trainer={trainer}",
             "--config.steps=6", "--config.log_every=2", "--config.batch_size=4",
             "--config.seq_len=32", "--config.max_data_bytes=200000",
             "--config.engine.host_threads=3", "--config.pack=true",
             "--config.attention_block=8", "--config.mlp_chunk=50", "--config.eval_every=3",
             "--config.eval_batches=2", f"--config.tensorboard_dir={tb}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fused AdamW on 3 threads" in r.stderr
    assert "step 3  eval loss" in r.stderr
    meta = json.load(open(tmp_path / "checkpoints" / "step_00000006" / "meta.json"))
    assert meta["run"]["pack"] is True
  else:  # the same run, in-process
    train_lib.run(train_lib.TrainConfig(
        workdir=str(tmp_path), trainer=trainer, steps=6, log_every=2, batch_size=4,
        seq_len=32, max_data_bytes=200_000, progress=False, eval_every=3, eval_batches=2,
        tensorboard_dir=str(tb)))
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 4, 6]
  schedule = train_lib.lr_schedule(train_lib.TrainConfig(steps=6))
  for rec in steps:
    assert rec["loss"] > 0 and rec["tokens_per_s"] > 0 and rec["grad_norm"] > 0
    assert rec["lr"] == pytest.approx(float(schedule(rec["step"] - 1)))
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in evals] == [3, 6]
  for rec in evals:  # 2 batches of 4 x 32 held-out tokens
    assert rec["eval_tokens"] == 256 and rec["eval_perplexity"] == pytest.approx(
        math.exp(rec["eval_loss"]))
  assert evals[1]["eval_loss"] < evals[0]["eval_loss"]  # it learns what it did not see
  assert (tmp_path / "loss.png").stat().st_size > 1000
  # The same numbers, read back by TensorBoard's own event reader.
  from tensorboard.backend.event_processing import event_accumulator
  events = event_accumulator.EventAccumulator(str(tb))
  events.Reload()
  loss = events.Scalars("train/loss")
  assert [e.step for e in loss] == [1, 2, 4, 6]
  assert [e.value for e in loss] == pytest.approx([r["loss"] for r in steps])
  assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx(
      [r["eval_loss"] for r in evals])
  assert {"train/grad_norm", "train/lr", "eval/perplexity"} <= set(events.Tags()["scalars"])


@pytest.mark.parametrize("flag, message", [
    ("--config.seq_len=100000", "max_seq_len"),
    ("--config.data=/nonexistent/corpus.txt", "does not exist"),
])
def test_launcher_bad_input_is_a_clear_error(tmp_path, flag, message):
  r = _run(f"--config.workdir={tmp_path}", "--config.steps=2", flag)
  assert r.returncode != 0
  assert message in r.stderr
  assert "Traceback" not in r.stderr


@pytest.mark.parametrize("changes, engine, message", [
    (dict(seq_len=100000), {}, "max_seq_len"),
    (dict(data="/nonexistent/corpus.txt"), {}, "does not exist"),
    (dict(data=""), {}, "No data path"),
    (dict(model="huge"), {}, "Unknown model size"),
    (dict(batch_size=0), {}, "batch_size"),
    (dict(keep=0), {}, "--config.keep must be >= 1"),
    ({}, dict(grad_accum=3), "not divisible by --config.engine.grad_accum=3"),
    ({}, dict(prefetch_depth=-1), "prefetch_depth"),
    ({}, dict(compute_dtype="float16"), "compute_dtype"),
])
def test_bad_train_config_is_a_clear_error(tmp_path, changes, engine, message):
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    tc = train_lib.TrainConfig(workdir=str(tmp_path), steps=2, progress=False,
                               engine=mt.EngineConfig(**engine), **changes)
    train_lib.run(tc)


@pytest.mark.parametrize("fmt, pack, packed", [("sharegpt", None, True),
                                               ("sharegpt", False, False),
                                               ("jsonl", None, False), ("jsonl", True, True)])
def test_pack_defaults_on_for_instruction_data(tmp_path, fmt, pack, packed):
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps({"conversations": [
      {"from": "human", "value": "q"}, {"from": "gpt", "value": "a" * i}]}
      if fmt == "sharegpt" else {"text": "doc " * i}) + "\n" for i in range(1, 25)))
  tc = train_lib.TrainConfig(data=str(path), data_format=fmt, pack=pack, batch_size=2,
                             seq_len=100, attention_block=16)
  cfg = tc.model_config()
  assert cfg.attention_block == 16 and cfg.mlp_chunk is None
  batch = train_lib.make_datasets(tc, cfg)[0].next_batch()
  assert ("segment_ids" in batch) == packed
  if packed:
    assert batch["segment_ids"].max() > 1  # several documents in a row


def test_the_bundled_chat_sample_packs_to_over_90_percent(tmp_path, caplog):
  caplog.set_level("INFO")
  records = train_lib.run(train_lib.TrainConfig(
      workdir=str(tmp_path), data="chat_sample", data_format="sharegpt", seq_len=511,
      batch_size=2, steps=1, save_every=0, progress=False, attention_block=128))
  assert records[0]["data_non_padding"] >= 0.9
  assert f"packed to {100 * records[0]['data_non_padding']:.1f}% non-padding" in caplog.text


def test_config_validation_in_library():
  with pytest.raises(ValueError, match="trainer"):
    train_lib.TrainConfig(trainer="gpu-magic").validate()


def test_held_out_documents_are_left_out_of_training():
  docs = [f"document {i}" for i in range(40)]
  train, held = train_lib.split_held_out(docs, 0.1, seed=3)
  assert len(held) == 4 and sorted(train + held) == sorted(docs)
  assert not set(train) & set(held)
  assert train_lib.split_held_out(docs, 0.1, seed=3) == (train, held)  # the seed's
  assert train == [d for d in docs if d not in held]  # order kept
  with pytest.raises(ValueError, match="eval_fraction"):
    train_lib.split_held_out(docs[:1], 0.5, seed=0)


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_streaming_and_resident_runs_agree(tmp_path, model):
  common = dict(steps=4, batch_size=4, seq_len=32, max_data_bytes=200_000, log_every=1,
                progress=False, model=model)
  a = train_lib.run(train_lib.TrainConfig(workdir=str(tmp_path / "s"), trainer="streaming",
                                          **common))
  b = train_lib.run(train_lib.TrainConfig(workdir=str(tmp_path / "r"), trainer="resident",
                                          **common))
  for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-4 * y["loss"]


def test_launcher_input_error_is_the_message_alone(tmp_path):
  not_a_dir = tmp_path / "file.txt"
  not_a_dir.write_text("x")
  r = _run(f"--config.workdir={not_a_dir}", "--config.steps=2")
  assert r.returncode != 0
  assert f"--config.workdir={not_a_dir} is a file" in r.stderr
  assert "Traceback" not in r.stderr
  assert "--config.engine.prefetch_depth" not in r.stderr  # no flag listing for an input error


def test_launcher_flag_misuse_still_shows_the_flags(tmp_path):
  r = _run(f"--config.workdir={tmp_path}", "--config.engine.prefetch_depth=many")
  assert r.returncode != 0 and "prefetch_depth" in r.stderr


def test_logs_go_above_a_progress_bar_and_plain_elsewhere(monkeypatch):
  import tqdm
  from absl import logging

  class Bar:  # what logs_around needs of a tqdm bar: it is shown
    pass

  written = []
  monkeypatch.setattr(tqdm.tqdm, "write",
                      staticmethod(lambda text, file=None: written.append(text)))
  with progress.logs_around(Bar()):
    logging.warning("above the bar")
  assert len(written) == 1 and written[0].endswith("above the bar")
  assert written[0].startswith("W") and "\n" not in written[0]  # absl's format
  import logging as std_logging
  assert not any(type(h).__name__ == "AboveTheBar" for h in std_logging.getLogger().handlers)
  with progress.logs_around(None):  # no bar: nothing changes
    logging.warning("plain")
  assert len(written) == 1
  assert progress.progress_bar(10, 0) is None  # pytest's output is not a terminal
