"""The kernels' GPU code paths lowered for CUDA on a machine without a GPU.

The CPU interpreter runs the kernels with SMEM-operand matmuls and without the ping-pong
handshakes (`_streaming.interpreted`); these tests lower the paths that only the GPU runs
(register-operand wgmmas, the ping-pong handshakes, the backward's FlashAttention-3 order,
the epilogues) through Pallas' Mosaic GPU lowering to NVVM, so an op it cannot lower fails here
rather than on the GPU. They do not run ptxas or the kernels (tests/gpu/ does, on a GPU).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu import lowering

from pallas_kernels import _streaming
from pallas_kernels import pope_attention as kernel
from tests.pallas_kernels.entry import kernel_attention
from pallas_kernels.pope_attention_config import default_block_sizes

KERNELS = ("pope_fwd_kernel", "pope_dq_kernel", "pope_dkv_kernel")


@pytest.fixture
def gpu_paths(monkeypatch):
  monkeypatch.setattr(_streaming, "interpreted", lambda: False)
  monkeypatch.setattr(kernel, "platform_reason", lambda: None)


def _lowered_text(h, vd, n, kh, change, dtype=jnp.bfloat16, is_causal=True):
  blocks = dataclasses.replace(default_block_sizes(h), **change)
  q = jax.ShapeDtypeStruct((2, 200, n, h), dtype)
  k = jax.ShapeDtypeStruct((2, 300, kh, h), dtype)
  v = jax.ShapeDtypeStruct((2, 300, kh, vd), dtype)
  delta = jax.ShapeDtypeStruct((n, h), jnp.float32)

  def loss(q, k, v, delta):
    out = kernel_attention(q, k, v, delta, is_causal=is_causal, block_sizes=blocks)
    return out.astype(jnp.float32).sum()

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  return grad.trace(q, k, v, delta).lower(lowering_platforms=("cuda",)).as_text()


# (H, V, N, K, changes to `default_block_sizes`): each head dim's default schedules stay in the
# fast tier; the schedule switches are marked slow.
DEFAULT_SCHEDULES = [
    (64, 64, 2, 2, {}),
    (128, 128, 2, 1, {}),
    (128, 64, 2, 2, {}),
    (32, 96, 4, 1, {}),
    (64, 128, 2, 2, {}),
]
SWITCHES = [
    (64, 64, 2, 2, {"overlap_bwd": True, "block_kv_dq": 64, "block_q_dkv": 64}),
    (128, 128, 2, 2, {"ping_pong": True, "dkv_roles": False, "overlap_bwd": False}),
    (64, 64, 2, 2, {"dkv_roles": True, "overlap_bwd": True}),
    (64, 64, 2, 2, {"row_sum_mma": True}),
    (64, 64, 2, 2, {"bounded_softmax": True}),
    (64, 64, 2, 2, {"bounded_softmax": True, "forward_warpgroups": 2}),
    (64, 64, 2, 2, {"bounded_softmax": True, "row_sum_mma": True}),
    (128, 128, 2, 1, {"bounded_softmax": True, "row_sum_mma": False}),
    (64, 64, 2, 2, {"rescale_threshold": 0.0}),
    (128, 128, 2, 1, {"rescale_threshold": None}),
    (64, 64, 2, 2, {"forward_warpgroups": 2}),
    (64, 64, 2, 2, {"forward_warpgroups": 2, "ping_pong": False}),
    (64, 64, 2, 2, {"rescale_threshold": 8.0}),
]


@pytest.mark.parametrize("h, vd, n, kh, change", DEFAULT_SCHEDULES + [
    pytest.param(*case, marks=pytest.mark.slow) for case in SWITCHES])
def test_gpu_paths_lower_for_cuda(gpu_paths, h, vd, n, kh, change):
  text = _lowered_text(h, vd, n, kh, change)
  for name in KERNELS:
    assert name in text, name
  # Only the forward's conditional rescale (`rescale_threshold`) votes across lanes.
  blocks = dataclasses.replace(default_block_sizes(h), **change)
  assert ("nvvm.vote.sync" in text) == (blocks.rescale_threshold is not None)
  # Only the backward's FA3 order awaits a wgmma group with one left in flight.
  assert ("wgmma.wait_group.sync.aligned 1" in text) == blocks.overlap_bwd


@pytest.mark.parametrize("h", [64, 128])
def test_float16_lowers_for_cuda(gpu_paths, h):
  # fp16 takes the dq kernel's epilogue without the query map's VJP (`_query_vjp_in_kernel`);
  # at H = 128 the forward's row sums run on the tensor cores in fp16 (`row_sum_mma`).
  text = _lowered_text(h, h, 2, 2, {}, dtype=jnp.float16)
  for name in KERNELS:
    assert name in text, name


_LOWER = lowering.lower_unpipelined_jaxpr_to_module


def _kernel_modules(monkeypatch, h, change=None, n=2, kh=1, **masks):
  """The Mosaic GPU modules (forward, dq, dk/dv) of one forward+backward, as text without
  debug locations, lowered for CUDA; `masks` are the kernel's key_mask, segment-id and
  frequency arguments (a key is given per batch row of 2, 300 keys; queries 200)."""
  modules = []
  def capture(*args, **kw):
    result = _LOWER(*args, **kw)
    text = result.module.operation.get_asm(enable_debug_info=False)
    modules.append(re.sub(r'dump_basename = "\w+"', "", text))  # (a per-process counter)
    return result
  monkeypatch.setattr(lowering, "lower_unpipelined_jaxpr_to_module", capture)
  blocks = dataclasses.replace(default_block_sizes(h), **(change or {}))
  q = jax.ShapeDtypeStruct((2, 200, n, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 300, kh, h), jnp.bfloat16)
  delta = jax.ShapeDtypeStruct((n, h), jnp.float32)

  def loss(q, k, v, delta):
    out = kernel_attention(q, k, v, delta, is_causal=True, block_sizes=blocks, **masks)
    return out.astype(jnp.float32).sum()

  jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, k, k, delta).lower(
      lowering_platforms=("cuda",))
  assert len(modules) == 3
  return modules


SEGMENTS = dict(q_segment_ids=np.repeat(np.arange(200)[None] // 50, 2, 0).astype(np.int32),
                kv_segment_ids=np.repeat(np.arange(300)[None] // 50, 2, 0).astype(np.int32))


@pytest.mark.parametrize("h, change", [
    (64, {}),
    pytest.param(128, {}, marks=pytest.mark.slow),  # (about 100 s each on one core)
    pytest.param(64, {"dkv_roles": True}, marks=pytest.mark.slow),
    pytest.param(64, {"forward_warpgroups": 2}, marks=pytest.mark.slow)])
def test_masks_lower_for_cuda(gpu_paths, monkeypatch, h, change):
  # Segment ids add loads and compares to all three kernels; per-head θ maps the queries from
  # their angles (no tables); a key mask is only operands: the kernels are the unmasked ones.
  plain = _kernel_modules(monkeypatch, h, change)
  key_mask = np.arange(300)[None] >= np.array([[0], [37]])
  assert _kernel_modules(monkeypatch, h, change, key_mask=key_mask) == plain
  segmented = _kernel_modules(monkeypatch, h, change, key_mask=key_mask, **SEGMENTS)
  assert all(a != b for a, b in zip(segmented, plain))
  per_head = _kernel_modules(monkeypatch, h, change, n=2, kh=2, multiplier=np.array([1.0, 0.5]))
  assert per_head[1:] == _kernel_modules(monkeypatch, h, change, n=2, kh=2)[1:]
