import json

import numpy as np
import pytest

import megatrain_jax as mt
from megatrain_jax import data as data_lib
from megatrain_jax.data import instruct


@pytest.mark.parametrize("text", ["", "hello", "naïve café ∑ 日本語 🤖🚀", "\x00\n\t\U0010FFFF",
                                  "".join(chr(c) for c in range(0x20, 0x800, 7))])
def test_tokenizer_round_trip(text):
  tok = data_lib.ByteTokenizer()
  ids = tok.encode(text, add_bos=True, add_eos=True)
  assert ids[0] == tok.BOS and ids[-1] == tok.EOS
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text


def test_tokenizer_round_trip_random_unicode():
  rng = np.random.default_rng(0)
  tok = data_lib.ByteTokenizer()
  for _ in range(50):
    cps = rng.integers(1, 0x10FFFF, 40)
    text = "".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF)
    assert tok.decode(tok.encode(text)) == text


def test_pack_windows_overlap_by_one_token():
  w = data_lib.pack(["abcdefgh", "ijklmnop"], seq_len=4)
  assert w.shape[1] == 5
  np.testing.assert_array_equal(w[0, -1], w[1, 0])
  assert list(w[0]) == list(b"abcde")


def test_shuffle_deterministic_for_seed(stdlib_windows):
  def first_batches(seed):
    ds = data_lib.PackedDataset(stdlib_windows, 4, seed)
    return [ds.next_batch()["input_ids"] for _ in range(3)]
  a, b, c = first_batches(1), first_batches(1), first_batches(2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert any(not np.array_equal(x, y) for x, y in zip(a, c))


def test_batches_format_and_labels_shifted(stdlib_windows):
  batch = data_lib.PackedDataset(stdlib_windows, 3, 0).next_batch()
  assert batch["input_ids"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
  assert batch["input_ids"].shape == batch["labels"].shape == (3, 64)
  np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def test_epoch_covers_every_window_once():
  windows = np.arange(10 * 3).reshape(10, 3).astype(np.int32)
  ds = data_lib.PackedDataset(windows, 2, 0)
  seen = np.concatenate([ds.next_batch()["input_ids"][:, 0] for _ in range(5)])
  assert sorted(seen) == list(windows[:, 0])
  assert ds.position.epoch == 0 and ds.position.index == 5
  ds.next_batch()
  assert ds.position.epoch == 1


def test_stdlib_corpus_is_present():
  files = data_lib.stdlib_files()
  assert len(files) > 100 and all(f.endswith(".py") for f in files)


def test_jsonl_and_text(tmp_path):
  (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" +
                                    json.dumps({"text": "two"}) + "\n")
  (tmp_path / "b.txt").write_text("three")
  docs = data_lib.read_documents([str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")])
  assert docs == ["one", "two", "three"]
  assert data_lib.read_documents(str(tmp_path)) == ["one", "two", "three"]


def test_malformed_jsonl_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:2"):
    data_lib.read_documents(str(path))
  path.write_text(json.dumps({"txt": "x"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1.*text"):
    data_lib.read_documents(str(path))


@pytest.mark.parametrize("paths", ["", [], ",", [""]])
def test_empty_data_path(paths):
  with pytest.raises(ValueError, match="No data path"):
    data_lib.read_documents(paths)


def test_missing_data_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data_lib.read_documents(str(tmp_path / "nope.txt"))


def test_too_little_data():
  with pytest.raises(ValueError, match="fewer than one sequence"):
    data_lib.pack(["ab"], seq_len=16)
  with pytest.raises(ValueError, match="fewer than one batch"):
    data_lib.PackedDataset(np.zeros((3, 5), np.int32), 4, 0)


# --- Instruction data --------------------------------------------------------

def _write(path, records, jsonl=True):
  with open(path, "w") as f:
    if jsonl:
      f.writelines(json.dumps(r) + "\n" for r in records)
    else:
      json.dump(records, f)
  return str(path)


def _trained_text(tok, ids, mask):
  return tok.decode([i for i, m in zip(ids, mask) if m])


def test_alpaca_trains_on_the_output_only(tmp_path):
  path = _write(tmp_path / "a.json", [
      {"instruction": "Add.", "input": "2+2", "output": "4", "system": "Be terse."},
      {"instruction": "Say hi.", "output": "hi"}], jsonl=False)
  convs = instruct.read_conversations(path, "alpaca")
  assert convs[0] == [{"role": "system", "content": "Be terse."},
                      {"role": "user", "content": "Add.\n\n2+2"},
                      {"role": "assistant", "content": "4"}]
  tok = mt.data.ByteTokenizer()
  ids, mask = instruct.encode_conversation(tok, convs[0])
  assert tok.decode(ids) == "<|system|>\nBe terse.\n<|user|>\nAdd.\n\n2+2\n<|assistant|>\n4\n"
  assert _trained_text(tok, ids, mask) == "4\n" and ids[-1] == tok.EOS and mask[-1] == 1.0


@pytest.mark.parametrize("record", [
    {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                       {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
    {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]},
], ids=["from_value", "role_content"])
def test_sharegpt_trains_on_every_assistant_turn(tmp_path, record):
  path = _write(tmp_path / "s.jsonl", [record])
  conv, = instruct.read_conversations(path, "sharegpt")
  tok = mt.data.ByteTokenizer()
  ids, mask = instruct.encode_conversation(tok, conv)
  assert _trained_text(tok, ids, mask) == "a1\na2\n"
  assert sum(1 for i, m in zip(ids, mask) if m and i == tok.EOS) == 2


def test_sequences_shift_the_mask_onto_labels_and_pad(tmp_path):
  tok = mt.data.ByteTokenizer()
  conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]
  windows, mask = instruct.build_sequences([conv], tok, seq_len=40)
  ds = mt.data.PackedDataset(windows, 1, seed=0, mask_NxT1=mask)
  b = ds.next_batch()
  labels = b["labels"][0][b["loss_mask"][0] > 0]
  assert tok.decode(labels) == "ok\n" and labels[-1] == tok.EOS
  assert (b["input_ids"][0][-3:] == tok.PAD).all()


@pytest.mark.parametrize("overlong, rows, message", [("truncate", 2, "1 truncated"),
                                                     ("drop", 1, "1 dropped")])
def test_overlong_records_are_counted(overlong, rows, message, caplog):
  tok = mt.data.ByteTokenizer()
  short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
  long = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 100}]
  windows, _ = instruct.build_sequences([short, long], tok, seq_len=32, overlong=overlong)
  assert len(windows) == rows
  assert message in caplog.text


@pytest.mark.parametrize("fmt, content, where", [
    ("alpaca", '{"instruction": "x", "output": "y"}\n{"instruction": 3, "output": "y"}\n',
     "a.jsonl:2: field 'instruction' must be a string"),
    ("alpaca", '[{"instruction": "x", "output": "y"}, {"output": "y"}]',
     "a.jsonl: record 1: field 'instruction' must be a string"),
    ("sharegpt", '{"conversations": [{"from": "robot", "value": "x"}]}\n',
     "a.jsonl:1: turn 0 needs 'from'"),
    ("sharegpt", '{"conversations": []}\n{"text": "x"}\n', "a.jsonl:1: the conversation has no"),
    ("sharegpt", '{"messages": [{"role": "user", "content": "x"}]\n', "a.jsonl:1: not valid JSON"),
])
def test_malformed_record_names_file_and_record(tmp_path, fmt, content, where):
  path = tmp_path / "a.jsonl"
  path.write_text(content)
  with pytest.raises(ValueError) as e:
    instruct.read_conversations(str(path), fmt)
  assert where in str(e.value)
