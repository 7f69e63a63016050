"""KV-cache decoding ≡ the full forward (RoPE, PoPE, multipliers, GQA, left padding), sampling,
stop ids and the prompt checks of the one generation loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pope_jax import ModelConfig, Transformer, generation, init_cache

CFG = ModelConfig(vocab_size=40, num_layers=2, d_model=32, num_heads=4)
PROMPT_LENS = (7, 4)                      # row 1 is left-padded by 3
SPLIT = (3, 2, 2, 1, 1, 1)                # prefill in chunks, then single tokens: 10 tokens


def _model(**overrides):
  cfg = dataclasses.replace(CFG, **overrides)
  model = Transformer(cfg)
  return cfg, model, model.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]


def _padded_tokens():
  """[2, 10] tokens and mask: two prompts of PROMPT_LENS left-padded to 7, then 3 more tokens."""
  toks = np.array(jax.random.randint(jax.random.key(0), (2, 10), 1, CFG.vocab_size), np.int32)
  mask = np.ones((2, 10), bool)
  mask[1, :7 - PROMPT_LENS[1]] = False
  toks[~mask] = 0
  return jnp.asarray(toks), jnp.asarray(mask)


CASES = [(enc, mult, kv, keys) for enc in ("rope", "pope") for mult in (False, True)
         for kv in (4, 2) for keys in ("mapped", "raw")]


# The fast tier keeps two cases: PoPE (mapped cache) and RoPE (raw cache), no multipliers or GQA.
FAST_CASES = [("pope", False, 4, "mapped"), ("rope", False, 4, "raw")]


@pytest.mark.parametrize("encoding,mult,kv_heads,keys", FAST_CASES + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in CASES + [("none", False, 2, "mapped")] if case not in FAST_CASES])
def test_cached_decoding_equals_full_forward_every_step(encoding, mult, kv_heads, keys):
  """Both KV-cache layouts (`ModelConfig.kv_cache_keys`) give the full forward's logits."""
  cfg, model, params = _model(pos_encoding=encoding, num_kv_heads=kv_heads, kv_cache_keys=keys)
  # [L, N], equal within each GQA group of 2 query heads.
  m = None if not mult else jnp.array([[1.0, 1.0, 0.5, 0.5], [0.25, 0.25, 2.0, 2.0]])
  toks, mask = _padded_tokens()
  apply = lambda t, msk, **kw: model.apply({"params": params}, t, attention_mask=msk,
                                           rope_multipliers=m, **kw)
  cache, start = init_cache(cfg, 2, 12), 0
  for n in SPLIT:
    logits, cache = apply(toks[:, start:start + n], mask[:, start:start + n], cache=cache)
    start += n
    full = apply(toks[:, :start], mask[:, :start])              # the same tokens, no cache
    np.testing.assert_allclose(logits, full[:, start - n:], atol=1e-5, rtol=0)
  assert int(cache["index"]) == 10
  # Left padding: the padded row's logits equal its tokens alone, without padding or mask.
  alone = model.apply({"params": params}, toks[1:, 7 - PROMPT_LENS[1]:], rope_multipliers=m)
  np.testing.assert_allclose(full[1, 7 - PROMPT_LENS[1]:], alone[0], atol=1e-5, rtol=0)


def test_plain_forward_unchanged_by_an_all_true_mask():
  _, model, params = _model()
  toks, _ = _padded_tokens()
  plain = model.apply({"params": params}, toks)
  masked = model.apply({"params": params}, toks, attention_mask=jnp.ones(toks.shape, bool))
  np.testing.assert_allclose(plain, masked, atol=1e-5, rtol=0)


def test_decoding_past_the_cache_is_an_error_naming_the_limit():
  cfg, model, params = _model()
  _, cache = model.apply({"params": params}, jnp.ones((1, 6), jnp.int32),
                         cache=init_cache(cfg, 1, 8))
  with pytest.raises(ValueError, match="2 of its 8 slots are free"):
    model.apply({"params": params}, jnp.ones((1, 3), jnp.int32), cache=cache)
  with pytest.raises(ValueError, match="does not fit a KV cache of 8 slots"):
    generation.transformer_decode(cfg, params, jnp.ones((1, 6), jnp.int32),
                                  jnp.ones((1, 6), bool), max_new_tokens=3, cache_len=8)
  with pytest.raises(ValueError, match="max_cache_len=8"):
    generation.generate(cfg, params, [[1] * 6], max_new_tokens=3, max_cache_len=8)


def _greedy_reference(model, params, prompt, n):
  """n greedy tokens by recomputing the whole prefix each step (no cache)."""
  toks = list(prompt)
  for _ in range(n):
    logits = model.apply({"params": params}, jnp.asarray([toks]))
    toks.append(int(jnp.argmax(logits[0, -1])))
  return toks[len(prompt):]


@pytest.mark.parametrize("encoding", ["rope", "pope"])
@pytest.mark.slow  # test_stop_ids_end_rows_and_pad decodes batched rows in the fast tier
def test_generate_greedy_batched_equals_recomputing_each_prompt(encoding):
  cfg, model, params = _model(pos_encoding=encoding, num_kv_heads=2)
  prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [3, 1, 4, 1]]
  out = generation.generate(cfg, params, prompts, max_new_tokens=5, bucket=8)
  assert out == [_greedy_reference(model, params, p, 5) for p in prompts]


def test_stop_ids_end_rows_and_pad():
  cfg, _, params = _model()
  prompt = [5, 6, 7]
  free = generation.generate(cfg, params, [prompt], max_new_tokens=6, bucket=4)[0]
  stop = free[2]
  first = free.index(stop)
  out = generation.generate(cfg, params, [prompt, prompt], max_new_tokens=6, bucket=4,
                            stop_ids=(stop,))
  assert out == [free[:first + 1]] * 2
  new, lengths = generation.transformer_decode(
      cfg, params, jnp.asarray([prompt]), jnp.ones((1, 3), bool), max_new_tokens=6,
      stop_ids=jnp.asarray([stop]), pad_id=39)
  assert int(lengths[0]) == first + 1 and np.all(np.asarray(new)[0, first + 1:] == 39)


@pytest.mark.slow
def test_sampling_limits_and_determinism():
  cfg, _, params = _model(pos_encoding="pope")
  prompts = [[1, 2, 3], [4, 5]]
  greedy = generation.generate(cfg, params, prompts, max_new_tokens=6, bucket=4)
  run = lambda key, **kw: generation.generate(cfg, params, prompts, max_new_tokens=6, bucket=4,
                                              key=key, **kw)
  k0, k1 = jax.random.key(0), jax.random.key(1)
  assert run(k0, temperature=1e-6) == greedy
  assert run(k0, temperature=2.0, top_k=1) == greedy
  assert run(k0, temperature=1.0, top_p=1e-6) == greedy   # the nucleus is the top token
  hot = run(k0, temperature=5.0)
  assert hot == run(k0, temperature=5.0) and hot != run(k1, temperature=5.0)
  with pytest.raises(ValueError, match="needs a jax.random key"):
    generation.generate(cfg, params, prompts, temperature=1.0)


def test_sample_masks_as_defined():
  probs = jnp.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
  logits = jnp.log(probs)
  kept = lambda x: np.isfinite(np.asarray(x))
  # top-p: the most likely tokens until their probability reaches p.
  for p, row0 in ((0.4, [1, 0, 0, 0]), (0.75, [1, 1, 0, 0]), (0.85, [1, 1, 1, 0]),
                  (1.0, [1, 1, 1, 1])):
    got = kept(generation.top_p_logits(logits, p))
    np.testing.assert_array_equal(got[0], np.array(row0, bool))
    np.testing.assert_array_equal(got[1], np.array(row0[::-1], bool))
  np.testing.assert_array_equal(kept(generation.top_k_logits(logits, 2))[0], [1, 1, 0, 0])
  draws = jax.vmap(lambda k: generation.sample(
      logits, k, generation.Sampling(temperature=1.0, top_p=0.75)))(
          jax.random.split(jax.random.key(0), 200))                   # [200, 2]
  assert set(np.asarray(draws[:, 0]).tolist()) == {0, 1}
  assert set(np.asarray(draws[:, 1]).tolist()) == {2, 3}
  np.testing.assert_array_equal(generation.sample(logits, None), [0, 3])
  with pytest.raises(ValueError, match="top_p"):
    generation.Sampling(temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match="top_k"):
    generation.Sampling(temperature=1.0, top_k=0)
  with pytest.raises(ValueError, match="temperature"):
    generation.Sampling(temperature=-1.0)


def test_prompt_ids_are_checked_before_work():
  cfg, _, params = _model()
  with pytest.raises(ValueError, match=r"token id 40 at \[row, position\] \[1, 2\].*\[0, 40\)"):
    generation.generate(cfg, params, [[1, 2], [3, 4, 40]])
  with pytest.raises(ValueError, match=r"token id -1 at \[row, position\] \[0, 0\]"):
    generation.transformer_decode(cfg, params, jnp.asarray([[-1, 2]]), jnp.ones((1, 2), bool),
                                  max_new_tokens=2)
  with pytest.raises(TypeError, match="token ids"):
    generation.generate(cfg, params, "to be or not to be")
  with pytest.raises(TypeError, match="prompt 0 is text"):
    generation.generate(cfg, params, ["to be"])
  with pytest.raises(TypeError, match="int token ids"):
    generation.generate(cfg, params, [[1.5, 2.0]])
  with pytest.raises(ValueError, match="at least one prompt"):
    generation.generate(cfg, params, [])
  # Pads outside the vocabulary are not prompt tokens.
  generation.check_token_ids(np.array([[-1, 3]]), 40, mask=np.array([[False, True]]))


def test_decode_scan_and_loop_agree_and_report_progress():
  cfg, _, params = _model()
  toks, mask = _padded_tokens()
  step = generation.transformer_step(cfg, params)
  seen = []
  fixed, lengths = generation.decode(step, init_cache(cfg, 2, 14), toks[:, :7], mask[:, :7],
                                     max_new_tokens=4, on_token=lambda i: seen.append(int(i)))
  looped, _ = generation.decode(step, init_cache(cfg, 2, 14), toks[:, :7], mask[:, :7],
                                max_new_tokens=4, stop_ids=())
  np.testing.assert_array_equal(fixed, looped)
  assert sorted(seen) == [0, 1, 2, 3] and np.all(np.asarray(lengths) == 4)


@pytest.mark.flaky(reruns=2)  # an interpreted run that stops is ended and rerun
@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("encoding,keys", [("pope", "mapped"), ("rope", "mapped"),
                                           ("pope", "raw")])
def test_decode_steps_run_the_decoding_kernel_by_default(encoding, keys, monkeypatch):
  """In the Mosaic GPU interpreter, bf16 steps of T <= 16 tokens take the split-K kernel under
  the default implementation, and match the "xla" reference's logits."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels import decode_attention as kernel
  calls = []
  run = kernel.decode_attention
  monkeypatch.setattr(kernel, "decode_attention", lambda *a, **kw: calls.append(1) or run(*a, **kw))
  cfg, model, params = _model(pos_encoding=encoding, kv_cache_keys=keys, dtype="bfloat16",
                              num_layers=1, num_heads=2, num_kv_heads=1, d_model=128)
  toks, mask = _padded_tokens()
  logits = {}
  for impl in (None, "xla"):
    c = dataclasses.replace(cfg, attention_implementation=impl)
    step = generation.transformer_step(c, params)
    cache = init_cache(c, 2, generation.cache_length(7, 3))
    out = []
    with plgpu.force_gpu_interpret_mode():
      for start, n in ((0, 7), (7, 1), (8, 1)):
        lg, cache = step(toks[:, start:start + n], mask[:, start:start + n], cache)
        out.append(lg)
    logits[impl] = jnp.stack(out)
  assert len(calls) == 3                                  # one layer, three calls
  np.testing.assert_allclose(logits[None], logits["xla"], atol=0.05 * float(
      jnp.abs(logits["xla"]).max()), rtol=0)
