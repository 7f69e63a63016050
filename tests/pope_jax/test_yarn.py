"""YaRN frequencies and attention factor against hand-derived values (Hugging Face's formulas)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pope_jax import attention, encodings, positions
from pope_jax.config import ModelConfig, YarnConfig
from pope_jax.layers import PositionalAttention
from pope_jax.model import Transformer


def test_yarn_ratios_hand_derived():
  # H = 16, base 1e4, L_orig = 2048, s = 4:
  # d(32) = 16·ln(2048 / (2π·32)) / (2 ln 1e4) = 2.016 → floor 2;
  # d(1) = 16·ln(2048 / 2π) / (2 ln 1e4) = 5.026 → ceil 6. Ramp (i - 2) / 4 clipped to [0, 1];
  # ratio θ'/θ = (1 - ramp) + ramp / 4.
  ratio = encodings.yarn_frequencies(16, 10000.0, 4.0, 2048) / encodings.rope_frequencies(16)
  np.testing.assert_allclose(ratio, [1, 1, 1, 0.8125, 0.625, 0.4375, 0.25, 0.25], rtol=1e-6)


def test_yarn_matches_transformers_golden():
  # transformers 5.24 ROPE_INIT_FUNCTIONS["yarn"], head_dim 16, theta 1e4, factor 4, original 2048.
  golden = [1.0, 0.3162277638912201, 0.10000000149011612, 0.025693506002426147,
            0.00624999962747097, 0.0013834965648129582, 0.0002500000118743628,
            7.905694656074047e-05]
  np.testing.assert_allclose(encodings.yarn_frequencies(16, 10000.0, 4.0, 2048), golden, rtol=1e-6)


def test_yarn_untruncated_ramp_and_custom_betas():
  # No truncation: low = 2.016, high = 5.026 (same inputs as above).
  low = 16 * math.log(2048 / (2 * math.pi * 32)) / (2 * math.log(1e4))
  high = 16 * math.log(2048 / (2 * math.pi)) / (2 * math.log(1e4))
  ramp = np.clip((np.arange(8) - low) / (high - low), 0, 1)
  ratio = encodings.yarn_frequencies(16, 1e4, 4.0, 2048, truncate=False) / encodings.rope_frequencies(16)
  np.testing.assert_allclose(ratio, 1 - ramp + ramp / 4, rtol=1e-5)
  # beta_fast = 1e6 rotations is never reached: low clips to 0, so pair 0 is already on the ramp.
  r2 = encodings.yarn_frequencies(16, 1e4, 4.0, 2048, beta_fast=1e6) / encodings.rope_frequencies(16)
  assert r2[0] == 1.0 and r2[-1] == pytest.approx(0.25)


def test_yarn_factor_one_is_rope():
  np.testing.assert_allclose(encodings.yarn_frequencies(64, 1e4, 1.0, 1024),
                             encodings.rope_frequencies(64), rtol=1e-7)


def test_attention_factor():
  assert encodings.yarn_attention_factor(4.0) == pytest.approx(0.1 * math.log(4) + 1)
  assert encodings.yarn_attention_factor(0.5) == 1.0
  assert encodings.yarn_attention_factor(4.0, 1.5) == 1.5        # Explicit: verbatim.


@pytest.mark.parametrize("kwargs", [dict(factor=0.0), dict(original_max_position=0),
                                    dict(beta_fast=1.0, beta_slow=2.0)])
def test_yarn_bad_input(kwargs):
  args = dict(factor=4.0, original_max_position=128) | kwargs
  with pytest.raises(ValueError):
    encodings.yarn_frequencies(16, 1e4, args.pop("factor"), args.pop("original_max_position"),
                               **args)
  with pytest.raises(ValueError, match="YarnConfig"):
    YarnConfig(**(dict(factor=4.0, original_max_position=128) | kwargs))


def test_model_applies_yarn_frequencies_and_temperature_once():
  yarn = YarnConfig(factor=4.0, original_max_position=16)
  cfg = ModelConfig(vocab_size=11, num_layers=1, d_model=16, num_heads=2, pos_encoding="rope")
  tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, 11)
  params = Transformer(cfg).init(jax.random.key(1), tokens)["params"]
  ycfg = dataclasses.replace(cfg, rope_yarn=yarn)
  # The attention layer alone: YaRN = rope_attention with YaRN frequencies and q, k each × af.
  layer = PositionalAttention(num_heads=2, num_kv_heads=2, head_dim=8, pos_encoding="rope",
                              rope_yarn=yarn)
  x = jax.random.normal(jax.random.key(2), (1, 12, 16))
  lp = layer.init(jax.random.key(3), x)["params"]
  got = layer.apply({"params": lp}, x)
  q = jnp.einsum("btd,dnh->btnh", x, lp["query"]["kernel"])
  k = jnp.einsum("btd,dnh->btnh", x, lp["key"]["kernel"])
  v = jnp.einsum("btd,dnh->btnh", x, lp["value"]["kernel"])
  af = encodings.yarn_attention_factor(4.0)
  freqs = encodings.yarn_frequencies(8, 1e4, 4.0, 16)
  pos = jnp.arange(12)
  qr = encodings.apply_rope(q, pos, frequencies=freqs) * af
  kr = encodings.apply_rope(k, pos, frequencies=freqs) * af
  mask = positions.attention_mask(pos, pos, is_causal=True)
  ref = attention.dot_product_attention_reference(qr, kr, v, scale=8 ** -0.5, mask=mask)
  want = jnp.einsum("btnh,nhd->btd", ref, lp["out"]["kernel"])
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  # Same parameter tree; different logits than plain RoPE.
  out_rope = Transformer(cfg).apply({"params": params}, tokens)
  out_yarn = Transformer(ycfg).apply({"params": params}, tokens)
  assert not np.allclose(out_rope, out_yarn)


def test_yarn_needs_rope():
  with pytest.raises(ValueError, match="rope_yarn"):
    ModelConfig(vocab_size=11, num_layers=1, d_model=16, num_heads=2, pos_encoding="pope",
                rope_yarn=YarnConfig(factor=2.0, original_max_position=8))
