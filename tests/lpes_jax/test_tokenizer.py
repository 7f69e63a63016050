"""Tokenizers of GGUF files and Hugging Face folders against the reference tools' ids.

SentencePiece vocabularies (GGUF `model = "llama"`, HF `tokenizer.model`) are checked against
`sentencepiece` itself on a model trained here; the Qwen2 byte-level BPE GGUF against the
`tokenizers` tokenizer.json it was exported from (what transformers runs for Qwen2).
"""

import json
import random
import re

import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from lpes_jax import load_pretrained, load_tokenizer
from lpes_jax.tokenizer import llama_cpp_defaults
from tests.lpes_jax import synthetic

TEXTS = {
    "digits": "The year 2024 had 365 days, 8760 hours.",
    "accents": "café naïve Zürich élève façade",
    "non-ASCII": "привет мир, straße über année",
    "leading spaces": "  two leading spaces",
    "double spaces": "double  spaces   and three",
    "trailing spaces": "trailing spaces  ",
    "newlines": "line one\nline two\n\n\nafter blank lines\n",
    "unknown bytes": "emoji 🙂, CJK 東京, a NUL \x00 and Ω",
    "special tokens": "<s>first</s> and <|sep|>second",
    "user-defined": "call <tool> now<tool>",
    "only a space": " ",
    "empty": "",
}


@pytest.fixture(scope="module")
def spm_model():
  return synthetic.train_sentencepiece()


@pytest.fixture(scope="module")
def spm_processor(spm_model):
  return spm.SentencePieceProcessor(model_proto=spm_model)


def _llama_cpp_reference(sp, text, *, continued=None):
  """llama.cpp's SentencePiece ids (`llama_vocab::impl::tokenize`, parse_special): control and
  user-defined tokens split out whole, each piece of text between them encoded by
  `sentencepiece` (whose "▁" prefix is llama.cpp's "prefix with space if previous is special").
  With `continued`, pieces after the first special token are encoded by that processor instead
  (no prefix: transformers' legacy=False)."""
  specials = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
              if sp.is_control(i) or sp.id_to_piece(i) == synthetic.SPM_USER_DEFINED]
  ids, start = [], True
  for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
    if part in specials:
      ids.append(sp.piece_to_id(part))
    elif part:
      ids += (sp if start or continued is None else continued).encode(part)
    start = False
  return ids


def _with_bos(ids, bos):
  """BOS once: a text that starts with the BOS token keeps just that one."""
  return ids if ids[:1] == [bos] else [bos] + ids


@pytest.fixture(scope="module")
def llama2_gguf(tmp_path_factory, spm_model):
  path = tmp_path_factory.mktemp("llama2") / "llama2.gguf"
  synthetic.write_gguf(path, "llama", synthetic.sentencepiece_vocabulary(spm_model))
  return path


@pytest.mark.parametrize("name", TEXTS)
def test_sentencepiece_gguf_gives_llama_cpp_ids(llama2_gguf, spm_processor, name):
  tok = load_tokenizer(str(llama2_gguf))
  text = TEXTS[name]
  assert tok.add_bos and tok.bos_id == 1 and tok.eos_ids == (2,)   # No add-BOS key: SPM adds.
  reference = _llama_cpp_reference(spm_processor, text)
  assert tok.encode(text) == _with_bos(reference, 1)
  assert tok.encode(text, add_bos=False) == reference
  if "<" not in text:
    assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_gguf_on_random_strings(llama2_gguf, spm_processor):
  """Random mixes of words, spaces, newlines, tabs, digits, punctuation, accents, bytes."""
  tok = load_tokenizer(str(llama2_gguf))
  rng = random.Random(0)
  alphabet = list("abcdefghij  \n\t0123456789.,'éüßΩ東🙂") + list(synthetic.WORDS) + [
      synthetic.SPM_CONTROL, synthetic.SPM_USER_DEFINED, "</s>"]
  for _ in range(500):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
    assert tok.encode(text, add_bos=False) == _llama_cpp_reference(spm_processor, text), text


def test_sentencepiece_without_space_prefix(tmp_path, spm_processor, spm_model):
  """`tokenizer.ggml.add_space_prefix = false`: no "▁" before the text (SentencePiece without
  add_dummy_prefix)."""
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(spm_model)
  proto.normalizer_spec.add_dummy_prefix = False
  reference = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
  path = tmp_path / "m.gguf"
  synthetic.write_gguf(path, "llama", synthetic.sentencepiece_vocabulary(spm_model),
                       keys={"add_space_prefix": False})
  tok = load_tokenizer(str(path))
  for text in ("Hello world 42", " leading", "a\nb"):
    assert tok.encode(text, add_bos=False) == reference.encode(text)


@pytest.mark.parametrize("legacy", [None, False])
def test_hf_folder_with_only_tokenizer_model(tmp_path, spm_model, spm_processor, legacy):
  (tmp_path / "tokenizer.model").write_bytes(spm_model)
  if legacy is not None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"legacy": legacy}))
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(spm_model)
  proto.normalizer_spec.add_dummy_prefix = False
  continued = None if legacy is None else spm.SentencePieceProcessor(
      model_proto=proto.SerializeToString())
  tok = load_tokenizer(str(tmp_path))
  assert (tok.add_bos, tok.bos_id, tok.eos_ids, tok.bos_token) == (True, 1, (2,), "<s>")
  for text in TEXTS.values():
    reference = _llama_cpp_reference(spm_processor, text, continued=continued)
    assert tok.encode(text) == _with_bos(reference, 1), text


def test_hf_tokenizer_model_follows_tokenizer_config(tmp_path, spm_model):
  (tmp_path / "tokenizer.model").write_bytes(spm_model)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"add_bos_token": False, "bos_token": "<s>", "eos_token": {"content": "<|sep|>"}}))
  tok = load_tokenizer(str(tmp_path))
  assert not tok.add_bos and tok.eos_ids == (3,) and tok.encode("hi")[0] != 1


def test_hf_special_token_outside_the_vocabulary_is_named(tmp_path, spm_model):
  (tmp_path / "tokenizer.model").write_bytes(spm_model)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
  with pytest.raises(ValueError, match=re.escape("tokenizer_config.json: eos_token '<|eot_id|>'")):
    load_tokenizer(str(tmp_path))


def test_unsupported_sentencepiece_models_are_named(tmp_path, spm_model):
  unigram = synthetic.train_sentencepiece(330, model_type="unigram")
  (tmp_path / "tokenizer.model").write_bytes(unigram)
  with pytest.raises(ValueError, match="tokenizer.model: SentencePiece model_type UNIGRAM"):
    load_tokenizer(str(tmp_path))
  (tmp_path / "tokenizer.model").write_bytes(b"not a protobuf")
  with pytest.raises(ValueError, match="tokenizer.model: not a SentencePiece model"):
    load_tokenizer(str(tmp_path))
  (tmp_path / "tokenizer.model").unlink()
  with pytest.raises(FileNotFoundError, match="tokenizer.json.*tokenizer.model"):
    load_tokenizer(str(tmp_path))


@pytest.fixture(scope="module")
def qwen2():
  """(reference tokenizer, GGUF path) of a Qwen2-style byte-level BPE."""
  return synthetic.train_byte_level_bpe()


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory, qwen2):
  path = tmp_path_factory.mktemp("qwen2") / "qwen2.gguf"
  vocab = synthetic.bpe_vocabulary(qwen2, "qwen2")
  synthetic.write_gguf(path, "qwen2", dict(vocab, eos=vocab["tokens"].index("<|im_end|>")))
  return path


@pytest.mark.parametrize("name", TEXTS)
def test_qwen2_gguf_gives_the_tokenizer_json_ids(qwen2_gguf, qwen2, name):
  tok = load_tokenizer(str(qwen2_gguf))
  text = TEXTS[name].replace("<s>", "<|im_start|>").replace("</s>", "<|im_end|>")
  assert not tok.add_bos                                      # qwen2 pre-tokeniser: no BOS.
  assert tok.encode(text) == qwen2.encode(text).ids
  assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("pre", ["llama-bpe", "llama3"])
def test_llama3_gguf_gives_the_tokenizer_json_ids_after_bos(tmp_path, pre):
  reference = synthetic.train_byte_level_bpe(pattern=synthetic.LLAMA3_PATTERN)
  vocab = synthetic.bpe_vocabulary(reference, pre)
  synthetic.write_gguf(tmp_path / "m.gguf", "llama", dict(vocab, bos=1))
  tok = load_tokenizer(str(tmp_path / "m.gguf"))
  for text in TEXTS.values():
    text = text.replace("<s>", "<|im_start|>").replace("</s>", "<|im_end|>")
    assert tok.encode(text) == _with_bos(reference.encode(text).ids, 1), text
  assert tok.encode("12345 'LL") == [1] + reference.encode("12345 'LL").ids


def test_qwen2_gguf_on_random_strings(qwen2_gguf, qwen2):
  tok = load_tokenizer(str(qwen2_gguf))
  rng = random.Random(1)
  alphabet = list("abcdefghij  \n\r\t0123456789.,'éüßΩ東🙂") + list(synthetic.WORDS) + list(
      synthetic.QWEN2_SPECIALS) + ["'s", "'LL", " 12345"]
  for _ in range(500):
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
    assert tok.encode(text) == qwen2.encode(text).ids, text


@pytest.mark.parametrize("model, pre, keys, expected", [
    ("llama", None, {}, (True, 1, 2)),
    ("llama", None, {"add_bos_token": False}, (False, 1, 2)),
    ("llama", None, {"bos_token_id": 3, "eos_token_id": 4}, (True, 3, 4)),
    ("gpt2", None, {}, (False, 11, 11)),
    ("gpt2", "default", {}, (False, 11, 11)),
    ("gpt2", "qwen2", {}, (False, 11, 11)),
    ("gpt2", "smollm", {}, (False, 11, 11)),
    ("gpt2", "gpt-2", {}, (False, 11, 11)),
    ("gpt2", "llama-bpe", {}, (True, 11, 11)),
    ("gpt2", "llama3", {"add_bos_token": False, "bos_token_id": 0}, (False, 0, 11)),
])
def test_bos_and_eos_defaults_follow_llama_cpp(tmp_path, spm_model, qwen2, model, pre, keys,
                                               expected):
  vocab = (dict(synthetic.sentencepiece_vocabulary(spm_model), bos=None, eos=None)
           if model == "llama" else synthetic.bpe_vocabulary(qwen2, pre))
  path = tmp_path / "m.gguf"
  synthetic.write_gguf(path, "llama", vocab, keys=keys)
  tok = load_tokenizer(str(path))
  if "add_bos_token" not in keys:
    assert llama_cpp_defaults(model, pre)[0] == expected[0]
  assert (tok.add_bos, tok.bos_id, tok.eos_ids) == (expected[0], expected[1], (expected[2],))
  ids = tok.encode("Hello")
  assert (ids[0] == expected[1]) == expected[0]


def test_silent_gguf_config_gets_llama_cpp_bos_and_eos(tmp_path, spm_model):
  path = tmp_path / "m.gguf"
  synthetic.write_gguf(path, "llama", dict(synthetic.sentencepiece_vocabulary(spm_model),
                                           bos=None, eos=None))
  _, _, cfg = load_pretrained(str(path))
  assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


@pytest.mark.parametrize("keys, message", [
    ({"tokenizer_model": "bert"}, "tokenizer.ggml.model 'bert' is not supported"),
    ({"tokenizer_pre": "gpt-4o"}, "tokenizer.ggml.pre 'gpt-4o' is not supported"),
    ({"bos_token_id": 999}, "tokenizer.ggml.bos_token_id 999 is outside the vocabulary"),
])
def test_unknown_vocabularies_are_named(tmp_path, qwen2, keys, message):
  vocab = synthetic.bpe_vocabulary(qwen2, None)
  if "tokenizer_model" in keys:
    vocab["model"] = keys.pop("tokenizer_model")
  if "tokenizer_pre" in keys:
    vocab["pre"] = keys.pop("tokenizer_pre")
  path = tmp_path / "m.gguf"
  synthetic.write_gguf(path, "qwen2", vocab, keys=keys)
  with pytest.raises(ValueError, match=re.escape(message)):
    load_tokenizer(str(path))
