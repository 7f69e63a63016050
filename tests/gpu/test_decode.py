"""The split-K decoding kernel on a Hopper GPU: against the reference up to S = 32k, and cached
decoding of `pope_jax.Transformer` through it against the "xla" reference.

    python -m pytest -n 0 -q tests/gpu/test_decode.py
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention as kernel
from pope_jax import ModelConfig, Transformer, attention, generation, init_cache, positions

pytestmark = [pytest.mark.gpu]
if kernel.platform_reason() is not None:
  pytest.skip("needs an NVIDIA Hopper GPU (sm90)", allow_module_level=True)

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}  # relative to the largest reference entry


@pytest.mark.parametrize("b, t, n, kh, h, vd, s, dtype", [
    (1, 1, 12, 12, 64, 64, 8192, jnp.bfloat16),       # GPT-2-124M, one sequence
    (8, 1, 12, 12, 128, 64, 8192, jnp.bfloat16),      # PoPE's Cartesian keys (2H = 128)
    (1, 1, 12, 12, 64, 64, 32768, jnp.bfloat16),
    (2, 7, 32, 8, 128, 128, 5000, jnp.float16),       # Llama GQA, T = 7, S off the tile grid
    (1, 16, 32, 4, 128, 128, 32768, jnp.bfloat16),    # G·T = 128 rows: two 64-row tiles
    (3, 1, 4, 2, 64, 64, 1, jnp.bfloat16),
])
def test_kernel_matches_reference(b, t, n, kh, h, vd, s, dtype):
  ks = jax.random.split(jax.random.key(s), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, vd), jnp.float32).astype(dtype)
  # Left padding per row, holes, one row with no key; causal positions of the last T tokens.
  pad = jax.random.randint(ks[3], (b, 1), 0, max(1, s // 3))
  key_mask = (jnp.arange(s)[None] >= pad) & (jnp.arange(s)[None] % 97 != 5)
  if b > 1:
    key_mask = key_mask.at[-1].set(False)
  k_pos = jnp.maximum(jnp.arange(s)[None] - pad, 0)
  q_pos = jnp.broadcast_to(s - pad - t + jnp.arange(t)[None], (b, t))
  out = kernel.decode_attention(q, k, v, scale=h ** -0.5, key_mask=key_mask, q_positions=q_pos,
                                k_positions=k_pos)
  mask = positions.attention_mask(q_pos, k_pos, is_causal=True, k_valid=key_mask)
  ref = attention.dot_product_attention_reference(q, k, v, scale=h ** -0.5, mask=mask)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
  assert err <= TOL[dtype] * max(1.0, float(jnp.max(jnp.abs(ref)))), err
  seen = mask.any(-1)
  assert bool(jnp.all(jnp.where(seen[:, :, None, None], True, out == 0)))
  # Deterministic: the same inputs give the same bits.
  again = kernel.decode_attention(q, k, v, scale=h ** -0.5, key_mask=key_mask,
                                  q_positions=q_pos, k_positions=k_pos)
  assert bool(jnp.all(out == again))


def test_default_implementation_is_the_kernel_for_decoding():
  q = jnp.zeros((1, 1, 12, 64), jnp.bfloat16)
  k = jnp.zeros((1, 8192, 12, 64), jnp.bfloat16)
  assert attention._choose("decode_attention", None, attention._decode_why_not, q, k, k) == "pallas"
  assert attention._choose("rope_attention", None, attention._rope_why_not, q, k, k,
                           local_window=None, segment_ids=False) == "pallas"
  assert attention._choose("pope_attention", None, attention._pope_why_not, q, k, k,
                           segment_ids=False) == "pallas"


@pytest.mark.parametrize("encoding, keys", [("rope", "mapped"), ("pope", "mapped"),
                                            ("pope", "raw")])
def test_cached_decoding_through_the_kernel_matches_xla(encoding, keys):
  """GPT-2-shaped bf16 model: a left-padded 1,000-token prompt, then 16 single-token steps
  (teacher-forced); the fused path's logits at every step are the reference's within bf16."""
  cfg = ModelConfig(vocab_size=512, num_layers=2, d_model=768, num_heads=12, dtype="bfloat16",
                    pos_encoding=encoding, kv_cache_keys=keys)
  params = Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(jax.random.key(1), (2, 1016), 0, cfg.vocab_size)
  mask = jnp.ones((2, 1016), bool).at[1, :300].set(False)
  logits = {}
  for impl in (None, "xla"):
    c = dataclasses.replace(cfg, attention_implementation=impl)
    step = jax.jit(generation.transformer_step(c, params))
    cache = init_cache(c, 2, generation.cache_length(1000, 16))
    out = []
    for start, stop in [(0, 1000)] + [(i, i + 1) for i in range(1000, 1016)]:
      lg, cache = step(tokens[:, start:stop], mask[:, start:stop], cache)
      out.append(lg)
    logits[impl] = jnp.stack(out)
  scale = float(jnp.abs(logits["xla"]).max())
  np.testing.assert_allclose(logits[None], logits["xla"], atol=0.03 * scale, rtol=0)
