"""Transformer and PositionalAttention: parameters, causality, multipliers, config errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pope_jax import MODEL_PRESETS, ModelConfig, PositionalAttention, Transformer

CFG = ModelConfig(vocab_size=40, num_layers=2, d_model=32, num_heads=4)
TOKENS = jax.random.randint(jax.random.key(0), (2, 9), 0, 40)


def _init(cfg):
  model = Transformer(cfg)
  return model, model.init(jax.random.key(1), TOKENS)["params"]


@pytest.mark.parametrize("encoding", ["rope", "pope", "none"])
def test_forward_shapes_and_causality(encoding):
  model, params = _init(dataclasses.replace(CFG, pos_encoding=encoding))
  logits = model.apply({"params": params}, TOKENS)
  assert logits.shape == (2, 9, 40) and logits.dtype == jnp.float32
  changed = model.apply({"params": params}, TOKENS.at[:, 6].set((TOKENS[:, 6] + 1) % 40))
  np.testing.assert_allclose(logits[:, :6], changed[:, :6], atol=1e-5)
  assert not np.allclose(logits[:, 6:], changed[:, 6:])


def test_pope_has_one_delta_per_layer_and_tied_or_untied_head():
  _, params = _init(CFG)
  for i in range(2):
    delta = params[f"block_{i}"]["attn"]["delta"]
    assert delta.shape == (4, 8) and float(delta.max()) <= 0 and float(delta.min()) >= -2 * np.pi
  assert not np.allclose(params["block_0"]["attn"]["delta"], params["block_1"]["attn"]["delta"])
  assert "head" not in params
  _, untied = _init(dataclasses.replace(CFG, tie_embeddings=False))
  assert untied["head"]["kernel"].shape == (32, 40)
  _, zeros = _init(dataclasses.replace(CFG, delta_init="zeros"))
  assert not np.any(zeros["block_0"]["attn"]["delta"])
  _, rope = _init(dataclasses.replace(CFG, pos_encoding="rope"))
  assert "delta" not in rope["block_0"]["attn"]


@pytest.mark.parametrize("encoding", ["rope", "pope"])
def test_rope_multipliers_shapes_and_vmap(encoding):
  model, params = _init(dataclasses.replace(CFG, pos_encoding=encoding))
  apply = lambda m: model.apply({"params": params}, TOKENS, rope_multipliers=m)
  base = apply(None)
  for ones in (1.0, jnp.ones(2), jnp.ones((2, 4))):
    np.testing.assert_allclose(apply(ones), base, atol=1e-5)
  per_layer = jnp.array([[1.0, 0.5], [0.25, 1.0]])          # two candidates, [P, L]
  batched = jax.vmap(apply)(per_layer)
  np.testing.assert_allclose(batched[1], apply(per_layer[1]), atol=1e-5)
  assert not np.allclose(batched[0], base, atol=1e-4)
  with pytest.raises(ValueError, match="rope_multipliers"):
    apply(jnp.ones(3))


def test_gqa_model_and_standalone_attention_layer():
  model, params = _init(dataclasses.replace(CFG, num_kv_heads=2))
  assert params["block_0"]["attn"]["key"]["kernel"].shape == (32, 2, 8)
  assert model.apply({"params": params}, TOKENS).shape == (2, 9, 40)
  layer = PositionalAttention(num_heads=4, num_kv_heads=2, head_dim=8, pos_encoding="pope")
  x = jax.random.normal(jax.random.key(2), (2, 5, 16))
  p = layer.init(jax.random.key(3), x)
  assert layer.apply(p, x, positions=jnp.arange(5) + 100).shape == (2, 5, 16)
  np.testing.assert_allclose(layer.apply(p, x, positions=jnp.arange(5) + 100),
                             layer.apply(p, x), atol=1e-5)  # relative positions only


def test_presets():
  assert (MODEL_PRESETS["indirect_indexing"].num_layers, MODEL_PRESETS["indirect_indexing"].d_model,
          MODEL_PRESETS["indirect_indexing"].num_heads) == (8, 512, 8)
  jsb = MODEL_PRESETS["jsb"]
  assert (jsb.num_layers, jsb.d_model, jsb.num_heads, jsb.dropout_rate) == (6, 256, 8, 0.2)
  for name, (layers, width, heads) in {"gpt2_124m": (12, 768, 12), "gpt2_253m": (16, 1024, 16),
                                       "gpt2_774m": (36, 1280, 20)}.items():
    cfg = MODEL_PRESETS[name]
    assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.head_size) == (layers, width, heads,
                                                                           64)
    assert cfg.delta_init == "zeros"


def test_gpt2_initialisation_scales_residual_projections():
  cfg = dataclasses.replace(CFG, d_model=256, num_heads=4, num_layers=8, init_std=0.02)
  _, params = _init(cfg)
  block = params["block_3"]
  std = lambda x: float(jnp.std(x))
  np.testing.assert_allclose(std(params["embed"]["embedding"]), 0.02, rtol=0.1)
  np.testing.assert_allclose(std(block["attn"]["query"]["kernel"]), 0.02, rtol=0.1)
  np.testing.assert_allclose(std(block["mlp_in"]["kernel"]), 0.02, rtol=0.1)
  for residual in (block["attn"]["out"]["kernel"], block["mlp_out"]["kernel"]):
    np.testing.assert_allclose(std(residual), 0.02 / 4.0, rtol=0.1)   # 0.02 / sqrt(2 L)
  # None keeps Flax's LeCun normal: std 1/sqrt(fan_in).
  _, flax_params = _init(dataclasses.replace(cfg, init_std=None))
  np.testing.assert_allclose(std(flax_params["block_3"]["mlp_out"]["kernel"]), 1 / 32.0, rtol=0.1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pos_encoding="alibi"), "pos_encoding"),
    (dict(pos_encoding="rope", head_dim=7), "head_dim"),
    (dict(d_model=30), "d_model"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(delta_init="normal"), "delta_init"),
    (dict(dtype="float16"), "dtype"),
    (dict(num_layers=0), "num_layers"),
    (dict(head_dim=0), "head_dim"),
    (dict(mlp_dim=-4), "mlp_dim"),
    (dict(num_layers=2.5), "num_layers"),
    (dict(pope_base=-5.0), "pope_base"),
    (dict(attention_implementation="foo"), "attention_implementation"),
    (dict(init_std=0.0), "init_std"),
    (dict(init_std="gpt2"), "init_std"),
    (dict(init_std=True), "init_std"),
    (dict(init_std=float("inf")), "init_std"),
])
def test_config_errors_name_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(CFG, **kwargs)


def test_xla_attention_implementation_pins_rope_to_the_reference(monkeypatch):
  """ModelConfig(attention_implementation="xla") keeps RoPE off cuDNN even where it would run;
  "cudnn" and None run it; "pallas" (the decoding kernel only) raises, never remapped."""
  from pope_jax import attention
  monkeypatch.setattr(attention, "_gpu_capability", lambda: ("gpu", 9))
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "no such backend")   # raises if chosen
  tokens = jnp.zeros((1, 8), jnp.int32)
  for impl, fails in (("xla", False), (None, True), ("cudnn", True)):
    model = Transformer(ModelConfig(vocab_size=11, num_layers=1, d_model=16, num_heads=2,
                                    pos_encoding="rope", dtype="bfloat16",
                                    attention_implementation=impl))
    if fails:
      with pytest.raises(ValueError, match="no such backend"):
        model.init(jax.random.key(0), tokens)
    else:
      model.init(jax.random.key(0), tokens)
  model = Transformer(ModelConfig(vocab_size=11, num_layers=1, d_model=16, num_heads=2,
                                  pos_encoding="rope", dtype="bfloat16",
                                  attention_implementation="pallas"))
  with pytest.raises(NotImplementedError, match="decoding kernel"):
    model.init(jax.random.key(0), tokens)


@pytest.mark.parametrize("tie", [True, False])
def test_head_multiplies_in_the_compute_dtype(tie):
  # bf16 models: params stay float32, every matmul (the tied head's too) runs in bf16, and the
  # logits come back float32.
  cfg = dataclasses.replace(CFG, dtype="bfloat16", tie_embeddings=tie)
  model, params = _init(cfg)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, TOKENS))(params)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  vocab_dots = [e for e in dots if e.outvars[0].aval.shape[-1] == cfg.vocab_size]
  assert len(vocab_dots) == 1
  assert all(v.aval.dtype == jnp.bfloat16 for v in vocab_dots[0].invars)
  assert model.apply({"params": params}, TOKENS).dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.dtype(jnp.bfloat16), "bf16", "bfloat16",
                                   jnp.dtype("bfloat16")])
def test_config_takes_dtypes_as_jax_users_write_them(dtype):
  cfg = dataclasses.replace(CFG, dtype=dtype, logits_dtype=jnp.float32)
  assert (cfg.dtype, cfg.logits_dtype) == ("bfloat16", "float32")       # canonical names
  # Stored configs hold strings: the canonical form compares equal to a saved one.
  assert cfg == dataclasses.replace(CFG, dtype="bfloat16")
  assert json.loads(json.dumps(dataclasses.asdict(cfg)))["dtype"] == "bfloat16"
  assert hash(cfg) == hash(dataclasses.replace(CFG, dtype="bfloat16"))
  assert dataclasses.replace(CFG, dtype=np.float32).dtype == "float32"
  assert dataclasses.replace(CFG, logits_dtype="compute").logits_dtype == "compute"


def test_dtype_errors_name_the_field_the_caller_passed():
  with pytest.raises(ValueError, match=r"ModelConfig\.dtype must be one of \('float32', "
                                       r"'bfloat16'\), got <class 'jax.numpy.float16'>"):
    dataclasses.replace(CFG, dtype=jnp.float16)
  with pytest.raises(ValueError, match=r"ModelConfig\.dtype .*got 'int8'"):
    dataclasses.replace(CFG, dtype="int8")
  with pytest.raises(TypeError, match=r"ModelConfig\.dtype must be a dtype"):
    dataclasses.replace(CFG, dtype=object())
  with pytest.raises(ValueError, match=r"ModelConfig\.logits_dtype .*got <class 'jax.numpy"):
    dataclasses.replace(CFG, logits_dtype=jnp.bfloat16)


def test_input_shapes_are_named_and_logits_to_keep():
  model, params = _init(CFG)
  with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
    model.apply({"params": params}, TOKENS[0])
  with pytest.raises(ValueError, match=r"attention_mask must have the tokens' shape \(2, 9\)"):
    model.apply({"params": params}, TOKENS, attention_mask=jnp.ones((2, 5), bool))
  last = model.apply({"params": params}, TOKENS, logits_to_keep=2)
  np.testing.assert_allclose(last, model.apply({"params": params}, TOKENS)[:, -2:], atol=1e-6)


def test_bf16_cache_in_the_compute_dtype():
  from pope_jax import init_cache
  cfg = dataclasses.replace(CFG, dtype="bfloat16", num_kv_heads=2)
  model, params = _init(cfg)
  cache = init_cache(cfg, 2, 12)
  # PoPE's default cache holds the Cartesian keys, 2H wide (`ModelConfig.kv_cache_keys`).
  assert cache["k"][0].shape == (2, 12, 2, 16) and cache["k"][0].dtype == jnp.bfloat16
  assert init_cache(dataclasses.replace(cfg, kv_cache_keys="raw"), 2, 12)["k"][0].shape == (
      2, 12, 2, 8)
  logits, cache = model.apply({"params": params}, TOKENS, cache=cache)
  full = model.apply({"params": params}, TOKENS)
  assert logits.dtype == jnp.float32 and int(cache["index"]) == 9
  np.testing.assert_allclose(logits, full, atol=0.05 * float(jnp.abs(full).max()))


@pytest.mark.parametrize("bad, index", [(40, (0, 3)), (-1, (1, 0))])
def test_token_ids_outside_the_vocabulary_are_refused(bad, index):
  model, params = _init(CFG)
  tokens = np.asarray(TOKENS).copy()
  tokens[index] = bad
  with pytest.raises(ValueError, match=rf"token id {bad} at index \({index[0]}, {index[1]}\)"):
    model.apply({"params": params}, tokens)
  jax.jit(lambda p, t: model.apply({"params": p}, t))(params, TOKENS)   # Traced ids: unchecked.


@pytest.mark.parametrize("encoding", ["rope", "pope", "none"])
def test_packed_documents_see_only_their_own_segment(encoding):
  """segment_ids with per-document positions give each document the logits it has alone."""
  model, params = _init(dataclasses.replace(CFG, pos_encoding=encoding))
  seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1]] * 2)
  pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 4]] * 2)
  packed = model.apply({"params": params}, TOKENS, positions=pos, segment_ids=seg)
  first = model.apply({"params": params}, TOKENS[:, :4])
  second = model.apply({"params": params}, TOKENS[:, 4:])
  np.testing.assert_allclose(packed[:, :4], first, atol=1e-5)
  np.testing.assert_allclose(packed[:, 4:], second, atol=1e-5)


def test_segment_ids_errors_are_named():
  from pope_jax import init_cache
  model, params = _init(CFG)
  with pytest.raises(ValueError, match="segment_ids"):
    model.apply({"params": params}, TOKENS, segment_ids=jnp.zeros((2, 8), jnp.int32))
  with pytest.raises(ValueError, match="segment_ids"):
    model.apply({"params": params}, TOKENS, segment_ids=jnp.zeros((2, 9), jnp.int32),
                cache=init_cache(CFG, 2, 16))


def test_config_takes_every_implementation_name_and_leaves_runnability_to_the_ops():
  from pope_jax import attention
  for name in (None,) + attention.IMPLEMENTATIONS:
    assert dataclasses.replace(CFG, attention_implementation=name).attention_implementation == name
  model, params = _init(dataclasses.replace(CFG, attention_implementation="xla"))
  cudnn = Transformer(dataclasses.replace(CFG, attention_implementation="cudnn"))
  with pytest.raises(NotImplementedError, match="cudnn"):     # float32 on CPU
    cudnn.apply({"params": params}, TOKENS)
