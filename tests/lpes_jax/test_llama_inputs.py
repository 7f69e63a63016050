"""Llama inputs: checked ids, multipliers and positions; unwritten KV-cache slots are inert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from lpes_jax import LlamaConfig, init_kv_cache, init_params
from lpes_jax.llama import Llama
from lpes_jax.tokenizer import Tokenizer

CFG = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, rope_theta=100.0, qkv_bias=True)


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, jax.random.key(0), scale=0.3)


@pytest.mark.parametrize("bad, index", [(97, r"\(0, 2\)"), (-1, r"\(0, 2\)"), (10**6, r"\(0, 2\)")])
def test_concrete_token_ids_outside_the_vocabulary_are_refused(params, bad, index):
  tokens = np.array([[1, 2, bad, 4]])
  for given in (tokens, jnp.asarray(tokens, jnp.int32) if abs(bad) < 2**31 else tokens):
    with pytest.raises(ValueError, match=rf"tokens holds token id {bad} at index {index}, "
                                         rf"outside the vocabulary \[0, 97\)"):
      Llama(CFG).apply({"params": params}, given)


def test_string_or_float_tokens_are_a_type_error(params):
  with pytest.raises(TypeError, match="tokens must be integer token ids.*tokenizer"):
    Llama(CFG).apply({"params": params}, "hello world")
  with pytest.raises(TypeError, match="tokens must be integer token ids"):
    Llama(CFG).apply({"params": params}, np.ones((1, 3), np.float32))


def test_traced_ids_follow_flax_embed_as_documented(params):
  # Under jit ids are not checked: nn.Embed's jnp.take reads -1 as V - 1, and V as NaN.
  f = jax.jit(lambda t: Llama(CFG).apply({"params": params}, t))
  np.testing.assert_array_equal(f(jnp.array([[3, -1]])), f(jnp.array([[3, CFG.vocab_size - 1]])))
  assert np.isnan(np.asarray(f(jnp.array([[3, CFG.vocab_size]]))[0, 1])).all()


@pytest.mark.parametrize("m", [0.0, -1.0, [1.0, 0.0, 1.0], np.full((3, 4), -1.0)])
def test_zero_or_negative_multipliers_are_refused(params, m):
  with pytest.raises(ValueError, match="rope_multipliers must be > 0"):
    Llama(CFG).apply({"params": params}, jnp.ones((1, 4), jnp.int32), rope_multipliers=m)


def test_traced_multipliers_run_under_jit_and_vmap(params):
  tokens = jnp.ones((1, 4), jnp.int32)
  f = lambda m: Llama(CFG).apply({"params": params}, tokens, rope_multipliers=m)
  out = jax.jit(jax.vmap(f))(jnp.array([[1.0, 0.5, 0.25], [1.0, 1.0, 1.0]]))
  np.testing.assert_allclose(out[1], f(None), atol=1e-5)


def test_positions_outside_int32_are_refused(params):
  pos = np.arange(4, dtype=np.int64)[None]
  pos[0, 3] = 2**31
  with pytest.raises(ValueError, match=r"positions must lie inside int32 .* got 2147483648"):
    Llama(CFG).apply({"params": params}, jnp.ones((1, 4), jnp.int32), positions=pos)


def test_encode_checks_ids_against_the_model_vocabulary():
  vocab = {"[UNK]": 0, "a": 1, "b": 2, "<s>": 5}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok = Tokenizer(backend=backend, bos_id=5, eos_ids=(), pad_id=None, add_bos=True)
  assert tok.encode("a b") == [5, 1, 2]                 # model vocabulary unknown: not checked
  small = Tokenizer(backend=backend, bos_id=5, eos_ids=(), pad_id=None, add_bos=True,
                    model_vocab_size=4)
  assert small.encode("a b", add_bos=False) == [1, 2]
  with pytest.raises(ValueError, match=r"the encoded ids holds token id 5 at index \(0,\), "
                                       r"outside the vocabulary \[0, 4\)"):
    small.encode("a b")


# ---- unwritten KV-cache slots


def _fill_unwritten(cache, fill, key):
  """The cache with every slot's k, v and position replaced by garbage (`valid` stays False)."""
  def garbage(x, k):
    if fill == "random":
      return (1e6 * jax.random.normal(k, x.shape)).astype(x.dtype)
    return jnp.full_like(x, fill)
  keys = iter(jax.random.split(key, 2 * CFG.num_layers))
  return dict(cache, k=tuple(garbage(x, next(keys)) for x in cache["k"]),
              v=tuple(garbage(x, next(keys)) for x in cache["v"]),
              positions=jax.random.randint(key, cache["positions"].shape, -2**30, 2**30))


@jax.jit
def _step(params, tokens, mask, cache):
  return Llama(CFG).apply({"params": params}, tokens, attention_mask=mask, kv_cache=cache)


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf, 3e38, "random"])
def test_unwritten_cache_slots_never_affect_logits(params, fill):
  # Left-padded prefill, then decode steps: logits are bit-identical to a zeros cache.
  tokens = jnp.array([[0, 0, 0, 5, 6, 7], [11, 12, 13, 14, 15, 16]], jnp.int32)
  mask = jnp.array([[0, 0, 0, 1, 1, 1], [1] * 6], bool)
  runs = []
  for cache in (init_kv_cache(CFG, 2, 10),
                _fill_unwritten(init_kv_cache(CFG, 2, 10), fill, jax.random.key(3))):
    logits, cache = _step(params, tokens, mask, cache)
    out = [logits]
    for _ in range(3):
      nxt = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
      logits, cache = _step(params, nxt, jnp.ones((2, 1), bool), cache)
      out.append(logits)
    runs.append(out)
  for want, got in zip(*runs):
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(got, want)
