"""Split-K decoding kernel vs `pope_jax.attention.dot_product_attention_reference`.

Runs in the Mosaic GPU interpreter on CPU: T = 1 and 7 new queries, GQA, bf16 and fp16, cache
masks drawn by hypothesis (left padding, holes, rows that see no key), causal positions for
T > 1. The cheap tier keeps S small and the shapes few (each shape compiles once; hypothesis'
draws vary only the masks); S up to 5,000 is marked slow. The GPU-only code (register-operand
wgmma) is lowered for CUDA without a GPU.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _streaming
from pallas_kernels import decode_attention as kernel
from pope_jax import attention, positions

# As in test_pope_attention: an interpreted run that stops making progress is ended and rerun.
pytestmark = [pytest.mark.timeout(300, method="thread"), pytest.mark.flaky(reruns=2)]

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3}  # relative to the largest reference entry


def _operands(b, t, n, kh, h, s, dtype, seed=0, vd=None):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, vd or h), jnp.float32).astype(dtype)
  return q, k, v


def _check(q, k, v, key_mask, q_pos=None, k_pos=None, config=None, scale=0.3):
  with plgpu.force_gpu_interpret_mode():
    out = kernel.decode_attention(q, k, v, scale=scale, key_mask=key_mask, q_positions=q_pos,
                                  k_positions=k_pos, config=config)
  mask = (key_mask[:, None, :] if q_pos is None else
          positions.attention_mask(q_pos, k_pos, is_causal=True, k_valid=key_mask))
  ref = attention.dot_product_attention_reference(q, k, v, scale=scale, mask=mask)
  assert out.shape == ref.shape and out.dtype == q.dtype
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
  assert err <= TOL[q.dtype.type] * max(1.0, float(jnp.max(jnp.abs(ref)))), err
  # Rows with no visible key are exactly zero.
  seen = jnp.broadcast_to(mask, (q.shape[0], q.shape[1], k.shape[1])).any(-1)
  assert bool(jnp.all(jnp.where(seen[:, :, None, None], True, out == 0)))


@hst.composite
def cache_masks(draw, b: int, s: int):
  """[B, S] bool masks of a cache: per row left padding, a filled prefix, holes; some empty."""
  rows = []
  for _ in range(b):
    kind = draw(hst.sampled_from(["left_pad", "holes", "empty", "full"]))
    row = np.ones(s, bool)
    if kind == "empty":
      row[:] = False
    elif kind != "full":
      start = draw(hst.integers(0, s - 1))
      end = draw(hst.integers(start + 1, s))
      row[:start] = False
      row[end:] = False
      if kind == "holes":
        for _ in range(draw(hst.integers(1, 4))):
          a = draw(hst.integers(0, s - 1))
          row[a:a + draw(hst.integers(1, max(1, s // 4)))] = False
    rows.append(row)
  return jnp.asarray(np.stack(rows))


# (B, T, N, K, H, S, dtype): T = 1 and 7, GQA groups 2 and 7·2 rows, a single-key cache.
CHEAP = [
    (2, 1, 4, 2, 64, 200, jnp.bfloat16),
    (2, 7, 4, 2, 64, 130, jnp.float16),
    (1, 1, 2, 1, 32, 1, jnp.bfloat16),
]


@pytest.mark.parametrize("b, t, n, kh, h, s, dtype", CHEAP)
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=hst.data())
def test_masks_match_reference(b, t, n, kh, h, s, dtype, data):
  q, k, v = _operands(b, t, n, kh, h, s, dtype)
  _check(q, k, v, data.draw(cache_masks(b, s)), config=kernel.DecodeConfig(block_kv=64))


def test_causal_positions_t7():
  """T = 7 new queries at the cache's end: query t sees slots up to its own position."""
  b, t, n, kh, h, s = 2, 7, 4, 2, 64, 200
  q, k, v = _operands(b, t, n, kh, h, s, jnp.bfloat16, seed=1)
  mask = (jnp.arange(s)[None] >= jnp.array([[0], [37]])) & (jnp.arange(s)[None] < 150)
  k_pos = jnp.maximum(jnp.arange(s)[None] - jnp.array([[0], [37]]), 0)
  q_pos = jnp.array([[143], [106]]) + jnp.arange(t)[None] - 3
  _check(q, k, v, mask, q_pos, k_pos, config=kernel.DecodeConfig(block_kv=64, splits=3))


def test_two_row_tiles_and_value_width():
  """G·T = 8·7 + padding spills into a second 64-row tile; V != H."""
  b, t, n, kh, h, s = 1, 9, 8, 1, 64, 100
  q, k, v = _operands(b, t, n, kh, h, s, jnp.bfloat16, seed=2, vd=128)
  mask = jnp.arange(s)[None] >= 10
  q_pos = jnp.arange(t)[None] + 80
  _check(q, k, v, mask, q_pos, jnp.arange(s)[None], config=kernel.DecodeConfig(block_kv=64))


@pytest.mark.slow
@pytest.mark.parametrize("t, s", [(1, 1000), (7, 2049), (1, 5000), (7, 5000)])
def test_long_cache(t, s):
  b, n, kh, h = 1, 4, 2, 64
  q, k, v = _operands(b, t, n, kh, h, s, jnp.bfloat16, seed=s)
  mask = (jnp.arange(s)[None] >= 3) & (jnp.arange(s)[None] < s - 5)
  k_pos = jnp.arange(s)[None]
  q_pos = jnp.arange(t)[None] + s - 5 - t
  _check(q, k, v, mask, q_pos, k_pos)


def test_bad_inputs_raise():
  q, k, v = _operands(1, 1, 2, 1, 64, 8, jnp.bfloat16)
  mask = jnp.ones((1, 8), bool)
  with pytest.raises(ValueError, match="key_mask"):
    kernel.decode_attention(q, k, v, scale=1.0, key_mask=mask[:, :4])
  with pytest.raises(ValueError, match="both"):
    kernel.decode_attention(q, k, v, scale=1.0, key_mask=mask, q_positions=jnp.zeros((1, 1)))
  q17, _, _ = _operands(1, 17, 2, 1, 64, 8, jnp.bfloat16)
  assert "at most 16" in kernel.unsupported_reason(q17, k, v)
  assert "bf16/fp16" in kernel.unsupported_reason(q.astype(jnp.float32), k, v)
  assert kernel.platform_reason() is not None  # CPU, outside the interpreter
  with pytest.raises(NotImplementedError, match="Hopper"):
    kernel.decode_attention(q, k, v, scale=1.0, key_mask=mask)
  with pytest.raises(ValueError, match="block_kv"):
    kernel.DecodeConfig(block_kv=96)


def test_splits_fill_the_gpu():
  """One sequence at 32k: the default plan's key splits give about 4 CTAs per SM (132 SMs), two
  of whose rings fit in an SM's SMEM."""
  for h, bk in ((64, 128), (128, 64)):  # RoPE, PoPE's Cartesian keys
    plan = kernel._plan(kernel.DecodeConfig(), 1, 32768, 12, 1, h, 64, jnp.bfloat16)
    ctas = plan.splits * 12 * plan.row_tiles
    assert plan.block_kv == bk and 3 * 132 <= ctas <= 5 * 132, ctas
    assert plan.splits * plan.tiles_per_split * plan.block_kv >= 32768
    ring = plan.stages * kernel._stage_bytes(plan.block_kv, h, 64, jnp.bfloat16)
    assert plan.stages >= 2 and 2 * ring < 227 * 1024


@pytest.mark.parametrize("t, n, kh, h, vd", [(1, 12, 12, 64, 64), (7, 4, 2, 128, 64),
                                             (16, 32, 8, 128, 128)])
def test_gpu_path_lowers_for_cuda(monkeypatch, t, n, kh, h, vd):
  """The register-operand wgmma and the TMA ring lower through Mosaic GPU to NVVM."""
  monkeypatch.setattr(_streaming, "interpreted", lambda: False)
  monkeypatch.setattr(kernel, "platform_reason", lambda: None)
  b, s = 2, 1000
  sds = jax.ShapeDtypeStruct
  fn = jax.jit(lambda q, k, v, m, qp, kp: kernel.decode_attention(
      q, k, v, scale=0.1, key_mask=m, q_positions=qp, k_positions=kp))
  text = fn.trace(sds((b, t, n, h), jnp.bfloat16), sds((b, s, kh, h), jnp.bfloat16),
                  sds((b, s, kh, vd), jnp.bfloat16), sds((b, s), bool), sds((b, t), jnp.int32),
                  sds((b, s), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  ops = set(re.findall(r"nvvm\.[a-z_.]+", text))
  assert "nvvm.cp.async.bulk.tensor.shared.cluster.global" in ops  # TMA loads
  assert "nvvm.wgmma.fence.aligned" in ops
