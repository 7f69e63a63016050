"""Dropout on the attention probabilities: xla reference only, unbiased, refused by fused paths."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pope_jax import ModelConfig, attention
from pope_jax.model import Transformer


def _qkv(b=1, t=6, s=6, n=2, h=8):
  ks = jax.random.split(jax.random.key(0), 4)
  return (jax.random.normal(ks[0], (b, t, n, h)), jax.random.normal(ks[1], (b, s, n, h)),
          jax.random.normal(ks[2], (b, s, n, h)),
          jax.random.uniform(ks[3], (n, h), jnp.float32, -2 * math.pi, 0.0))


def _pope(q, k, v, delta, **kw):
  return attention.pope_attention(q, k, v, delta, is_causal=True, **kw)


def _rope(q, k, v, delta, **kw):
  return attention.rope_attention(q, k, v, is_causal=True, **kw)


@pytest.mark.parametrize("op", [_pope, _rope])
def test_dropout_zeroes_probabilities_and_is_unbiased(op):
  q, k, v, delta = _qkv()
  plain = op(q, k, v, delta)
  np.testing.assert_array_equal(op(q, k, v, delta, dropout_rate=0.0), plain)
  keys = jax.random.split(jax.random.key(1), 4000)
  outs = jax.vmap(lambda key: op(q, k, v, delta, dropout_rate=0.3, dropout_rng=key))(keys)
  assert not np.allclose(outs[0], plain)
  # The mean over masks is the output without dropout (sd of the mean about 0.02 here).
  np.testing.assert_allclose(outs.mean(0), plain, atol=0.08)
  # One value per key: with one-hot values the output is the kept, rescaled probabilities.
  eye = jnp.broadcast_to(jnp.eye(6), (1, 2, 6, 6)).transpose(0, 2, 1, 3)
  probs = op(q, k, eye, delta, dropout_rate=0.5, dropout_rng=keys[0])
  full = op(q, k, eye, delta)
  assert set(np.round(np.asarray(probs / jnp.where(full == 0, 1, full)), 5).ravel()) <= {0.0, 2.0}


@pytest.mark.parametrize("op, impl", [(_pope, "pallas"), (_rope, "cudnn")])
def test_fused_paths_refuse_dropout_and_default_takes_xla(op, impl):
  q, k, v, delta = _qkv()
  with pytest.raises(NotImplementedError, match="attention dropout runs only in the xla"):
    op(q, k, v, delta, dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation=impl)
  op(q, k, v, delta, dropout_rate=0.1, dropout_rng=jax.random.key(0))   # None: xla


@pytest.mark.parametrize("kw, match", [({"dropout_rate": 1.0}, r"dropout_rate must be in \[0, 1\)"),
                                       ({"dropout_rate": 0.1}, "needs a dropout_rng")])
def test_bad_dropout_arguments_are_named(kw, match):
  with pytest.raises(ValueError, match=match):
    _pope(*_qkv(), **kw)


def test_model_attention_dropout_trains_only():
  cfg = ModelConfig(vocab_size=16, num_layers=1, d_model=16, num_heads=2, attention_dropout=0.5)
  tokens = jnp.arange(8)[None] % 16
  params = Transformer(cfg).init(jax.random.key(0), tokens)["params"]
  off = dataclasses.replace(cfg, attention_dropout=0.0)
  np.testing.assert_array_equal(Transformer(cfg).apply({"params": params}, tokens),
                                Transformer(off).apply({"params": params}, tokens))
  train = lambda c: Transformer(c).apply({"params": params}, tokens, deterministic=False,
                                         rngs={"dropout": jax.random.key(2)})
  assert not np.allclose(train(cfg), train(off))
  with pytest.raises(ValueError, match="ModelConfig.attention_dropout must be in"):
    dataclasses.replace(cfg, attention_dropout=-0.1)
