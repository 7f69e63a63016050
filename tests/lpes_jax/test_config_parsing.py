"""Strict config parsing: config.json and GGUF metadata types, and non-float weight tensors."""

import json
import os
import re
import shutil

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lpes_jax import LlamaConfig, load_pretrained
from lpes_jax.checkpoints import load_gguf
from tests.lpes_jax.conftest import FIXTURES

SOURCE = "/models/tiny/config.json"


def _hf(name="llama_mha_llama3"):
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    return json.load(f)


def _refused(d, message):
  with pytest.raises(ValueError, match=f"^{re.escape(f'{SOURCE}: {message}')}"):
    LlamaConfig.from_hf_dict(d, source=SOURCE)


@pytest.mark.parametrize("name", ["llama_mha_llama3", "llama_gqa_tied_linear", "qwen2_bias"])
def test_fixture_configs_parse_unchanged(name):
  cfg = LlamaConfig.from_hf_dict(_hf(name), source=SOURCE)
  assert cfg.vocab_size == _hf(name)["vocab_size"] and cfg.eos_token_ids
  assert isinstance(cfg.rope_theta, float) and isinstance(cfg.tie_word_embeddings, bool)


@pytest.mark.parametrize("field, value, got", [
    ("tie_word_embeddings", "false", "'false'"),
    ("tie_word_embeddings", 0, "0"),
    ("tie_word_embeddings", None, "null"),
    ("attention_bias", "true", "'true'"),
    ("mlp_bias", "false", "'false'"),
])
def test_booleans_must_be_booleans(field, value, got):
  _refused(dict(_hf(), **{field: value}),
           f"field '{field}' must be a boolean (true or false), got {got}")


def test_string_false_for_tie_is_refused_not_read_as_tied(tmp_path):
  folder = tmp_path / "m"
  shutil.copytree(os.path.join(FIXTURES, "llama_mha_llama3"), folder)
  d = json.loads((folder / "config.json").read_text())
  assert d.get("tie_word_embeddings", False) is False
  (folder / "config.json").write_text(json.dumps(dict(d, tie_word_embeddings="false")))
  path = str(folder / "config.json")
  with pytest.raises(ValueError, match=re.escape(
      f"{path}: field 'tie_word_embeddings' must be a boolean (true or false), got 'false'")):
    load_pretrained(str(folder))


def test_qwen2_use_sliding_window_must_be_boolean():
  _refused(dict(_hf("qwen2_bias"), use_sliding_window="no"),
           "field 'use_sliding_window' must be a boolean (true or false), got 'no'")


def _legacy_rope(d, **rope_scaling):
  """The transformers 4.x layout: rope_theta + rope_scaling at the top level."""
  d = dict(d)
  rp = dict(d.pop("rope_parameters"))
  d["rope_theta"] = rp.pop("rope_theta")
  d["rope_scaling"] = dict(rp, **rope_scaling)
  return d


@pytest.mark.parametrize("make, message", [
    (lambda d: _legacy_rope(d) | {"rope_theta": None},
     "field 'rope_theta' must be a number, got null"),
    (lambda d: _legacy_rope(d) | {"rope_theta": "10000"},
     "field 'rope_theta' must be a number, got '10000'"),
    (lambda d: _legacy_rope(d) | {"rope_theta": True},
     "field 'rope_theta' must be a number, got true"),
    (lambda d: _legacy_rope(d) | {"rope_theta": float("inf")},
     "field 'rope_theta' must be a finite number, got inf"),
    (lambda d: d | {"rope_parameters": d["rope_parameters"] | {"rope_theta": None}},
     "field 'rope_parameters.rope_theta' must be a number, got null"),
    (lambda d: _legacy_rope(d, factor="x"),
     "field 'rope_scaling.factor' must be a number, got 'x'"),
    (lambda d: d | {"rope_parameters": d["rope_parameters"] | {"factor": "x"}},
     "field 'rope_parameters.factor' must be a number, got 'x'"),
    (lambda d: _legacy_rope(d, low_freq_factor=[1]),
     "field 'rope_scaling.low_freq_factor' must be a number, got [1]"),
    (lambda d: _legacy_rope(d, original_max_position_embeddings=8192.0),
     "field 'rope_scaling.original_max_position_embeddings' must be a positive integer, got "
     "8192.0"),
    (lambda d: _legacy_rope(d, rope_type=3), "field 'rope_scaling.rope_type' must be a string"),
    (lambda d: _legacy_rope(d) | {"rope_scaling": "linear"},
     "field 'rope_scaling' must be an object, got 'linear'"),
    (lambda d: d | {"rms_norm_eps": None}, "field 'rms_norm_eps' must be a number, got null"),
    (lambda d: d | {"partial_rotary_factor": "1"},
     "field 'partial_rotary_factor' must be a number, got '1'"),
])
def test_numbers_must_be_numbers(make, message):
  _refused(make(_hf()), message)


def test_rope_scaling_range_errors_name_the_file():
  _refused(_legacy_rope(_hf(), factor=-2.0),
           "rope_scaling: RopeScaling.factor must be > 0, got -2.0")


@pytest.mark.parametrize("field, value, message", [
    ("eos_token_id", "two", "an integer or a list of integers, got 'two'"),
    ("eos_token_id", [1, "2"], "an integer or a list of integers, got [1, '2']"),
    ("eos_token_id", 2.0, "an integer or a list of integers, got 2.0"),
    ("eos_token_id", True, "an integer or a list of integers, got true"),
    ("bos_token_id", "1", "an integer, got '1'"),
    ("pad_token_id", 0.5, "an integer, got 0.5"),
    ("vocab_size", True, "a positive integer, got true"),
    ("num_key_value_heads", 2.0, "a positive integer, got 2.0"),
    ("head_dim", "8", "a positive integer, got '8'"),
    ("max_position_embeddings", -1, "a positive integer, got -1"),
])
def test_integers_must_be_integers(field, value, message):
  _refused(dict(_hf(), **{field: value}), f"field '{field}' must be {message}")


def test_sliding_window_checked_only_where_used():
  mistral = dict(_hf(), model_type="mistral")
  _refused(dict(mistral, sliding_window="4096"),
           "field 'sliding_window' must be a positive integer, got '4096'")
  assert LlamaConfig.from_hf_dict(dict(mistral, sliding_window=None)).sliding_window is None
  assert LlamaConfig.from_hf_dict(dict(mistral, sliding_window=16)).sliding_window == 16
  assert LlamaConfig.from_hf_dict(dict(_hf(), sliding_window="unused")).sliding_window is None


def test_eos_token_id_forms():
  parse = lambda eos: LlamaConfig.from_hf_dict(dict(_hf(), eos_token_id=eos)).eos_token_ids
  assert parse(2) == (2,) and parse([2, 7]) == (2, 7) and parse(None) == ()


def test_strings_and_required_fields():
  _refused(dict(_hf(), model_type=["llama"]), "field 'model_type' must be a string")
  _refused(dict(_hf(), hidden_act=None), "field 'hidden_act' must be a string, got null")
  _refused({k: v for k, v in _hf().items() if k != "hidden_size"},
           "missing required field 'hidden_size'")
  _refused(dict(_hf(), num_hidden_layers=None), "missing required field 'num_hidden_layers' "
                                                "(it is null)")


def test_default_source_is_named():
  with pytest.raises(ValueError, match="^config.json: field 'rope_theta' must be a number"):
    LlamaConfig.from_hf_dict(_legacy_rope(_hf()) | {"rope_theta": None})


# --- GGUF metadata --------------------------------------------------------------------------------

GGUF = "/models/tiny.gguf"


def _meta(**changes):
  meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 256,
          "llama.embedding_length": 64, "llama.feed_forward_length": 128,
          "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
          "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
          "llama.vocab_size": 100, "tokenizer.ggml.bos_token_id": 1,
          "tokenizer.ggml.eos_token_id": 2}
  meta.update(changes)
  return {k: v for k, v in meta.items() if v is not None}


def test_gguf_metadata_parses():
  cfg = LlamaConfig.from_gguf_metadata(_meta(**{"llama.block_count": np.uint32(2)}), tied=True,
                                       source=GGUF)
  assert (cfg.num_layers, cfg.head_dim, cfg.eos_token_ids) == (2, 16, (2,))
  assert type(cfg.num_layers) is int


@pytest.mark.parametrize("key, value, message", [
    ("llama.block_count", "2", "must be a positive integer, got '2'"),
    ("llama.block_count", 2.0, "must be a positive integer, got 2.0"),
    ("llama.attention.head_count_kv", [2, 2], "must be a positive integer, got [2, 2]"),
    ("llama.context_length", True, "must be a positive integer, got true"),
    ("llama.rope.freq_base", "1e4", "must be a number, got '1e4'"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), "must be a finite number, got nan"),
    ("llama.rope.scaling.type", 1, "must be a string, got 1"),
    ("tokenizer.ggml.eos_token_id", "two", "must be an integer, got 'two'"),
    ("llama.embedding_length", None, None),
])
def test_gguf_metadata_types(key, value, message):
  expected = (f"{GGUF}: missing required metadata key '{key}'" if message is None
              else f"{GGUF}: metadata key '{key}' {message}")
  with pytest.raises(ValueError, match=f"^{re.escape(expected)}"):
    LlamaConfig.from_gguf_metadata(_meta(**{key: value}), tied=True, source=GGUF)


def test_gguf_linear_scaling_factor_checked():
  meta = _meta(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": "4"})
  with pytest.raises(ValueError, match=re.escape(
      f"{GGUF}: metadata key 'llama.rope.scaling.factor' must be a number, got '4'")):
    LlamaConfig.from_gguf_metadata(meta, tied=True, source=GGUF)
  meta["llama.rope.scaling.factor"] = -4.0
  with pytest.raises(ValueError, match=f"^{GGUF}: RopeScaling.factor must be > 0"):
    LlamaConfig.from_gguf_metadata(meta, tied=True, source=GGUF)


def test_gguf_file_with_a_string_block_count_names_the_file(tmp_path):
  path = tmp_path / "m.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  for key, value in _meta(**{"general.architecture": None}).items():
    if key == "llama.block_count":
      w.add_string(key, "2")
    elif isinstance(value, float):
      w.add_float32(key, value)
    else:
      w.add_uint32(key, value)
  w.add_tensor("token_embd.weight", np.zeros((100, 64), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match=re.escape(
      f"{path}: metadata key 'llama.block_count' must be a positive integer, got '2'")):
    load_gguf(str(path))


# --- Weight dtypes --------------------------------------------------------------------------------

def _with_tensor(tmp_path, name, fn):
  folder = tmp_path / "m"
  shutil.copytree(os.path.join(FIXTURES, "llama_mha_llama3"), folder)
  tensors = load_file(folder / "model.safetensors")
  tensors[name] = fn(tensors[name])
  save_file(tensors, folder / "model.safetensors")
  return folder


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_])
def test_integer_or_bool_weight_is_refused_naming_tensor_and_file(tmp_path, dtype):
  name = "model.layers.1.mlp.up_proj.weight"
  folder = _with_tensor(tmp_path, name, lambda w: w.astype(dtype))
  with pytest.raises(ValueError, match=re.escape(
      f"{folder / 'model.safetensors'}: tensor '{name}' has dtype {np.dtype(dtype)}; weights "
      f"must be floating point")):
    load_pretrained(str(folder))


def test_float_weights_of_another_precision_are_cast(tmp_path):
  name = "model.layers.0.self_attn.q_proj.weight"
  folder = _with_tensor(tmp_path, name, lambda w: w.astype(np.float16))
  _, params, _ = load_pretrained(str(folder))
  w = load_file(folder / "model.safetensors")[name]
  q = params["layers_0"]["self_attn"]["q_proj"]["kernel"]
  assert q.dtype == np.float32
  np.testing.assert_array_equal(q, w.T.astype(np.float32))
