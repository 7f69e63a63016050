"""Fused PoPE attention on Hopper GPUs (Pallas Mosaic GPU), forward and backward.

PoPE (arXiv 2509.10534, Eq. 5/6) is ordinary attention over the 2H-wide Cartesian vectors
  q'_t = [μq cos(tθ - δ), μq sin(tθ - δ)],  k'_s = [μk cos sθ, μk sin sθ],  μ = softplus.
XLA maps the keys (`key_map`); the forward kernel maps each query tile and saves it for the
backward kernels, which apply the maps' VJP (`pope_attention_bwd`). Tables of concrete positions
are trace-time constants (`_positions`). Design and measurements: docs/kernel.md.

Shape letters: B batch, T query and S key length, N query and K kv heads, H head dim, V value dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _streaming as st
from pallas_kernels.pope_attention_bwd import pope_attention_dkv, pope_attention_dq
from pallas_kernels.pope_attention_config import BlockSizes, default_block_sizes
from pallas_kernels.pope_attention_fwd import (BOUNDED_SCORE_LIMIT, TABLE_DTYPE, ForwardPlan,
                                               plan_forward, pope_attention_fwd)

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (32, 64, 128)
# Wider values overflow SMEM at the default blocks (H = 128, V = 192: 270 KB in the forward).
MAX_VALUE_DIM = 128
_LOG2E = 1.0 / math.log(2.0)


def is_supported(q, k, v) -> bool:
  """Whether the kernel runs these operands (arrays or `jax.ShapeDtypeStruct`s)."""
  return unsupported_reason(q, k, v) is None


def unsupported_reason(q, k, v) -> str | None:
  """Why the kernel cannot run q [B, T, N, H], k [B, S, K, H], v [B, S, K, V], or None: one
  dtype of SUPPORTED_DTYPES, H in SUPPORTED_HEAD_DIMS, V <= MAX_VALUE_DIM, N % K == 0, and
  `jax_enable_x64` off (int32 index arithmetic)."""
  if jax.config.jax_enable_x64:
    return ("pallas PoPE attention runs with jax_enable_x64 off (its index arithmetic is "
            "int32); use implementation='xla' under x64, or jax.enable_x64(False) around it")
  if not (q.ndim == 4 and jnp.dtype(q.dtype) in SUPPORTED_DTYPES
          and q.shape[-1] in SUPPORTED_HEAD_DIMS):
    return (f"pallas PoPE attention takes query dtype in {[str(d) for d in SUPPORTED_DTYPES]} "
            f"and head dim in {SUPPORTED_HEAD_DIMS}; got query {q.dtype} {q.shape}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    return (f"pallas PoPE attention needs one dtype for query, key, value; got {q.dtype}, "
            f"{k.dtype}, {v.dtype}")
  if mismatch := _mismatch(q, k, v):
    return mismatch
  if v.shape[-1] > MAX_VALUE_DIM:
    return f"value head dim {v.shape[-1]} exceeds {MAX_VALUE_DIM}"
  return None


def _mismatch(q, k, v) -> str | None:
  """Why q, k, v do not agree as [B, T, N, H], [B, S, K, H], [B, S, K, V], or None."""
  if (k.ndim != 4 or v.ndim != 4 or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]
      or q.shape[2] % k.shape[2] or k.shape[:3] != v.shape[:3]):
    return (f"query {q.shape} [B, T, N, H], key {k.shape} [B, S, K, H] and value {v.shape} "
            f"[B, S, K, V] do not agree (one batch B, N a multiple of K)")
  return None


def platform_reason() -> str | None:
  """Why the kernel cannot run here, or None (`_streaming.hopper_reason`)."""
  reason = st.hopper_reason("pallas PoPE attention")
  return reason and (f"{reason}; use implementation='xla' or None (or "
                     f"plgpu.force_gpu_interpret_mode() for tests)")


def _pad_to(x, length: int, axis: int, value=0):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The kernels' static schedule, resolved once per call (`_plan`) and passed down."""
  blocks: BlockSizes
  inference: ForwardPlan  # the forward without saving a
  training: ForwardPlan   # the forward saving a for the backward


def _plan(blocks: BlockSizes, h: int, value_dim: int, dtype, *, per_head_frequencies=False,
          segments=False) -> _Plan:
  """The schedule; per-head θ map the queries from their angles in the kernel (no tables)."""
  vd = -(-value_dim // 64) * 64
  def forward(save_a):
    plan = plan_forward(blocks, h, vd, dtype, save_a)
    return dataclasses.replace(plan, segments=segments,
                               tables=plan.tables and not per_head_frequencies)
  return _Plan(blocks, forward(False), forward(True))


def _resident_blocks(plan: _Plan) -> tuple[tuple[int, int, bool, int], ...]:
  """Per kernel (forward, dq, dk/dv): resident and streamed tile sizes, whether the resident
  tiles are queries, resident tiles per item (one per compute warpgroup, one with `dkv_roles`)."""
  b = plan.blocks
  return ((b.block_q, b.block_kv, True, plan.inference.warpgroups),
          (b.block_q_dq, b.block_kv_dq, True, st.COMPUTE_WGS),
          (b.block_kv_dkv, b.block_q_dkv, False, 1 if b.dkv_roles else st.COMPUTE_WGS))


def query_table(angle_pos, freqs):
  """cos(pos·θ), sin(pos·θ) [2, B or 1, T, H] in `TABLE_DTYPE` (pos·θ in float32) from
  angle_pos [B or 1, T] float32 and freqs [H] float32 θ (`ForwardPlan.tables`)."""
  ang = angle_pos[:, :, None] * freqs
  return jnp.stack([jnp.cos(ang), jnp.sin(ang)]).astype(TABLE_DTYPE)


def key_table(k_positions, freqs):
  """[cos sθ, sin sθ] [B or 1, S, 1 or K, 2H] float32 (sθ one float32 product) from k_positions
  [S] or [B, S] and freqs [H] or per kv head [K, H] float32 θ: the factor of `key_map`."""
  pos = k_positions.astype(jnp.float32)
  freqs = freqs.reshape(-1, freqs.shape[-1])                                        # [1|K, H]
  ang = (pos if pos.ndim == 2 else pos[None])[:, :, None, None] * freqs[None, None]
  return jnp.concatenate([jnp.cos(ang), jnp.sin(ang)], axis=-1)


def key_map(k, k_trig):
  """Cartesian keys b = [μk cos sθ, μk sin sθ] [B, S, K, 2H] in k's dtype (Eq. 7-10; δ is on
  the queries), μk = `_streaming.softplus`(k), from k [B, S, K, H] and its `key_table`."""
  mag = st.softplus(jnp.concatenate([k, k], axis=-1))
  return (mag * k_trig).astype(k.dtype)


def tile_score_bound(q, k, magnitude_scale: float, tile_rows: int) -> jax.Array:
  """An upper bound on |score| · `magnitude_scale` (the kernel's: logit scale times log2 e) per
  query tile of `tile_rows` rows (the last may hold fewer) over all keys of its kv head,
  [B, N, ceil(T / tile_rows)] float32, from raw q [B, T, N, H] and k [B, S, K, H] (N % K == 0).

  |q'_t| = |softplus(q_t)| (Eq. 7-10): by Cauchy-Schwarz |a_ts| <= max |softplus(q_t)| · max
  |softplus(k_s)| for any positions and phase; softplus(x) <= max(x, 0) + log 2 bounds them."""
  bsz, t_len, n_heads, _ = q.shape

  def norm_bound(x):  # >= |softplus(x)| over the last axis, float32
    return jnp.sqrt(jnp.square(jnp.maximum(x.astype(jnp.float32), 0.0) + math.log(2)).sum(-1))

  q_norm = _pad_to(norm_bound(q), -(-t_len // tile_rows) * tile_rows, 1)            # [B, T', N]
  q_norm = q_norm.reshape(bsz, -1, tile_rows, n_heads).max(2)                       # [B, R, N]
  k_norm = jnp.repeat(norm_bound(k).max(1), n_heads // k.shape[2], axis=1)          # [B, N]
  return (q_norm * k_norm[:, None, :] * abs(magnitude_scale)).transpose(0, 2, 1)


def forward_tile_rows(blocks: BlockSizes, head_dim: int, value_dim: int, dtype) -> int:
  """Query rows per CTA item of the forward kernel, the unit of `bounded_tiles`: `block_q`
  times the compute warpgroups (192 at the default blocks of H <= 64 where three fit)."""
  return _plan(blocks, head_dim, value_dim, dtype).inference.tile_rows


def bounded_tiles(q, k, magnitude_scale: float, tile_rows: int) -> jax.Array:
  """[B, N, ceil(T / tile_rows)] int32, 1 where `tile_score_bound` (same arguments) is within
  BOUNDED_SCORE_LIMIT: the tiles that skip the running max (`BlockSizes.bounded_softmax`)."""
  bound = tile_score_bound(q, k, magnitude_scale, tile_rows)
  return (bound <= BOUNDED_SCORE_LIMIT).astype(jnp.int32)


class _Operands(NamedTuple):
  """The kernels' operands that no gradient flows to (`_positions`, `_prepare`)."""
  freqs: jax.Array      # [H] or per query head [N, H] float32 θ
  angle_pos: jax.Array  # [B or 1, T_pad] float32 query angle positions
  q_table: jax.Array | None  # `query_table`, where a forward reads it
  k_trig: jax.Array     # `key_table`
  q_pos: jax.Array      # [B, T_pad] float32 masking positions with padding sentinels
  k_pos: jax.Array      # [B, S_pad] likewise
  tables: tuple         # per kernel (forward, dq, dk/dv): its visit table and schedule
  segments: tuple | None  # float32 segment ids (q [B, T_pad], k [B, S_pad]), or None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, phase, k, v, operands: _Operands, plan: _Plan, magnitude_scale: float,
           cartesian_map, key_len: int):
  """The attention output of the padded q, v, raw k (of length `key_len`) and the query phase
  -δ, differentiable in those four."""
  return _forward(q, phase, k, v, operands, plan.inference, magnitude_scale)[1][0]


def _forward(q, phase, k, v, o: _Operands, plan: ForwardPlan, magnitude_scale):
  """The key map (`key_map`), zero-padded to the values' length, then the forward kernel (with
  bounded flags only under `bounded_softmax`)."""
  b = _pad_to(key_map(k, o.k_trig), v.shape[1], 1)
  bounded = (bounded_tiles(jax.lax.stop_gradient(q), jax.lax.stop_gradient(k), magnitude_scale,
                           plan.tile_rows) if plan.bounded else None)
  if plan.tables:  # the query angles: tables of pos·θ and the phase's cos, sin
    rot, trig = (jnp.cos(phase), jnp.sin(phase)), o.q_table
  else:  # θ, the phase and the angle positions
    rot, trig = (o.freqs, phase), o.angle_pos
  return b, pope_attention_fwd(q, rot, trig, b, v, o.q_pos, o.k_pos, *o.tables[0], bounded,
                               o.segments, plan=plan, magnitude_scale=magnitude_scale)


def _query_vjp_in_kernel(dtype) -> bool:
  """Whether the dq kernel applies the query map's VJP (returning dq and dφ in q's dtype). Not
  for fp16, whose range loses dφ ∝ da·a for raw queries below about -6 (13 % of δ's gradient):
  there XLA maps the kernel's da in float32 (the caller's `cartesian_map`)."""
  return jnp.dtype(dtype) != jnp.dtype(jnp.float16)


def _flash_fwd(q, phase, k, v, operands, plan, magnitude_scale, cartesian_map, key_len):
  b, (out, lse, a) = _forward(q, phase, k, v, operands, plan.training, magnitude_scale)
  query = () if _query_vjp_in_kernel(q.dtype) else (q, phase)  # for the map's VJP in XLA
  return out, (a, b, v, operands._replace(q_table=None, k_trig=None), out, lse, query)


def _flash_bwd(plan, magnitude_scale, cartesian_map, key_len, res, d_out):
  a, b, v, o, out, lse, query = res
  delta = jnp.einsum("btnv,btnv->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
  d_out = d_out.astype(a.dtype)
  args = (a, b, v, d_out, lse, delta, o.q_pos, o.k_pos)
  # The dq kernel maps da to dq and each angle's gradient (summed into the phase's), or returns da.
  dq_out = pope_attention_dq(*args, *o.tables[1], o.segments, blocks=plan.blocks,
                             magnitude_scale=None if query else magnitude_scale)
  if not query:
    dq, d_angle = dq_out
    dphase = d_angle.astype(jnp.float32).sum((0, 1))
  else:  # da through the reference map's VJP (float32), as the kernel's `cartesian_halves`.
    if cartesian_map is None:
      raise ValueError("float16 gradients of pallas PoPE attention need `cartesian_map` (the "
                       "reference map `pope_jax.encodings.polar_to_cartesian`)")
    ang = o.angle_pos[:, :, None, None] * o.freqs[None, None]            # [B|1, T_pad, 1, H]
    def query_map(q, phase):
      return (cartesian_map(q, ang, phase) * magnitude_scale).astype(q.dtype)
    _, map_vjp = jax.vjp(query_map, *query)
    dq, dphase = map_vjp(dq_out)
  dk, dv = pope_attention_dkv(*args, *o.tables[2], o.segments, blocks=plan.blocks)
  bsz, s_pad, kv_heads = b.shape[:3]
  group = a.shape[2] // kv_heads
  if group > 1:  # each GQA group's sum, in float32
    dk, dv = (x.reshape(bsz, s_pad, kv_heads, group, x.shape[-1]).astype(jnp.float32).sum(3)
              .astype(a.dtype) for x in (dk, dv))
  dk = dk[:, :key_len]  # k is not padded (b is, after the map).
  return dq, dphase, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=("batch", "t_len", "s_len", "is_causal", "plan"))
def _position_operands(q_positions, k_positions, key_mask, segment_ids, *, batch: int,
                       t_len: int, s_len: int, is_causal: bool, plan: _Plan):
  """The kernels' masking operands: float32 positions with padding sentinels [B, T_pad],
  [B, S_pad] (keys outside `key_mask` [B, S] bool, if given, are padding too), float32 segment
  ids [B, T_pad], [B, S_pad] (padded with the last id) from `segment_ids` (q [B, T], kv [B, S]
  int) or None, and per kernel its `st.visit_table`."""
  q_pos = jnp.broadcast_to(jnp.asarray(q_positions), (batch, t_len)).astype(jnp.float32)
  k_pos = jnp.broadcast_to(jnp.asarray(k_positions), (batch, s_len))
  mult = plan.blocks.seq_multiple
  t_pad, s_pad = -(-t_len // mult) * mult, -(-s_len // mult) * mult
  qp = q_pos if is_causal else jnp.full(q_pos.shape, st.QUERY_SEES_ALL)
  qp = _pad_to(qp, t_pad, 1, st.QUERY_PAD)
  kp = k_pos.astype(jnp.float32)
  if key_mask is not None:
    kp = jnp.where(key_mask, kp, st.KEY_PAD)
  kp = _pad_to(kp, s_pad, 1, st.KEY_PAD)
  segs = None
  if segment_ids is not None:
    segs = tuple(jnp.pad(x.astype(jnp.float32), ((0, 0), (0, n - x.shape[1])), mode="edge")
                 for x, n in zip(segment_ids, (t_pad, s_pad)))
  def visits(row_block, col_block, queries, wgs):
    rows, cols = (0, 1) if queries else (1, 0)
    pos, seg = (qp, kp), segs or (None, None)
    return st.visit_table(pos[rows], pos[cols], row_block, col_block, rows_are_queries=queries,
                          wgs=wgs, row_seg=seg[rows], col_seg=seg[cols])
  return qp, kp, segs, tuple(visits(*kernel) for kernel in _resident_blocks(plan))


# Concrete positions' angle tables up to this size (3 MiB at T = S = 4096, H = 64) are constants.
MAX_CONSTANT_TABLE_BYTES = 4 << 20
# Positions travel to the kernels as float32, exact below this magnitude.
MAX_POSITION = 2**24


def _angle_tables(angle_pos, k_angle_pos, freqs, k_freqs, *, query_tables: bool):
  """(`query_table` of θ `freqs` or None without `query_tables`, `key_table` of `k_freqs`)."""
  q_table = query_table(angle_pos, freqs) if query_tables else None
  return q_table, jax.lax.stop_gradient(key_table(k_angle_pos, k_freqs))


@functools.lru_cache(maxsize=8)
def _constant_angle_tables(keys: tuple, **kw):
  """`_angle_tables` at trace time from (shape, float32 bytes) keys, one array object per distinct
  positions, so a model's layers share one constant; keeps the 8 most recent (at most 32 MiB)."""
  arrays = [np.frombuffer(data, np.float32).reshape(shape) for shape, data in keys]
  with jax.ensure_compile_time_eval():
    return _angle_tables(*arrays, **kw)


@functools.partial(jax.jit, static_argnames=("is_causal", "plan"))
def _prepare(q, k, v, delta, positions, *, is_causal, plan):
  """Operands: padded q, the query phase -δ, raw k (`_forward` maps and pads it), padded v,
  `_positions`' arrays, and per kernel its visit table and `st.launch_schedule`."""
  bsz, t_len, n_heads, h = q.shape
  # δ on the query side as -δ (the same score as δ on the keys, Eq. 5).
  phase = jnp.zeros((n_heads, h), jnp.float32) if delta is None else -delta.astype(jnp.float32)
  angle_pos, q_table, k_trig, qp, kp, segs, visits = positions
  t_pad, s_pad = qp.shape[1], kp.shape[1]
  qr = _pad_to(q, t_pad, 1)
  vp = _pad_to(_pad_to(v, s_pad, 1), plan.inference.vd, 3)  # V to a multiple of 64 (`_plan`)
  offset = max(k.shape[1] - t_len, 0)

  def schedule(row_block, col_block, rows_are_queries, wgs):
    n_rows, n_cols = (t_pad, s_pad) if rows_are_queries else (s_pad, t_pad)
    tile_rows = wgs * row_block
    n_tiles = -(-n_rows // tile_rows)
    steps = st.causal_steps(n_tiles, tile_rows, n_cols, col_block, offset,
                            causal=is_causal, rows_are_queries=rows_are_queries)
    return jnp.asarray(st.launch_schedule(bsz, n_heads, n_tiles, steps,
                                          longest_last_tile=rows_are_queries))

  tables = tuple((visit, schedule(*kernel))
                 for visit, kernel in zip(visits, _resident_blocks(plan)))
  return qr, phase, k, vp, angle_pos, q_table, k_trig, qp, kp, tables, segs


def _is_traced(x) -> bool:
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def _positions(q_positions, k_positions, freqs, k_freqs, key_mask, segment_ids, *, batch, t_len,
               s_len, is_causal, plan):
  """`_position_operands` and `_angle_tables`, at trace time unless an array is traced (the
  angle tables up to MAX_CONSTANT_TABLE_BYTES; the query table where a forward reads it).
  Raises ValueError for concrete positions or segment ids of magnitude MAX_POSITION or more."""
  kw = dict(batch=batch, t_len=t_len, s_len=s_len, is_causal=is_causal, plan=plan)
  traced = _is_traced((q_positions, k_positions, freqs, k_freqs))
  named = (("q_positions", q_positions), ("k_positions", k_positions),
           *zip(("q_segment_ids", "kv_segment_ids"), segment_ids or ()))
  for name, pos in named:
    largest = 0 if _is_traced(pos) else int(np.abs(np.asarray(pos, np.int64)).max(initial=0))
    if largest >= MAX_POSITION:
      raise ValueError(f"{name} must lie within ±2**24 for the pallas kernel (float32 "
                       f"in the kernel); got magnitude {largest}; use implementation='xla'")
  masks_traced = _is_traced((key_mask, segment_ids))
  with jax.ensure_compile_time_eval() if not traced else contextlib.nullcontext():
    # float32 query angle positions [1 or B, T_pad] and key positions [S] / [B, S] unpadded
    angle_pos = _pad_to(jnp.asarray(q_positions).astype(jnp.float32).reshape(-1, t_len),
                        -(-t_len // plan.blocks.seq_multiple) * plan.blocks.seq_multiple, 1)
    k_angle_pos = jnp.asarray(k_positions).astype(jnp.float32)
  with (jax.ensure_compile_time_eval() if not (traced or masks_traced)
        else contextlib.nullcontext()):
    qp, kp, segs, visits = _position_operands(q_positions, k_positions, key_mask, segment_ids,
                                              **kw)
  arrays = (angle_pos, k_angle_pos, freqs, k_freqs)
  table_kw = dict(query_tables=plan.inference.tables or plan.training.tables)
  tables = () if traced else jax.tree.leaves(jax.eval_shape(
      functools.partial(_angle_tables, **table_kw), *arrays))
  if tables and sum(x.size * x.dtype.itemsize for x in tables) <= MAX_CONSTANT_TABLE_BYTES:
    keys = tuple((np.shape(x), np.asarray(x, np.float32).tobytes()) for x in arrays)
    q_table, k_trig = _constant_angle_tables(keys, **table_kw)
  else:
    q_table, k_trig = _angle_tables(*arrays, **table_kw)
  return angle_pos, q_table, k_trig, qp, kp, segs, visits


def _check_masks(q, k, frequencies, key_mask, q_segment_ids, kv_segment_ids) -> None:
  """Raises ValueError naming the argument whose shape or dtype does not fit q [B, T, N, H] and
  k [B, S, K, H]."""
  (bsz, t_len, n_heads, h), s_len = q.shape, k.shape[1]
  if jnp.shape(frequencies) not in ((h,), (n_heads, h)):
    raise ValueError(f"frequencies must be [H] = [{h}] or per query head [N, H] = "
                     f"[{n_heads}, {h}], got {jnp.shape(frequencies)}")
  if key_mask is not None and (jnp.shape(key_mask) != (bsz, s_len)
                               or jnp.result_type(key_mask) != jnp.bool_):
    raise ValueError(f"key_mask must be bool [B, S] = [{bsz}, {s_len}], got "
                     f"{jnp.result_type(key_mask)} {jnp.shape(key_mask)}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids are given together or not at all")
  for name, ids, length in (("q_segment_ids", q_segment_ids, t_len),
                            ("kv_segment_ids", kv_segment_ids, s_len)):
    if ids is not None and (jnp.shape(ids) != (bsz, length)
                            or not jnp.issubdtype(jnp.result_type(ids), jnp.integer)):
      raise ValueError(f"{name} must be integer [B, {'T' if length == t_len else 'S'}] = "
                       f"[{bsz}, {length}], got {jnp.result_type(ids)} {jnp.shape(ids)}")


def pope_attention(q, k, v, delta=None, *, frequencies, q_positions, k_positions,
                   is_causal: bool = False, key_mask=None, q_segment_ids=None,
                   kv_segment_ids=None, scale: float | None = None,
                   block_sizes: BlockSizes | None = None, cartesian_map=None):
  """Fused PoPE attention (PoPE Eq. 5/6), differentiable in q, k, v and δ; called by
  `pope_jax.pope_attention(implementation="pallas")` with checked positions.

  Args:
    q: [B, T, N, H] raw queries (before softplus), bf16 or fp16.
    k: [B, S, K, H] raw keys, same dtype; N % K == 0.
    v: [B, S, K, V] values, same dtype.
    delta: None or [N, H] float32 phase bias δ, already clamped to [-2π, 0].
    frequencies: [H] float32 θ_c = base^(-c/H) (`pope_jax.encodings.pope_frequencies`), or
      per query head [N, H] (θ_c times a head's multiplier); under GQA the keys of kv head j
      take query head j·N/K's row (`pope_jax.encodings.kv_head_multiplier`).
    q_positions, k_positions: [T] / [S] or [B, T] / [B, S] integer positions; concrete ones (and
      `frequencies`) give trace-time constant tables (`_positions`), traced ones small XLA ops.
    is_causal: key s visible to query t iff k_pos[s] <= q_pos[t].
    key_mask: None or [B, S] bool, False for keys no query sees (padding, left or right).
    q_segment_ids, kv_segment_ids: None or [B, T] and [B, S] integer ids within ±2**24 (packed
      documents): query t sees key s only where their ids are equal (and, causal, as above).
      Tiles that no query can see are skipped; the two are given together.
    scale: logit scale, default 1/sqrt(H).
    block_sizes: tile sizes; default `default_block_sizes(H)`.
    cartesian_map: the reference map (x, angles, phase) -> [μ cos φ, μ sin φ] float32
      (`pope_jax.encodings.polar_to_cartesian`); needed only for float16 gradients.

  Returns:
    [B, T, N, V] in q's dtype; zero rows where no key is visible (their gradients are zero).

  Raises:
    NotImplementedError: unsupported dtype, head dim, value dim or platform, or x64 on.
    ValueError: q, k, v that do not agree; frequencies, key_mask or segment ids of the wrong
      shape or dtype; concrete positions or segment ids of magnitude MAX_POSITION or more; or
      `block_sizes` whose buffers do not fit in SMEM.
  """
  if reason := unsupported_reason(q, k, v):
    raise (ValueError if reason == _mismatch(q, k, v) else NotImplementedError)(reason)
  if reason := platform_reason():
    raise NotImplementedError(reason)
  _check_masks(q, k, frequencies, key_mask, q_segment_ids, kv_segment_ids)
  h, n_heads, kv_heads = q.shape[-1], q.shape[2], k.shape[2]
  per_head = jnp.ndim(frequencies) == 2
  segment_ids = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  plan = _plan(default_block_sizes(h) if block_sizes is None else block_sizes, h, v.shape[-1],
               q.dtype, per_head_frequencies=per_head, segments=segment_ids is not None)
  scale = 1.0 / math.sqrt(h) if scale is None else scale
  s_len, t_len = k.shape[1], q.shape[1]
  # A GQA group's keys take the θ of its first query head.
  k_freqs = frequencies[::n_heads // kv_heads] if per_head else frequencies
  positions = _positions(q_positions, k_positions, frequencies, k_freqs, key_mask, segment_ids,
                         batch=q.shape[0], t_len=t_len, s_len=s_len, is_causal=is_causal,
                         plan=plan)
  qr, phase, kr, vp, *rest = _prepare(q, k, v, delta, positions, is_causal=is_causal, plan=plan)
  out = _flash(qr, phase, kr, vp, _Operands(frequencies, *rest), plan, scale * _LOG2E,
               cartesian_map, s_len)
  return out[:, :t_len, :, :v.shape[-1]]
