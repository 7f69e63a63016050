"""Named PoPE attention shapes shared by the kernel tests and the benchmark, and their inputs.

Shape letters: B batch, T query length, S key length, N query heads, K kv heads, H head dim,
V value head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionShape:
  """One problem: q [B, T, N, H], k [B, S, K, H], v [B, S, K, V]; q and k are drawn
  N(0, input_scale²) (`random_inputs`)."""
  batch: int
  q_len: int
  k_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  value_dim: int
  is_causal: bool = True
  input_scale: float = 1.0

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"AttentionShape.num_heads {self.num_heads} must be a multiple of "
                       f"num_kv_heads {self.num_kv_heads}")
    if self.q_len > self.k_len and self.is_causal:
      raise ValueError(f"AttentionShape.q_len {self.q_len} exceeds k_len {self.k_len}")

  def forward_flops(self) -> float:
    """PoPE forward FLOPs: 2·T·S·2H (q'k'ᵀ) + 2·T·S·V (PV) per head, halved when causal."""
    flops = 2.0 * self.batch * self.num_heads * self.q_len * self.k_len * (
        2 * self.head_dim + self.value_dim)
    return flops / 2 if self.is_causal else flops


def _bench(head_dim: int) -> AttentionShape:
  return AttentionShape(batch=4, q_len=4096, k_len=4096, num_heads=16, num_kv_heads=16,
                        head_dim=head_dim, value_dim=head_dim)


SHAPES: dict[str, AttentionShape] = {
    "bench_h64": _bench(64),
    "bench_h128": _bench(128),
    # Small problems for GPU correctness checks (lengths off the block grid, GQA, Tq < Tk).
    "check_h32_gqa": AttentionShape(batch=2, q_len=200, k_len=333, num_heads=4, num_kv_heads=2,
                                    head_dim=32, value_dim=32),
    "check_h64": AttentionShape(batch=2, q_len=1000, k_len=1000, num_heads=4, num_kv_heads=4,
                                head_dim=64, value_dim=64),
    "check_h64_noncausal": AttentionShape(batch=1, q_len=300, k_len=777, num_heads=4,
                                          num_kv_heads=1, head_dim=64, value_dim=64,
                                          is_causal=False),
    "check_h128": AttentionShape(batch=1, q_len=513, k_len=1024, num_heads=2, num_kv_heads=1,
                                 head_dim=128, value_dim=128),
    # Value width other than the head dim: the forward stages queries in their own SMEM tile.
    "check_h128_v64": AttentionShape(batch=1, q_len=400, k_len=400, num_heads=2, num_kv_heads=2,
                                     head_dim=128, value_dim=64),
    "check_h32_v96_gqa": AttentionShape(batch=1, q_len=130, k_len=260, num_heads=4,
                                        num_kv_heads=1, head_dim=32, value_dim=96,
                                        is_causal=False),
    # More resident tiles than the H200's 132 SMs: each persistent CTA runs two or three (the
    # next tile's query prefetch and the ring of slots across tiles).
    "check_h64_persistent": AttentionShape(batch=2, q_len=3000, k_len=3000, num_heads=8,
                                           num_kv_heads=2, head_dim=64, value_dim=64),
    "check_h32_persistent": AttentionShape(batch=1, q_len=2100, k_len=2500, num_heads=16,
                                           num_kv_heads=4, head_dim=32, value_dim=32),
    # KV-cache decoding: one query after 700 keys; the second warpgroup's rows are all padding.
    "check_h64_decode": AttentionShape(batch=2, q_len=1, k_len=700, num_heads=8, num_kv_heads=2,
                                       head_dim=64, value_dim=64),
    # Large magnitudes (softplus up to ~25, scores up to ~200 log2 units): the bf16 rounding of
    # the Cartesian q' and k' (2**-9 relative) moves the scores by up to ~0.5, a few % of the
    # output; every expanded bf16 path (cuDNN, tokamax) rounds them the same way.
    "check_h64_large": AttentionShape(batch=1, q_len=512, k_len=512, num_heads=2,
                                      num_kv_heads=1, head_dim=64, value_dim=64,
                                      input_scale=8.0),
}
# `bench_attention --check` tolerances (max |error| / max |reference|, output and gradients)
# of shapes whose bf16 operands alone are off by more than the default. check_h64_large: 0.12
# (output) and <= 0.07 (gradients) in the CPU interpreter, where attention in float32 over
# q', k' rounded to bf16 is 0.12 off too (tests/pallas_kernels).
CHECK_TOLERANCES: dict[str, float] = {"check_h64_large": 0.2}


def random_inputs(shape: AttentionShape, dtype=jnp.bfloat16, seed: int = 0):
  """Normal q [B, T, N, H], k [B, S, K, H] (standard deviation `shape.input_scale`), standard
  normal v [B, S, K, V], in `dtype`, and a phase bias δ [N, H] float32 uniform in [-2π, 0),
  all from `jax.random.key(seed)`."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (shape.batch, shape.q_len, shape.num_heads, shape.head_dim), dtype)
  k = jax.random.normal(ks[1], (shape.batch, shape.k_len, shape.num_kv_heads, shape.head_dim),
                        dtype)
  v = jax.random.normal(ks[2], (shape.batch, shape.k_len, shape.num_kv_heads, shape.value_dim),
                        dtype)
  delta = jax.random.uniform(ks[3], (shape.num_heads, shape.head_dim), jnp.float32,
                             -2 * math.pi, 0.0)
  if shape.input_scale != 1.0:
    q, k = ((x.astype(jnp.float32) * shape.input_scale).astype(dtype) for x in (q, k))
  return q, k, v, delta
