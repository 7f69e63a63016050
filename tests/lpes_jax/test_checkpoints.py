"""Checkpoint loading: config layouts, tie rules, GGUF permutation, and bad input."""

import json
import os
import shutil

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lpes_jax import LlamaConfig, load_pretrained, load_tokenizer
from lpes_jax.checkpoints import dequantize_gguf_tensor, load_gguf, unpermute_llama_cpp
from lpes_jax.rope_scaling import RopeScaling, llama3_frequencies, rope_inverse_frequencies
from tests.lpes_jax import synthetic
from tests.lpes_jax.conftest import FIXTURES


def _copy(tmp_path, name):
  dst = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), dst)
  return dst


def _edit_config(folder, fn):
  path = folder / "config.json"
  cfg = json.loads(path.read_text())
  fn(cfg)
  path.write_text(json.dumps(cfg))


def test_legacy_rope_scaling_layout_loads_the_same(tmp_path):
  folder = _copy(tmp_path, "llama_mha_llama3")
  new = LlamaConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))

  def to_legacy(cfg):
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp

  _edit_config(folder, to_legacy)
  _, _, old = load_pretrained(str(folder))
  assert old == new and new.rope_scaling.rope_type == "llama3"


def test_llama3_frequencies_hand_checked():
  inv = rope_inverse_frequencies(8, 10000.0)          # wavelengths 2π·[1, 10, 100, 1000]
  s = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)
  out = llama3_frequencies(inv, s)
  # wavelen 6.28 < 16: kept; 62.8 in [16, 64]: smooth a = (64/62.8 − 1)/3; 628, 6283 > 64: ÷8.
  a = (64 / (2 * np.pi / inv[1]) - 1) / 3
  np.testing.assert_allclose(out, [inv[0], (1 - a) * inv[1] / 8 + a * inv[1], inv[2] / 8,
                                   inv[3] / 8], rtol=1e-6)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0}, {"type": "dynamic",
                                                                         "factor": 2.0}])
def test_unsupported_rope_type_is_refused(rope):
  d = json.load(open(os.path.join(FIXTURES, "llama_mha_llama3", "config.json")))
  d["rope_parameters"] = dict(rope, rope_theta=10000.0)
  with pytest.raises(ValueError, match="not supported"):
    LlamaConfig.from_hf_dict(d)


def test_tied_with_extra_lm_head_loads_and_untied_without_head_fails(tmp_path):
  folder = _copy(tmp_path, "llama_gqa_tied_linear")
  tensors = load_file(folder / "model.safetensors")
  tensors["lm_head.weight"] = np.random.default_rng(0).normal(
      size=tensors["model.embed_tokens.weight"].shape).astype(np.float32)
  save_file(tensors, folder / "model.safetensors")
  _, params, cfg = load_pretrained(str(folder))
  assert cfg.tie_word_embeddings and "lm_head" not in params
  _edit_config(folder, lambda c: c.update(tie_word_embeddings=False))
  _, params, _ = load_pretrained(str(folder))
  np.testing.assert_array_equal(params["lm_head"]["kernel"], tensors["lm_head.weight"].T)
  del tensors["lm_head.weight"]
  save_file(tensors, folder / "model.safetensors")
  with pytest.raises(ValueError, match="missing tensors.*lm_head.weight"):
    load_pretrained(str(folder))


def test_bad_hf_folders(tmp_path):
  folder = _copy(tmp_path, "qwen2_bias")
  tensors = load_file(folder / "model.safetensors")
  save_file(dict(tensors, extra=np.zeros(3, np.float32)), folder / "model.safetensors")
  with pytest.raises(ValueError, match="unexpected tensors.*extra"):
    load_pretrained(str(folder))
  bad = dict(tensors)
  bad["model.norm.weight"] = np.zeros(7, np.float32)
  save_file(bad, folder / "model.safetensors")
  with pytest.raises(ValueError, match=r"model.norm.weight.*\(7,\).*\(64,\)"):
    load_pretrained(str(folder))
  (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a")
  with pytest.raises(ValueError, match="not a readable safetensors"):
    load_pretrained(str(folder))
  _edit_config(folder, lambda c: c.update(model_type="gpt_neox"))
  with pytest.raises(ValueError, match="model_type 'gpt_neox'"):
    load_pretrained(str(folder))
  (folder / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_pretrained(str(folder))


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("model_type"), "missing required field 'model_type'"),
    (lambda c: c.update(vocab_size=None), "missing required field 'vocab_size'"),
    (lambda c: c.update(hidden_size="64"),
     "field 'hidden_size' must be a positive integer, got '64'"),
    (lambda c: c.update(num_hidden_layers=4.7),
     "field 'num_hidden_layers' must be a positive integer, got 4.7"),
    (lambda c: c.update(num_attention_heads=5), "num_heads=5"),
])
def test_bad_config_fields_are_named_with_the_file(tmp_path, edit, message):
  folder = _copy(tmp_path, "qwen2_bias")
  _edit_config(folder, edit)
  with pytest.raises(ValueError, match=f"config.json: .*{message}"):
    load_pretrained(str(folder))


def test_a_file_of_a_hf_folder_is_refused_naming_the_folder(tmp_path):
  folder = _copy(tmp_path, "qwen2_bias")
  for name in ("config.json", "model.safetensors"):
    with pytest.raises(ValueError, match="pass the Hugging Face model folder"):
      load_pretrained(str(folder / name))


def test_unreadable_json_names_the_file(tmp_path):
  folder = _copy(tmp_path, "qwen2_bias")
  (folder / "config.json").write_text("{")
  with pytest.raises(ValueError, match="config.json: not valid JSON"):
    load_pretrained(str(folder))
  folder = _copy(tmp_path / "b", "qwen2_bias")
  (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
  with pytest.raises(ValueError, match="index.json: no 'weight_map'"):
    load_pretrained(str(folder))


def test_sharded_index_and_duplicates(tmp_path):
  folder = _copy(tmp_path, "llama_mha_llama3")
  tensors = load_file(folder / "model.safetensors")
  names = sorted(tensors)
  a, b = names[: len(names) // 2], names[len(names) // 2:]
  (folder / "model.safetensors").unlink()
  save_file({n: tensors[n] for n in a}, folder / "model-00001-of-00002.safetensors")
  save_file({n: tensors[n] for n in b}, folder / "model-00002-of-00002.safetensors")
  index = {"weight_map": {**{n: "model-00001-of-00002.safetensors" for n in a},
                          **{n: "model-00002-of-00002.safetensors" for n in b}}}
  (folder / "model.safetensors.index.json").write_text(json.dumps(index))
  _, params, _ = load_pretrained(str(folder))
  ref = load_file(os.path.join(FIXTURES, "llama_mha_llama3", "model.safetensors"))
  np.testing.assert_array_equal(params["layers_1"]["mlp"]["down_proj"]["kernel"],
                                ref["model.layers.1.mlp.down_proj.weight"].T)
  save_file({n: tensors[n] for n in b + a[:1]}, folder / "model-00002-of-00002.safetensors")
  with pytest.raises(ValueError, match="appears in both"):
    load_pretrained(str(folder))


def _llama_cpp_permute(w, n_head):
  """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def _write_gguf(path, folder_name, arch):
  """A GGUF written the way llama.cpp converts the HF fixture (q/k permuted for llama)."""
  folder = os.path.join(FIXTURES, folder_name)
  cfg = LlamaConfig.from_hf_dict(json.load(open(os.path.join(folder, "config.json"))))
  t = load_file(os.path.join(folder, "model.safetensors"))
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.num_layers)
  w.add_context_length(256)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  perm = arch == "llama"
  names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
           "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
           "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
           "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
  w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
  w.add_tensor("output_norm.weight", t["model.norm.weight"])
  w.add_tensor("output.weight", t["lm_head.weight"])
  for i in range(cfg.num_layers):
    for hf, gg in names.items():
      for kind in ("weight", "bias"):
        name = f"model.layers.{i}.{hf}.{kind}"
        if name not in t:
          continue
        x = t[name]
        if perm and gg in ("attn_q", "attn_k"):
          x = _llama_cpp_permute(x, cfg.num_heads if gg == "attn_q" else cfg.num_kv_heads)
        w.add_tensor(f"blk.{i}.{gg}.{kind}", x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("name,arch", [("llama_mha_llama3", "llama"), ("qwen2_bias", "qwen2")])
def test_gguf_permutation_roundtrip(tmp_path, name, arch):
  path = tmp_path / "m.gguf"
  _write_gguf(path, name, arch)
  _, ours, cfg = load_pretrained(str(path))
  _, ref, _ = load_pretrained(os.path.join(FIXTURES, name))
  assert cfg.model_type == arch and cfg.qkv_bias == (arch == "qwen2")
  for key in ("q_proj", "k_proj"):
    np.testing.assert_array_equal(ours["layers_0"]["self_attn"][key]["kernel"],
                                  ref["layers_0"]["self_attn"][key]["kernel"])
  if arch == "qwen2":
    np.testing.assert_array_equal(ours["layers_1"]["self_attn"]["q_proj"]["bias"],
                                  ref["layers_1"]["self_attn"]["q_proj"]["bias"])


def test_gguf_unpermute_uses_kv_heads_for_k():
  k = np.arange(2 * 8 * 3).reshape(16, 3)              # K = 2 heads of H = 8
  assert np.array_equal(unpermute_llama_cpp(_llama_cpp_permute(k, 2), 2), k)
  assert not np.array_equal(unpermute_llama_cpp(_llama_cpp_permute(k, 2), 4), k)


def test_bad_gguf(tmp_path):
  path = tmp_path / "m.gguf"
  _write_gguf(path, "llama_mha_llama3", "llama")
  data = path.read_bytes()
  (tmp_path / "t.gguf").write_bytes(data[: len(data) // 3])
  with pytest.raises(ValueError, match="not a readable GGUF"):
    load_gguf(str(tmp_path / "t.gguf"))

  class FakeTensor:
    name, tensor_type, data = "blk.0.attn_q.weight", gguf.GGMLQuantizationType.IQ2_XXS, None

  with pytest.raises(ValueError, match="blk.0.attn_q.weight.*IQ2_XXS"):
    dequantize_gguf_tensor(FakeTensor())


def test_hf_tokenizer_bos_once(tmp_path, smollm2_tokenizer):
  tok = smollm2_tokenizer
  smollm2_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"add_bos_token": True, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
       "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
  hf = load_tokenizer(str(tmp_path))
  bos = hf.bos_id
  ids = hf.encode("Hello")
  assert ids[0] == bos and ids[1] != bos and ids[1:] == tok.encode("Hello")
  chat = hf.encode_chat([{"role": "user", "content": "Hello"}])
  assert chat == ids                                   # The template's BOS is not doubled.
  assert tok.encode("Hello")[0] != tok.bos_id          # The GGUF says add_bos_token = false.


@pytest.mark.parametrize("qtype, tol", [("F16", 5e-4), ("BF16", 4e-3), ("Q8_0", 6e-3),
                                        ("Q4_0", 0.1), ("Q4_1", 0.06), ("Q5_0", 0.05),
                                        ("Q5_1", 0.03)])
def test_quantised_gguf_loads_close_to_its_float_weights(tmp_path, qtype, tol):
  """Each type gguf-py can write loads, dequantised, within its quantisation error of the float
  weights (same seed), tensor by tensor in our layout."""
  vocab = synthetic.bpe_vocabulary(synthetic.train_byte_level_bpe(300), "qwen2")
  synthetic.write_gguf(tmp_path / "f.gguf", "llama", vocab)
  synthetic.write_gguf(tmp_path / "q.gguf", "llama", vocab, qtype=qtype)
  _, ref, _ = load_pretrained(str(tmp_path / "f.gguf"))
  _, ours, _ = load_pretrained(str(tmp_path / "q.gguf"))
  flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref))
  for path, x in jax.tree_util.tree_leaves_with_path(ours):
    np.testing.assert_allclose(x, flat_ref[path], atol=tol, err_msg=jax.tree_util.keystr(path))


def test_llama_gguf_with_attention_biases_loads_them(tmp_path):
  path = tmp_path / "m.gguf"
  synthetic.write_gguf(path, "llama", synthetic.bpe_vocabulary(synthetic.train_byte_level_bpe(300), "llama-bpe"), biases=True)
  _, params, cfg = load_pretrained(str(path))
  assert cfg.qkv_bias and cfg.o_bias
  stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
  attn = params["layers_1"]["self_attn"]
  np.testing.assert_array_equal(attn["q_proj"]["bias"],
                                unpermute_llama_cpp(stored["blk.1.attn_q.bias"], 4))
  np.testing.assert_array_equal(attn["k_proj"]["bias"],
                                unpermute_llama_cpp(stored["blk.1.attn_k.bias"], 2))
  np.testing.assert_array_equal(attn["v_proj"]["bias"], stored["blk.1.attn_v.bias"])
  np.testing.assert_array_equal(attn["o_proj"]["bias"], stored["blk.1.attn_output.bias"])


def test_unknown_architecture_and_tensor_are_named(tmp_path):
  vocab = synthetic.bpe_vocabulary(synthetic.train_byte_level_bpe(300), "qwen2")
  synthetic.write_gguf(tmp_path / "a.gguf", "phi3", vocab)
  with pytest.raises(ValueError, match="general.architecture 'phi3' is not supported"):
    load_pretrained(str(tmp_path / "a.gguf"))
  synthetic.write_gguf(tmp_path / "b.gguf", "llama", vocab, biases=True)
  data = (tmp_path / "b.gguf").read_bytes()
  (tmp_path / "c.gguf").write_bytes(data.replace(b"blk.0.attn_v.bias", b"blk.0.attn_x.bias"))
  with pytest.raises(ValueError, match=r"q/k/v biases must come together.*attn_v.bias"):
    load_pretrained(str(tmp_path / "c.gguf"))
  (tmp_path / "d.gguf").write_bytes(data.replace(b"blk.1.attn_v.bias", b"blk.1.attn_x.bias"))
  with pytest.raises(ValueError, match=r"missing tensors \['blk.1.attn_v.bias'\]"):
    load_pretrained(str(tmp_path / "d.gguf"))
