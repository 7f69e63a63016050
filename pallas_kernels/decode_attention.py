"""Split-K decoding attention (flash-decoding) on Hopper: a few new queries against a long cache.

Plain softmax attention of already-mapped queries and keys (RoPE: rotated; PoPE: the Cartesian
form), so one kernel serves every encoding's KV-cache decoding:

    out[b, t, n] = Σ_s softmax_s(scale · q[b, t, n] · k[b, s, n // G]) v[b, s, n // G]

over the keys s visible to query t: key_mask[b, s], and with positions k_pos[b, s] <= q_pos[b, t]
(causal by absolute position, as `pope_jax.positions.attention_mask`). A row with no visible key
is zero.

The kernel (flash-decoding, Dao et al. 2023; FlashAttention-2's online softmax inside a split):
the G query heads of a kv head times the T new queries are the rows of one wgmma M tile (64 rows,
padded), so a kv head's keys are read once for its whole GQA group. The grid runs (split, kv head ×
row tile, batch): each CTA streams its split's key tiles through a ring of SMEM slots with TMA,
keeps the running (acc, m, l) in registers and writes a partial (o = acc / l, lse = m + log2 l).
A small XLA reduction combines the splits. The key tiles of a split that hold no visible key
(left padding, unwritten cache slots, keys after every query) are neither loaded nor computed; a
tile with some visible keys is masked in the kernel. Masked keys must hold finite values (a cache
from `pope_jax.positions.empty_kv_cache` holds zeros).

Shape letters: B batch, T new queries, S cache length, N query heads, K kv heads, G = N / K,
H q/k head dim, V value width, R rows of a kv head's group (G·T, padded to ROWS), P splits.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _streaming as st
from pallas_kernels import _warpgroup_ops as ops

# Rows of the wgmma M tile that holds a kv head's query rows (one warpgroup).
ROWS = 64
# The most new queries per call the kernel is meant for (decoding; prefill takes the flash kernels).
MAX_QUERIES = 16
# Head widths the SMEM tiles take (`_streaming.tile_transforms`).
WIDTHS = (16, 32, 64, 128, 192, 256)
_LOG2E = 1.0 / math.log(2.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
  """The kernel's tuning knobs (behaviour never depends on them).

  Attributes:
    block_kv: keys per streamed tile (a multiple of 64); None: 128 where H + V <= 128, else 64
      (so that two CTAs' rings fit in one SM's SMEM).
    splits: None (enough key splits for `ctas_per_sm` CTAs per SM), or the number of splits P.
    stages: None (as many ring slots as fit in half an SM's SMEM, 2 to 4), or the ring depth.
    ctas_per_sm: the grid size the default splits aim for, per SM: several waves of CTAs, two
      resident per SM, even out the splits' unequal work.
  """
  block_kv: int | None = None
  splits: int | None = None
  stages: int | None = None
  ctas_per_sm: int = 4

  def __post_init__(self):
    if self.block_kv is not None and (self.block_kv < 64 or self.block_kv % 64):
      raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")
    if self.splits is not None and self.splits < 1:
      raise ValueError(f"splits must be None or >= 1, got {self.splits}")
    if self.stages is not None and self.stages < 1:
      raise ValueError(f"stages must be None or >= 1, got {self.stages}")
    if self.ctas_per_sm < 1:
      raise ValueError(f"ctas_per_sm must be >= 1, got {self.ctas_per_sm}")


def platform_reason() -> str | None:
  """Why the kernel cannot run here, or None (`_streaming.hopper_reason`)."""
  return st.hopper_reason("the pallas decoding kernel")


def unsupported_reason(q, k, v) -> str | None:
  """Why the kernel does not take these operands (shapes [B, T, N, H], [B, S, K, H],
  [B, S, K, V]), or None."""
  if q.shape[1] > MAX_QUERIES:
    return f"the decoding kernel takes at most {MAX_QUERIES} new queries, got T = {q.shape[1]}"
  if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
    return (f"the decoding kernel needs one bf16/fp16 dtype for query, key and value, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}")
  if q.shape[-1] not in WIDTHS or v.shape[-1] not in WIDTHS:
    return (f"the decoding kernel needs q/k head dim and value width in {WIDTHS}, got "
            f"{q.shape[-1]} and {v.shape[-1]}")
  return None


def _num_sms() -> int:
  """SMs of the first device (132 on the H100 SXM; assumed in the interpreter)."""
  return getattr(jax.local_devices()[0], "core_count", 132) if not st.interpreted() else 132


def _stage_bytes(block_kv: int, h: int, vd: int, dtype) -> int:
  return block_kv * (h + vd) * jnp.dtype(dtype).itemsize + block_kv * 4


@dataclasses.dataclass(frozen=True)
class _Plan:
  block_kv: int
  splits: int
  tiles_per_split: int
  stages: int
  row_tiles: int
  store_rows: int      # rows of a tile's partial written back (T·G rounded up to 8 with one tile)


def _plan(config: DecodeConfig, b: int, s: int, kh: int, rows: int, h: int, vd: int,
          dtype) -> _Plan:
  """The grid and ring for these shapes: splits so that B·K·row tiles·P CTAs fill
  `ctas_per_sm` CTAs per SM, each split a whole number of key tiles."""
  bk = config.block_kv or (128 if h + vd <= 128 else 64)
  n_tiles = -(-s // bk)
  row_tiles = -(-rows // ROWS)
  if config.splits is None:
    units = b * kh * row_tiles
    splits = max(1, min(n_tiles, -(-config.ctas_per_sm * _num_sms() // units)))
  else:
    splits = min(config.splits, n_tiles)
  per_split = -(-n_tiles // splits)
  splits = -(-n_tiles // per_split)
  fixed = ROWS * h * jnp.dtype(dtype).itemsize + ROWS * vd * jnp.dtype(dtype).itemsize + 3 * ROWS * 4
  fit = (st.smem_limit() // 2 - fixed - 2048) // _stage_bytes(bk, h, vd, dtype)
  stages = min(config.stages or min(4, max(2, fit)), per_split)
  store_rows = ROWS if row_tiles > 1 else -(-rows // 8) * 8
  return _Plan(bk, splits, per_split, stages, row_tiles, store_rows)


def decode_attention(q, k, v, *, scale: float, key_mask, q_positions=None, k_positions=None,
                     config: DecodeConfig | None = None):
  """Attention of T <= 16 new queries over a KV cache, split over the keys (module docstring).

  Args:
    q: [B, T, N, H] bf16/fp16 mapped queries (rotated by RoPE, or PoPE's Cartesian form).
    k: [B, S, K, H] mapped keys, same dtype; v: [B, S, K, V] values, same dtype; N % K == 0.
    scale: the logit scale.
    key_mask: [B, S] bool, True for the cache's valid slots.
    q_positions, k_positions: both None (every valid slot visible to every query), or [B, T] and
      [B, S] int positions below 2**24: query t sees slot s iff k_pos[s] <= q_pos[t].
    config: tuning (`DecodeConfig`; default: its defaults).

  Returns:
    [B, T, N, V] in q's dtype; zero rows where no key is visible.

  Raises:
    ValueError: shapes that disagree, or only one of the positions.
    NotImplementedError: operands the kernel does not take (`unsupported_reason`), or not on
      Hopper nor in the interpreter (`platform_reason`).
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  vd = v.shape[-1]
  if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[-1] != h or n % kh:
    raise ValueError(f"query {q.shape}, key {k.shape} and value {v.shape} must be [B, T, N, H], "
                     f"[B, S, K, H], [B, S, K, V] with N % K == 0")
  if jnp.shape(key_mask) != (b, s):
    raise ValueError(f"key_mask must be [B, S] = {(b, s)}, got {jnp.shape(key_mask)}")
  if (q_positions is None) != (k_positions is None):
    raise ValueError("give both q_positions and k_positions, or neither")
  if q_positions is not None and (jnp.shape(q_positions) != (b, t)
                                  or jnp.shape(k_positions) != (b, s)):
    raise ValueError(f"q_positions and k_positions must be [B, T] = {(b, t)} and [B, S] = "
                     f"{(b, s)}, got {jnp.shape(q_positions)} and {jnp.shape(k_positions)}")
  if reason := unsupported_reason(q, k, v) or platform_reason():
    raise NotImplementedError(reason)
  plan = _plan(config or DecodeConfig(), b, s, kh, (n // kh) * t, h, vd, q.dtype)
  return _decode(q, k, v, key_mask, q_positions, k_positions, plan=plan,
                 scale=float(scale))


@functools.partial(jax.jit, static_argnames=("plan", "scale"))
def _decode(q, k, v, key_mask, q_positions, k_positions, *, plan: _Plan, scale: float):
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g, vd, bk = n // kh, v.shape[-1], plan.block_kv
  rows = plan.row_tiles * ROWS
  s_pad = plan.splits * plan.tiles_per_split * bk
  # Rows r = t·G + g of kv head k: [B, K, R, H].
  qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
  # Key slots that no query sees carry st.KEY_PAD; padding rows st.QUERY_PAD (they see nothing).
  if q_positions is None:
    kpos = jnp.where(key_mask, 0.0, st.KEY_PAD)
    qpos = jnp.full((b, t), st.QUERY_SEES_ALL, jnp.float32)
  else:
    kpos = jnp.where(key_mask, k_positions.astype(jnp.float32), st.KEY_PAD)
    qpos = q_positions.astype(jnp.float32)
  qpos = jnp.pad(jnp.repeat(qpos, g, axis=1), ((0, 0), (0, rows - t * g)),
                 constant_values=st.QUERY_PAD)
  kpos = jnp.pad(kpos.astype(jnp.float32), ((0, 0), (0, s_pad - s)), constant_values=st.KEY_PAD)
  if s % bk:  # a copy of the cache: callers avoid it with S a multiple of block_kv
    pad = ((0, 0), (0, -s % bk), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  ranges = _split_ranges(kpos, qpos.max(axis=1), plan)
  o, lse = _kernel_call(qr, k, v, qpos, kpos, ranges, plan=plan, scale=scale)
  out = _combine(o, lse)                                            # [B, K, R', V] float32
  out = out[:, :, :t * g].reshape(b, kh, t, g, vd).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, t, n, vd).astype(q.dtype)


def _split_ranges(kpos, last_query, plan: _Plan):
  """[B, P, 2] int32: per split the key tiles [lo, hi) from its first to its last tile holding a
  key that some query sees (lo = hi: none), from kpos [B, S'] and each row's latest query [B]."""
  b = kpos.shape[0]
  seen = (kpos <= last_query[:, None]).reshape(b, plan.splits, plan.tiles_per_split, -1).any(-1)
  idx = jnp.arange(plan.tiles_per_split, dtype=jnp.int32)
  first = plan.tiles_per_split * jnp.arange(plan.splits, dtype=jnp.int32)[None, :]
  lo = jnp.where(seen, idx, plan.tiles_per_split).min(-1)
  hi = jnp.where(seen, idx + 1, 0).max(-1)
  lo = jnp.minimum(lo, hi)
  return jnp.stack([first + lo, first + hi], axis=-1).astype(jnp.int32)


def _combine(o, lse):
  """The splits' partial outputs o [B, K, P, R, V] and base-2 lse [B, K, P, R] (-inf: no key)
  merged by their softmax weights: [B, K, R, V] float32, zero where no split saw a key."""
  top = lse.max(axis=2, keepdims=True)
  w = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))      # [B, K, P, R]
  total = w.sum(axis=2)
  out = jnp.einsum("bkpr,bkprv->bkrv", w, o.astype(jnp.float32))
  return out / jnp.where(total > 0, total, 1.0)[..., None]


def _kernel_call(qr, k, v, qpos, kpos, ranges, *, plan: _Plan, scale: float):
  """Runs the kernel: partial o [B, K, P, R', V] in q's dtype and lse [B, K, P, R'] float32,
  R' = row tiles · `store_rows` (the padding rows past T·G, up to 8, are not written back)."""
  b, kh, rows, h = qr.shape
  vd, dtype, bk, stages = v.shape[-1], qr.dtype, plan.block_kv, plan.stages
  logit_scale = scale * _LOG2E

  def body(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, range_ref, o_ref, lse_ref,
           q_smem, qpos_smem, k_smem, v_smem, kpos_smem, o_smem, lse_smem, q_bar, ready):
    split, unit, batch = (lax.axis_index(a) for a in ("split", "unit", "batch"))
    head, row_tile = lax.div(unit, plan.row_tiles), lax.rem(unit, plan.row_tiles)
    row_slice = pl.ds(row_tile * ROWS, ROWS)
    store_slice = pl.ds(row_tile * plan.store_rows, plan.store_rows)
    lo, hi = range_ref[batch, split, 0], range_ref[batch, split, 1]

    def fetch(tile, slot):
      keys = pl.ds(tile * bk, bk)
      plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, head], k_smem.at[slot], ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, head], v_smem.at[slot], ready.at[slot])
      plgpu.copy_gmem_to_smem(kpos_ref.at[batch, keys], kpos_smem.at[slot], ready.at[slot])

    for i in range(stages):
      pl.when(lo + i < hi)(functools.partial(fetch, lo + i, i))
    plgpu.copy_gmem_to_smem(q_ref.at[batch, head, row_slice], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(qpos_ref.at[batch, row_slice], qpos_smem, q_bar)
    plgpu.barrier_wait(q_bar)
    qpos = st.row_vector(qpos_smem, 0)
    wgmma = plgpu.Layout.WGMMA

    def step(tile, carry):
      acc, m_i, l_i = carry
      slot = lax.rem(tile - lo, stages)
      plgpu.barrier_wait(ready.at[slot])
      scores = ops.matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (ROWS, bk))
      scores = st.causal_mask(scores * logit_scale, st.row_vector(kpos_smem.at[slot], 1), qpos, 1)
      m_new = jnp.maximum(m_i, scores.max(axis=1))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(scores - st.broadcast(m_new, (ROWS, bk), 0))
      l_i = l_i * alpha + p.sum(axis=1)
      acc = acc * st.broadcast(alpha, acc.shape, 0)
      acc = ops.matmul_acc(acc, p.astype(dtype), v_smem.at[slot])
      pl.when(tile + stages < hi)(functools.partial(fetch, tile + stages, slot))
      return acc, m_new, l_i

    carry = (plgpu.layout_cast(jnp.zeros((ROWS, vd), jnp.float32), wgmma),
             plgpu.layout_cast(jnp.full((ROWS,), st.M_INIT, jnp.float32), wgmma.reduce(1)),
             plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), wgmma.reduce(1)))
    acc, m_i, l_i = lax.fori_loop(lo, hi, step, carry)
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    o_smem[...] = (acc / st.broadcast(l_safe, (ROWS, vd), 0)).astype(dtype)
    lse_smem[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log(l_safe) * _LOG2E)
    plgpu.commit_smem()
    stored = pl.ds(0, plan.store_rows)
    plgpu.copy_smem_to_gmem(o_smem.at[stored], o_ref.at[batch, head, split, store_slice])
    plgpu.copy_smem_to_gmem(lse_smem.at[stored], lse_ref.at[batch, head, split, store_slice])
    plgpu.wait_smem_to_gmem(0)

  scratch = (
      plgpu.SMEM((ROWS, h), dtype, transforms=st.tile_transforms(h)),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.SMEM((stages, bk, h), dtype, transforms=st.tile_transforms(h)),
      plgpu.SMEM((stages, bk, vd), dtype, transforms=st.tile_transforms(vd)),
      plgpu.SMEM((stages, bk), jnp.float32),
      plgpu.SMEM((ROWS, vd), dtype, transforms=st.tile_transforms(vd)),
      plgpu.SMEM((ROWS,), jnp.float32),
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_arrivals=3, num_barriers=stages),
  )
  stored = plan.row_tiles * plan.store_rows
  out_type = (jax.ShapeDtypeStruct((b, kh, plan.splits, stored, vd), dtype),
              jax.ShapeDtypeStruct((b, kh, plan.splits, stored), jnp.float32))
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(plan.splits, kh * plan.row_tiles, b), grid_names=("split", "unit", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True))(qr, k, v, qpos, kpos, ranges)
