"""KV-cache equivalences, left padding, multipliers and vmap on a tiny random Llama (float32)."""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpes_jax import LlamaConfig, greedy_decode, greedy_generate, init_kv_cache, init_params
from lpes_jax.llama import Llama

CFG = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=100.0, qkv_bias=True)
MULTIPLIERS = {"none": None, "per_layer": jnp.array([1.0, 0.5, 0.8]),
               "per_head": jnp.linspace(0.4, 1.0, 12).reshape(3, 4)}


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


@jax.jit
def _hidden(params, tokens, m, kv_cache=None):
  out, state = Llama(CFG).apply({"params": params}, tokens, rope_multipliers=m, kv_cache=kv_cache,
                                mutable=["intermediates"])
  return out, jnp.stack(state["intermediates"]["hidden_states"])        # [L+1, B, T, D]


@pytest.mark.parametrize("mult", [  # the fast tier keeps the plain model
    pytest.param(m, marks=() if m == "none" else pytest.mark.slow) for m in MULTIPLIERS])
def test_kv_cache_equivalences(params, mult):
  m = MULTIPLIERS[mult]
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, CFG.vocab_size)
  full_logits, full_h = _hidden(params, tokens, m)
  for split in ([5, 1, 1, 1, 1, 1, 1], [4, 3, 1, 1, 1, 1]):   # prefill+steps; prefill+chunk+steps
    cache = init_kv_cache(CFG, 2, 16)
    logits, hs, start = [], [], 0
    for n in split:
      (lg, cache), h = _hidden(params, tokens[:, start:start + n], m, cache)
      logits.append(lg)
      hs.append(h)
      start += n
    np.testing.assert_allclose(jnp.concatenate(logits, 1), full_logits, atol=2e-5, rtol=0)
    np.testing.assert_allclose(jnp.concatenate(hs, 2), full_h, atol=2e-5, rtol=0)


@pytest.mark.slow  # fast-tier sibling: test_llama_inputs.test_traced_multipliers_run_under_jit_and_vmap
def test_multipliers_change_logits_and_vmap(params):
  model = Llama(CFG)
  tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, CFG.vocab_size)
  f = lambda m: model.apply({"params": params}, tokens, rope_multipliers=m)
  ms = jnp.stack([jnp.ones(3), jnp.array([1.0, 0.5, 0.25])])
  batched = jax.vmap(f)(ms)
  np.testing.assert_allclose(batched[0], f(None), atol=1e-5)
  np.testing.assert_allclose(batched[1], f(ms[1]), atol=1e-5)
  assert np.abs(batched[0] - batched[1]).max() > 1e-3
  out, _ = jax.vmap(lambda m: greedy_decode(
      CFG, params, tokens, jnp.ones_like(tokens, bool), max_new_tokens=3,
      eos_ids=jnp.zeros((0,), jnp.int32), rope_multipliers=m))(ms)
  assert out.shape == (2, 1, 3)


def test_per_layer_multipliers_keep_the_angles_as_narrow_as_no_multiplier(params):
  # A traced per-layer scale (LPES) must not widen each layer's RoPE angles to every head: the
  # cached keys are rotated per decode step, so [S, N, H/2] angles cost N times [S, H/2].
  def cosine_shapes(m):
    step = lambda p, t, m: Llama(CFG).apply({"params": p}, t, rope_multipliers=m,
                                             kv_cache=init_kv_cache(CFG, 1, 16))
    text = jax.jit(step).lower(params, jnp.zeros((1, 4), jnp.int32), m).as_text()
    return sorted(re.findall(r"stablehlo.cosine %\S+ : tensor<([^>]*)>", text))

  base = cosine_shapes(None)
  assert base and cosine_shapes(jnp.array([1.0, 0.5, 0.8])) == base
  assert cosine_shapes(jnp.float32(0.5)) == base
  assert cosine_shapes(MULTIPLIERS["per_head"]) != base  # Ms-PoE's differ per head


def test_bad_token_and_mask_shapes_are_named(params):
  model, toks = Llama(CFG), jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
    model.apply({"params": params}, toks[0])
  with pytest.raises(ValueError, match=r"attention_mask must have the tokens' shape \(1, 8\)"):
    model.apply({"params": params}, toks, attention_mask=jnp.ones((1, 5), bool))
  with pytest.raises(ValueError, match=r"positions must have the tokens' shape"):
    model.apply({"params": params}, toks, positions=jnp.arange(8))


def test_greedy_generate_refuses_non_finite_multipliers(params):
  # 1/s of a scale s = 0 (the README's multipliers = 1/scales) is named, not decoded into garbage.
  m = 1 / jnp.asarray([1.0] * (CFG.num_layers - 1) + [0.0])
  with pytest.raises(ValueError, match="rope_multipliers must be finite"):
    greedy_generate(CFG, params, [[1, 2, 3]], max_new_tokens=2, rope_multipliers=m)


def test_left_padded_batch_decodes_like_each_prompt_alone(params):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (3, 9, 6)]
  m = MULTIPLIERS["per_layer"]
  batch = greedy_generate(CFG, params, prompts, max_new_tokens=6, eos_ids=(), rope_multipliers=m,
                          bucket=16)
  alone = [greedy_generate(CFG, params, [p], max_new_tokens=6, eos_ids=(), rope_multipliers=m,
                           bucket=16)[0] for p in prompts]
  assert batch == alone
  # Logits of the padded batch equal each prompt alone (float32).
  apply = jax.jit(lambda t, mask: Llama(CFG).apply({"params": params}, t, attention_mask=mask))
  toks = np.zeros((3, 9), np.int32)
  mask = np.zeros((3, 9), bool)
  for i, p in enumerate(prompts):
    toks[i, 9 - len(p):], mask[i, 9 - len(p):] = p, True
  padded = apply(toks, mask)
  for i, p in enumerate(prompts):
    single = apply(jnp.asarray([p]), jnp.ones((1, len(p)), bool))
    np.testing.assert_allclose(padded[i, 9 - len(p):], single[0], atol=2e-5)


def test_eos_stops_and_pads(params):
  prompt = [5, 6, 7]
  free = greedy_generate(CFG, params, [prompt, prompt], max_new_tokens=6, eos_ids=())[0]
  stop = free[2]
  out = greedy_generate(CFG, params, [prompt, prompt], max_new_tokens=6, eos_ids=(stop,))
  first = free.index(stop)
  assert out[0] == free[:first + 1] and out[1] == out[0]


def test_bf16_runs_with_float32_angles(params):
  cfg = dataclasses.replace(CFG, dtype="bfloat16")
  p16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  tokens = jnp.arange(1, 9)[None]
  lg16 = Llama(cfg).apply({"params": p16}, tokens)
  lg32 = Llama(CFG).apply({"params": params}, tokens)
  assert lg16.dtype == jnp.float32
  assert np.abs(np.asarray(lg16) - np.asarray(lg32)).max() < 0.1 * np.abs(np.asarray(lg32)).max()


def test_prompt_longer_than_cache_is_an_error(params):
  with pytest.raises(ValueError, match="KV cache"):
    greedy_generate(CFG, params, [[1] * 20], max_new_tokens=5, max_cache_len=16)
  with pytest.raises(ValueError, match="do not fit"):
    Llama(CFG).apply({"params": params}, jnp.ones((1, 20), jnp.int32),
                     kv_cache=init_kv_cache(CFG, 1, 16))
  with pytest.raises(ValueError, match="rope_multipliers"):
    Llama(CFG).apply({"params": params}, jnp.ones((1, 4), jnp.int32), rope_multipliers=jnp.ones(5))
  with pytest.raises(ValueError, match="at least one prompt"):
    greedy_generate(CFG, params, [], max_new_tokens=2)


def test_kv_cache_overflow_is_an_error(params):
  model = Llama(CFG)
  _, cache = model.apply({"params": params}, jnp.ones((1, 6), jnp.int32),
                         kv_cache=init_kv_cache(CFG, 1, 8))
  with pytest.raises(ValueError, match="2 of its 8 slots are free"):
    model.apply({"params": params}, jnp.ones((1, 4), jnp.int32), kv_cache=cache)


@pytest.mark.slow  # the fast tier checks the cuDNN branch per mask form in tests/pope_jax/test_attention.py
def test_cudnn_implementation_matches_xla(params, monkeypatch):
  """"cudnn" (rotation, then jax.nn's fused op: its own causal mask for plain prefill, the
  positions' boolean mask for padded and cached calls; run here by its XLA backend) gives "xla"'s
  logits, as does None (the default), for plain, padded and cached calls; a float32 model named
  "cudnn" raises NotImplementedError when called, and "jax_nn" is not a name."""
  from pope_jax import attention
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "xla")
  monkeypatch.setattr(attention, "_gpu_capability", lambda: ("gpu", 9))
  # bf16 (cuDNN's dtypes): compared with the reference (float32 scores) in the same dtype, so the
  # bound is bf16 score rounding (0.1 of logits of magnitude ~2), not the old same-dtype 5e-2.
  ref_cfg = dataclasses.replace(CFG, dtype="bfloat16", attention_implementation="xla")
  cfg = dataclasses.replace(ref_cfg, attention_implementation="cudnn")
  auto = dataclasses.replace(ref_cfg, attention_implementation=None)
  assert LlamaConfig(**{f.name: getattr(CFG, f.name) for f in dataclasses.fields(CFG)
                        if f.name != "attention_implementation"}).attention_implementation is None
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 3, CFG.vocab_size)
  mask = jnp.array([[0, 0, 1, 1, 1, 1, 1], [1] * 7], bool)
  for kw in ({}, {"attention_mask": mask}):
    ref = Llama(ref_cfg).apply({"params": p16}, tokens, **kw)
    for c in (cfg, auto):
      out = Llama(c).apply({"params": p16}, tokens, **kw)
      np.testing.assert_allclose(out, ref, atol=1.5e-1)
  cache = init_kv_cache(ref_cfg, 2, 16)
  ref, ref_cache = Llama(ref_cfg).apply({"params": p16}, tokens, attention_mask=mask,
                                        kv_cache=cache)
  ref_next, _ = Llama(ref_cfg).apply({"params": p16}, tokens[:, :1], kv_cache=ref_cache)
  for c in (cfg, auto):
    out, new_cache = Llama(c).apply({"params": p16}, tokens, attention_mask=mask, kv_cache=cache)
    np.testing.assert_allclose(out, ref, atol=1.5e-1)
    out, _ = Llama(c).apply({"params": p16}, tokens[:, :1], kv_cache=new_cache)   # T = 1
    np.testing.assert_allclose(out, ref_next, atol=1.5e-1)
  with pytest.raises(ValueError, match="attention_implementation"):
    dataclasses.replace(CFG, attention_implementation="jax_nn")
  f32 = dataclasses.replace(CFG, attention_implementation="cudnn")          # the name is valid
  with pytest.raises(NotImplementedError, match="cudnn.*bf16/fp16"):        # float32 cannot run
    Llama(f32).apply({"params": params}, tokens)
