"""The compiled Pallas PoPE kernels on a Hopper GPU against the float32 XLA reference: the output
and the gradients of q, k, v and δ under a random cotangent, on every check shape of
`pallas_kernels.shapes` (lengths off the block grid, GQA, Tq < Tk, non-causal, V ≠ H, persistent
launches with several tiles per CTA, one-row decode, 8× magnitudes), in bf16 and fp16, with the
default block sizes and with `bounded_softmax`. Run with `python -m pytest -m gpu -n 0`."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from experiments._attention_paths import tile_scale
from pallas_kernels import pope_attention as kernel
from pallas_kernels.pope_attention_config import default_block_sizes
from pallas_kernels.shapes import SHAPES, random_inputs
from pope_jax import attention
from tests.gpu.checks import CHECK_SHAPES, over_tolerance, relative_error
from tests.pallas_kernels.entry import kernel_attention

# (input dtype, changes to the head dim's `default_block_sizes`; {} is the default path of
# `pope_attention(implementation="pallas")`). `bounded_softmax` is bf16 only.
VARIANTS = [("bfloat16", {}), ("float16", {}), ("bfloat16", {"bounded_softmax": True})]


def _inputs(shape_name: str, dtype):
  """The shape's inputs (seed 1) and a float32 cotangent [B, T, N, V]. Queries of shapes at
  input scale 1 get `tile_scale` on every other forward query tile, so `bounded_softmax` sees
  bounded and online-softmax tiles in one launch."""
  shape = SHAPES[shape_name]
  q, k, v, delta = random_inputs(shape, jnp.dtype(dtype), seed=1)
  rows = kernel.forward_tile_rows(default_block_sizes(shape.head_dim), shape.head_dim,
                                  shape.value_dim, q.dtype)
  if shape.input_scale == 1.0:
    q = q * tile_scale(q.shape[1], rows).astype(q.dtype)
  cotangent = jax.random.normal(jax.random.key(2), q.shape[:3] + (shape.value_dim,), jnp.float32)
  return (q, k, v, delta), cotangent


def _value_and_grads(attend, args, cotangent):
  """(output, (dq, dk, dv, dδ)) of attend(q, k, v, δ) under `cotangent`, jitted."""
  def loss(*args):
    out = attend(*args)
    return (out.astype(jnp.float32) * cotangent).sum(), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
  return out, grads


@pytest.mark.parametrize("dtype,change", VARIANTS,
                         ids=[f"{d}-{'+'.join(c) or 'default'}" for d, c in VARIANTS])
@pytest.mark.parametrize("shape_name", CHECK_SHAPES)
def test_compiled_kernel_matches_reference(shape_name, dtype, change):
  shape = SHAPES[shape_name]
  args, cotangent = _inputs(shape_name, dtype)
  if change:
    blocks = dataclasses.replace(default_block_sizes(shape.head_dim), **change)
    pallas = lambda *a: kernel_attention(*a, is_causal=shape.is_causal, block_sizes=blocks)
  else:
    pallas = lambda *a: attention.pope_attention(*a, is_causal=shape.is_causal,
                                                 implementation="pallas")
  xla = lambda *a: attention.pope_attention(*a, is_causal=shape.is_causal, implementation="xla")
  out, grads = _value_and_grads(pallas, args, cotangent)
  ref, ref_grads = _value_and_grads(xla, args, cotangent)
  errors = {key: relative_error(x, y) for key, x, y in zip(
      ("out", "dq", "dk", "dv", "ddelta"), (out, *grads), (ref, *ref_grads))}
  assert not over_tolerance(shape_name, errors), errors
