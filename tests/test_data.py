import json

import numpy as np
import pytest

from megatrain_jax import data as data_lib


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
