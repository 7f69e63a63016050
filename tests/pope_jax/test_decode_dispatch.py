"""Decoding through the attention ops: `attention.decode_attention` over mapped caches, and the
decoding path of implementation="pallas" (T <= 16 new queries, S > T keys) for PoPE and RoPE."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pope_jax import attention, positions


def _qkv(b=2, t=3, n=4, kh=2, h=64, s=100, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(dtype)
  mask = jnp.arange(s)[None] >= jnp.array([[0], [30]])[:b]
  return q, k, v, mask


def test_decode_attention_xla_is_the_masked_reference():
  q, k, v, mask = _qkv(dtype=jnp.float32)
  k_pos = jnp.broadcast_to(jnp.arange(100), (2, 100))
  q_pos = jnp.array([[97, 98, 99], [40, 41, 42]])
  out = attention.decode_attention(q, k, v, scale=0.2, key_mask=mask, q_positions=q_pos,
                                   k_positions=k_pos)
  ref = attention.dot_product_attention_reference(
      q, k, v, scale=0.2,
      mask=positions.attention_mask(q_pos, k_pos, is_causal=True, k_valid=mask))
  np.testing.assert_allclose(out, ref, atol=1e-6)
  no_pos = attention.decode_attention(q, k, v, scale=0.2, key_mask=mask)
  ref = attention.dot_product_attention_reference(q, k, v, scale=0.2, mask=mask[:, None])
  np.testing.assert_allclose(no_pos, ref, atol=1e-6)


def test_decode_attention_errors_name_the_argument():
  q, k, v, mask = _qkv()
  with pytest.raises(ValueError, match="key_mask"):
    attention.decode_attention(q, k, v, scale=1.0, key_mask=mask[:, :5])
  with pytest.raises(ValueError, match="both"):
    attention.decode_attention(q, k, v, scale=1.0, key_mask=mask, q_positions=jnp.zeros((2, 3)))
  with pytest.raises(NotImplementedError, match="Hopper"):          # CPU
    attention.decode_attention(q, k, v, scale=1.0, key_mask=mask, implementation="pallas")


def test_default_picks_the_decoding_kernel_only_for_decoding_on_hopper(monkeypatch):
  class FakeDevice:
    platform, compute_capability = "gpu", "9.0"
  q, k, v, mask = _qkv()
  choose = lambda op, why, q, k, v, **kw: attention._choose(op, None, why, q, k, v, **kw)
  rope = dict(local_window=None, segment_ids=False)
  assert choose("rope", attention._rope_why_not, q, k, v, **rope) == "xla"            # CPU
  monkeypatch.setattr(jax, "devices", lambda: [FakeDevice()])
  assert choose("decode", attention._decode_why_not, q, k, v) == "pallas"
  assert choose("rope", attention._rope_why_not, q, k, v, **rope) == "pallas"
  assert choose("pope", attention._pope_why_not, q, k, v, segment_ids=False) == "pallas"
  q17 = jnp.zeros((2, 17, 4, 64), jnp.bfloat16)                   # prefill: not decoding
  assert choose("pope", attention._pope_why_not, q17, k, v, segment_ids=False) == "pallas"
  assert choose("rope", attention._rope_why_not, q, k, v, local_window=8,
                segment_ids=False) == "cudnn"                       # no window in the kernel
  assert choose("decode", attention._decode_why_not, q.astype(jnp.float32), k, v) == "xla"


@pytest.mark.flaky(reruns=2)  # an interpreted run that stops is ended and rerun
@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["pope", "rope"])
def test_ops_decode_through_the_kernel(encoding):
  """pope_attention / rope_attention with implementation="pallas" on decoding shapes (key_mask,
  per-row positions, a multiplier) equal "xla", in the Mosaic GPU interpreter."""
  q, k, v, mask = _qkv()
  k_pos = jnp.maximum(jnp.arange(100)[None] - jnp.array([[0], [30]]), 0)
  q_pos = jnp.array([[100, 101, 102], [70, 71, 72]])
  kw = dict(is_causal=True, q_positions=q_pos, k_positions=k_pos, key_mask=mask,
            multiplier=jnp.array([1.0, 1.0, 0.5, 0.5]))
  op = attention.pope_attention if encoding == "pope" else attention.rope_attention
  args = (q, k, v) + ((jnp.full((4, 64), -1.0),) if encoding == "pope" else ())
  ref = op(*args, implementation="xla", **kw).astype(jnp.float32)
  with plgpu.force_gpu_interpret_mode():
    out = op(*args, implementation="pallas", **kw).astype(jnp.float32)
  assert float(jnp.max(jnp.abs(out - ref))) <= 2e-2 * float(jnp.max(jnp.abs(ref)))
