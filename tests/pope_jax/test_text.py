"""Shakespeare corpus cleaning and split, tokenisers, uint16 token files and the window source."""

import pickle

import numpy as np
import pytest

from pope_jax.data import text

GUTENBERG = """The Project Gutenberg EBook of Hamlet, by William Shakespeare\r
\r
This eBook is for the use of anyone anywhere at no cost.\r
\r
*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r
\r
HAMLET\r
To be, or not to be.\r
\r
*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r
\r
Updated editions will replace the previous one.\r
"""


def test_strip_gutenberg():
  assert text.strip_gutenberg(GUTENBERG) == "HAMLET\nTo be, or not to be.\n"
  old = "Licence blah\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\nBody\n" \
        "End of the Project Gutenberg etext\nmore"
  assert text.strip_gutenberg(old) == "Body\n"
  assert text.strip_gutenberg("  plain text\n\n") == "plain text\n"


@pytest.fixture
def texts_dir(tmp_path):
  d = tmp_path / "texts"
  d.mkdir()
  (d / "hamlet_gut.txt").write_text(GUTENBERG)
  (d / "hamlet_gut_f.txt").write_text("Folio Hamlet\n")
  (d / "macbeth_gut.txt").write_text("MACBETH\nWhen shall we three meet again\n" * 20)
  (d / "sonnets_gut.txt").write_text("Shall I compare thee to a summer's day?\n" * 20)
  return d


def test_load_and_split(texts_dir):
  works = text.load_shakespeare(texts_dir)
  assert list(works) == ["hamlet", "macbeth", "sonnets"]
  assert works["hamlet"] == "HAMLET\nTo be, or not to be.\n"
  assert list(text.load_shakespeare(texts_dir, edition="folio")) == ["hamlet"]
  assert text.split_works(works) == {"train": ["macbeth", "sonnets"], "valid": ["hamlet"]}
  with pytest.raises(ValueError, match="validation work"):
    text.split_works(["macbeth"])
  with pytest.raises(ValueError, match="edition"):
    text.load_shakespeare(texts_dir, edition="quarto")


def test_package_corpus_is_clean_and_split_by_play():
  works = text.load_shakespeare()
  assert len(works) >= 38 and "hamlet" in works and "sonnets" in works
  assert not any("gutenberg" in t.lower() for t in works.values())
  split = text.split_works(works)
  assert sorted(split["valid"]) == sorted(text.VALID_WORKS)
  valid_chars = sum(len(works[n]) for n in split["valid"])
  assert 0.05 < valid_chars / sum(map(len, works.values())) < 0.15


@pytest.mark.parametrize("tokenizer", ["bpe", "char"])
def test_prepare_roundtrip(tmp_path, texts_dir, tokenizer):
  meta = text.prepare_shakespeare(tmp_path / "out", tokenizer=tokenizer, vocab_size=300,
                                  texts_dir=texts_dir)
  assert meta["split"]["valid"] == ["hamlet"] and meta["dtype"] == "uint16"
  tok = text.load_tokenizer(tmp_path / "out")
  ids = np.fromfile(tmp_path / "out" / "valid.bin", dtype="<u2")
  assert len(ids) == meta["num_tokens"]["valid"]
  decoded = tok.decode(ids.tolist())
  assert decoded.startswith("HAMLET\nTo be, or not to be.\n")
  if tokenizer == "bpe":
    assert meta["vocab_size"] <= 300 and ids[-1] == tok.token_to_id(text.EOT)
    assert len(ids) < len("HAMLET\nTo be, or not to be.\n")     # merges were learned
    assert text.document_start_id(tmp_path / "out") == tok.token_to_id(text.EOT)
  else:
    with pytest.raises(ValueError, match="no token separates the documents"):
      text.document_start_id(tmp_path / "out")
  # Same settings: reused, not rebuilt.
  mtime = (tmp_path / "out" / "train.bin").stat().st_mtime_ns
  assert text.prepare_shakespeare(tmp_path / "out", tokenizer=tokenizer, vocab_size=300,
                                  texts_dir=texts_dir) == meta
  assert (tmp_path / "out" / "train.bin").stat().st_mtime_ns == mtime


def test_window_source(tmp_path):
  path = tmp_path / "train.bin"
  text.write_tokens(path, np.arange(20), vocab_size=50000)
  src = text.TokenWindowSource(path, seq_len=6)
  assert len(src) == 3                                    # windows at 0, 6, 12 (13 + 6 < 20)
  rec = src[1]
  np.testing.assert_array_equal(rec["inputs"], np.arange(6, 12))
  np.testing.assert_array_equal(rec["targets"], np.arange(7, 13))
  assert rec["inputs"].dtype == np.int32 and rec["weights"].tolist() == [1.0] * 6
  over = text.TokenWindowSource(path, seq_len=6, stride=2)
  assert len(over) == 7 and over[6]["targets"][-1] == 18      # tokens 12..18
  clone = pickle.loads(pickle.dumps(over))
  np.testing.assert_array_equal(clone[3]["inputs"], over[3]["inputs"])
  with pytest.raises(IndexError):
    src[3]
  with pytest.raises(ValueError, match="fewer than"):
    text.TokenWindowSource(path, seq_len=20)
  with pytest.raises(ValueError, match="vocab_size"):
    text.TokenWindowSource(path, seq_len=6, vocab_size=10)


def test_bad_token_files(tmp_path):
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"\x01\x00\x02")
  with pytest.raises(ValueError, match="odd.bin.*not a multiple"):
    text.TokenWindowSource(odd, seq_len=1)
  with pytest.raises(ValueError, match="does not fit"):
    text.write_tokens(tmp_path / "x.bin", [1, 2], vocab_size=70000)
  with pytest.raises(ValueError, match=r"\[0, 10\)"):
    text.write_tokens(tmp_path / "x.bin", [1, 12], vocab_size=10)
  with pytest.raises(ValueError, match="65536"):
    text.train_bpe(["abc"], vocab_size=70000)
  # uint32 files work for larger vocabularies.
  text.write_tokens(tmp_path / "big.bin", [69999, 1, 2], vocab_size=70000, dtype="uint32")
  src = text.TokenWindowSource(tmp_path / "big.bin", seq_len=2, dtype="uint32")
  assert src[0]["inputs"].tolist() == [69999, 1]


def test_token_sources_nanogpt_layout(tmp_path):
  text.write_tokens(tmp_path / "train.bin", np.arange(100) % 7, vocab_size=50257)
  text.write_tokens(tmp_path / "val.bin", np.arange(40) % 7, vocab_size=50257)
  srcs = text.token_sources(tmp_path, 8, train_stride=4,
                            splits={"train": "train.bin", "valid": "val.bin"})
  assert len(srcs["train"]) == 23 and len(srcs["valid"]) == 4


def test_packed_windows_keep_documents_apart(tmp_path):
  # Three documents closed by EOT = 0: [5 6 7 0] [8 9 0] [3 4 5 6 0].
  docs = [[5, 6, 7], [8, 9], [3, 4, 5, 6]]
  stream = [t for d in docs for t in d + [0]]
  text.write_tokens(tmp_path / "train.bin", stream, vocab_size=10)
  src = text.TokenWindowSource(tmp_path / "train.bin", seq_len=5, stride=2, document_start=0)
  rec = src[1]                                           # inputs 7 0 8 9 0, targets 0 8 9 0 3
  assert rec["inputs"].tolist() == [7, 0, 8, 9, 0]
  assert rec["segment_ids"].tolist() == [0, 1, 1, 1, 2]
  assert rec["positions"].tolist() == [0, 0, 1, 2, 0]
  assert "segment_ids" not in text.TokenWindowSource(tmp_path / "train.bin", seq_len=5)[1]
  (tmp_path / "meta.json").write_text('{"eot_id": 0}')
  srcs = text.token_sources(tmp_path, 5, splits={"train": "train.bin"},
                            document_start=text.document_start_id(tmp_path))
  assert srcs["train"][0]["segment_ids"].tolist() == [0, 0, 0, 1, 1]     # inputs 5 6 7 0 8
