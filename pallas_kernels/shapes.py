"""Named PoPE attention shapes shared by the kernel tests and the benchmark, and their inputs.

Shape letters: B batch, T query and S key length, N query and K kv heads, H head dim, V value dim.
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


def _shape(b: int, t: int, s: int, n: int, k: int, h: int, v: int, **kw) -> AttentionShape:
  """An `AttentionShape` from its letters B, T, S, N, K, H, V (and keyword fields)."""
  return AttentionShape(batch=b, q_len=t, k_len=s, num_heads=n, num_kv_heads=k, head_dim=h,
                        value_dim=v, **kw)


SHAPES: dict[str, AttentionShape] = {
    "bench_h64": _shape(4, 4096, 4096, 16, 16, 64, 64),
    "bench_h128": _shape(4, 4096, 4096, 16, 16, 128, 128),
    # Small problems for GPU correctness checks (lengths off the block grid, GQA, Tq < Tk).
    "check_h32_gqa": _shape(2, 200, 333, 4, 2, 32, 32),
    "check_h64": _shape(2, 1000, 1000, 4, 4, 64, 64),
    "check_h64_noncausal": _shape(1, 300, 777, 4, 1, 64, 64, is_causal=False),
    "check_h128": _shape(1, 513, 1024, 2, 1, 128, 128),
    # Value width other than the head dim: the forward stages queries in their own SMEM tile.
    "check_h128_v64": _shape(1, 400, 400, 2, 2, 128, 64),
    "check_h32_v96_gqa": _shape(1, 130, 260, 4, 1, 32, 96, is_causal=False),
    # More resident tiles than the H200's 132 SMs: each persistent CTA runs two or three.
    "check_h64_persistent": _shape(2, 3000, 3000, 8, 2, 64, 64),
    "check_h32_persistent": _shape(1, 2100, 2500, 16, 4, 32, 32),
    # KV-cache decoding: one query after 700 keys; the second warpgroup's rows are all padding.
    "check_h64_decode": _shape(2, 1, 700, 8, 2, 64, 64),
    # Large magnitudes (softplus up to ~25): bf16 q', k' move the scores by up to ~0.5 log2
    # units, a few % of the output, as in every expanded bf16 path (cuDNN, tokamax).
    "check_h64_large": _shape(1, 512, 512, 2, 1, 64, 64, input_scale=8.0),
}
# The GPU tests' (tests/gpu/) tolerances (max |error| / max |reference|) where bf16 operands alone
# exceed the default: check_h64_large 0.12 (output), <= 0.07 (gradients) in the interpreter.
CHECK_TOLERANCES: dict[str, float] = {"check_h64_large": 0.2}


def random_inputs(shape: AttentionShape, dtype=jnp.bfloat16, seed: int = 0):
  """Normal q [B, T, N, H], k [B, S, K, H] (std `shape.input_scale`) and v [B, S, K, V] (std 1)
  in `dtype`, a phase bias δ [N, H] float32 uniform in [-2π, 0), from `jax.random.key(seed)`."""
  ks = jax.random.split(jax.random.key(seed), 4)
  kv = (shape.batch, shape.k_len, shape.num_kv_heads)  # [B, S, K]
  q = jax.random.normal(ks[0], (shape.batch, shape.q_len, shape.num_heads, shape.head_dim), dtype)
  k = jax.random.normal(ks[1], (*kv, shape.head_dim), dtype)
  v = jax.random.normal(ks[2], (*kv, shape.value_dim), dtype)
  delta = jax.random.uniform(ks[3], (shape.num_heads, shape.head_dim), jnp.float32,
                             -2 * math.pi, 0.0)
  if shape.input_scale != 1.0:
    q, k = ((x.astype(jnp.float32) * shape.input_scale).astype(dtype) for x in (q, k))
  return q, k, v, delta


# Masked calls of one shape, shared by the GPU checks and experiments.bench_masked.
MASK_KINDS = ("right_padding", "left_padding", "packed", "multiplier")


def mask_inputs(shape: AttentionShape, kind: str, seed: int = 0) -> dict:
  """The masking keywords of one masked call of `shape` (`MASK_KINDS`), from
  `jax.random.key(seed)`: "right_padding" / "left_padding" a key_mask [B, S] bool of ragged
  lengths in [S/2, S] per row; "packed" q_segment_ids [B, T], kv_segment_ids [B, S] int32 of four
  documents per row at random boundaries (the queries the last T keys); "multiplier" a per-head
  frequency multiplier [N] float32 in [0.25, 1], one value per GQA group."""
  b, t_len, s_len = shape.batch, shape.q_len, shape.k_len
  key = jax.random.key(seed)
  if kind in ("right_padding", "left_padding"):
    lengths = jax.random.randint(key, (b, 1), s_len // 2, s_len + 1)
    idx = jnp.arange(s_len)[None]
    return {"key_mask": idx < lengths if kind == "right_padding" else idx >= s_len - lengths}
  if kind == "packed":
    starts = jnp.sort(jax.random.randint(key, (b, 3), 1, s_len), axis=1)          # [B, 3]
    k_seg = (jnp.arange(s_len)[None, :, None] >= starts[:, None, :]).sum(-1).astype(jnp.int32)
    return {"q_segment_ids": k_seg[:, s_len - t_len:] if t_len <= s_len
            else jnp.zeros((b, t_len), jnp.int32), "kv_segment_ids": k_seg}
  if kind == "multiplier":
    groups = shape.num_kv_heads
    per_group = jax.random.uniform(key, (groups,), jnp.float32, 0.25, 1.0)
    return {"multiplier": jnp.repeat(per_group, shape.num_heads // groups)}
  raise ValueError(f"kind must be one of {MASK_KINDS}, got {kind!r}")
