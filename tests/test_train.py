import json
import os
import subprocess
import sys

import pytest

from megatrain_jax import train as train_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "experiments", "train.py")


def _run(*args):
  return subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True,
                        timeout=300, cwd=REPO)


def test_launcher_writes_metrics_and_plot(tmp_path):
  r = _run(f"--workdir={tmp_path}", "--steps=6", "--log_every=2", "--batch_size=4",
           "--seq_len=32", "--max_data_bytes=200000")
  assert r.returncode == 0, r.stderr[-3000:]
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records] == [1, 2, 4, 6]
  for rec in records:
    assert rec["loss"] > 0 and rec["tokens_per_s"] > 0
  assert (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.parametrize("flag, message", [
    ("--seq_len=100000", "max_seq_len"),
    ("--data=/nonexistent/corpus.txt", "does not exist"),
    ("--data=", "No data path"),
    ("--model=huge", "Unknown model size"),
    ("--batch_size=0", "batch_size"),
])
def test_launcher_bad_input_is_a_clear_error(tmp_path, flag, message):
  r = _run(f"--workdir={tmp_path}", "--steps=2", flag)
  assert r.returncode != 0
  assert message in r.stderr
  assert "Traceback" not in r.stderr


def test_config_validation_in_library():
  with pytest.raises(ValueError, match="engine"):
    train_lib.TrainConfig(engine="gpu-magic").validate()
