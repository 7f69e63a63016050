"""Forward kernel of fused PoPE attention: flash attention over the Cartesian PoPE form.

The kernel reads the raw queries q (H wide) and maps each resident tile in registers to
a = [μq cos(tθ-δ), μq sin(tθ-δ)]·scale·log2(e) (`cartesian_halves`), once per tile; it streams
b = [μk cos sθ, μk sin sθ] (PoPE, arXiv 2509.10534, Eq. 5/6 written as a dot product of 2H-wide
vectors) and computes O = softmax₂(a bᵀ) v with masking by position, where softmax₂ uses exp2
(the log2(e) is folded into a). It also returns the base-2 log-sum-exp per row for the backward
kernels and, when asked, a itself (their operand), so no separate pass maps the queries.

Shape letters: B batch, T padded query length, S padded key length, N query heads, K kv heads,
H head dim, D = 2H width of the Cartesian a and b, V value width (a multiple of 64).
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
from pallas_kernels.pope_attention_config import BlockSizes


# 2π in two parts for the range reduction of pos·θ: the first has 8 significant bits, so
# turns · _TWO_PI_HI is exact for |turns| < 2**16 (pos·θ below ~4e5 rad); above, its rounding
# adds at most half an ulp of the float32 pos·θ.
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 2 * math.pi - _TWO_PI_HI
# Query tiles whose scores (log2 units) are all bounded by this in magnitude (`bounded_softmax`;
# the kernel's scores, from bf16-rounded a and b, may exceed the bound by about 0.4 %) take exp2
# of the scores themselves: P stays within about 2**±64, its row sums below S·2**65 and P V
# below S·2**65·max|v|, inside float32's and bfloat16's range (normal from 2**-126 to 2**128)
# for S < 2**24 positions and |v| < 2**38.
BOUNDED_SCORE_LIMIT = 64.0
# Width of the ones tile and of the row-sum accumulator of `BlockSizes.row_sum_mma`: the
# narrowest wgmma B operand (a 32-byte swizzle of 16-bit elements).
ROW_SUM_COLS = 16
# The query angles' cos and sin tables of `BlockSizes.query_tables`: float16 holds [-1, 1] to
# 2**-12 (bfloat16 only to 2**-9, the precision of the kernel's bf16 Cartesian queries).
TABLE_DTYPE = jnp.float16


def cartesian_halves(x, pos, freq, phase, magnitude_scale: float, dtype):
  """In-kernel PoPE Cartesian map of one tile (PoPE Eq. 7-10; `encodings.polar_to_cartesian`).

  Args:
    x: [R, H] raw projections (any float dtype, WGMMA layout).
    pos: [R] float32 positions; freq, phase: [H] float32 θ_c and the phase added to pos·θ_c.
    magnitude_scale: factor applied to softplus(x).
    dtype: result dtype.

  Returns:
    (μ cos φ, μ sin φ)·magnitude_scale, each [R, H] in `dtype`, φ = pos·θ + phase, μ =
    softplus(x) (`_streaming.softplus`). As in the reference map, pos·θ is one
    float32 product and the phase is added without rounding it again: pos·θ is reduced to
    about [-π, π] first (Cody-Waite, 2π in two parts; the subtraction is exact below 4e5
    rad), then the phase (|phase| <= 2π) is added and the sum wrapped back by 2π. cos and sin
    run as the hardware approximations on the GPU (absolute error ~1e-6, below bf16's
    rounding).
  """
  rows, h = x.shape
  ang = st.broadcast(pos, (rows, h), 0) * st.broadcast(freq, (rows, h), 1)
  turns = jnp.round(ang * (1 / (2 * math.pi)))
  ang = ang - turns * _TWO_PI_HI - turns * _TWO_PI_LO + st.broadcast(phase, (rows, h), 1)
  ang = jnp.where(ang > math.pi, ang - 2 * math.pi, jnp.where(ang < -math.pi, ang + 2 * math.pi,
                                                              ang))
  mag = st.softplus(x) * magnitude_scale
  return (mag * jnp.cos(ang)).astype(dtype), (mag * jnp.sin(ang)).astype(dtype)


def cartesian_halves_from_tables(x, cos_t, sin_t, cos_p, sin_p, magnitude_scale: float,
                                 dtype):
  """In-kernel PoPE Cartesian map of one tile from the cos and sin of its angles (PoPE Eq.
  7-10; `BlockSizes.query_tables`), by angle addition as `encodings._cos_sin`.

  Args:
    x: [R, H] raw projections (any float dtype, WGMMA layout).
    cos_t, sin_t: [R, H] cos(pos·θ) and sin(pos·θ) of the tile's rows (any float dtype; the
      kernel's tables are float16, `TABLE_DTYPE`).
    cos_p, sin_p: [H] float32 cos and sin of the phase added to pos·θ.
    magnitude_scale: factor applied to softplus(x).
    dtype: result dtype.

  Returns:
    (μ cos φ, μ sin φ)·magnitude_scale, each [R, H] in `dtype`, φ = pos·θ + phase, μ =
    softplus(x) (`_streaming.softplus`): cos φ = cos_t cos_p - sin_t sin_p and sin φ = sin_t
    cos_p + cos_t sin_p. Two transcendentals per element (the softplus) instead of the four
    of `cartesian_halves`, and no range reduction.
  """
  rows, h = x.shape
  cos_t, sin_t = cos_t.astype(jnp.float32), sin_t.astype(jnp.float32)
  cos_p, sin_p = st.broadcast(cos_p, (rows, h), 1), st.broadcast(sin_p, (rows, h), 1)
  mag = st.softplus(x) * magnitude_scale
  return ((mag * (cos_t * cos_p - sin_t * sin_p)).astype(dtype),
          (mag * (sin_t * cos_p + cos_t * sin_p)).astype(dtype))


def bounded_softmax(blocks: BlockSizes, dtype) -> bool:
  """Whether the forward takes the softmax without a running max on bounded query tiles
  (`BlockSizes.bounded_softmax`): for bfloat16 only, whose P has float32's exponent range
  (fp16's P would overflow above 2**16)."""
  return blocks.bounded_softmax and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)


def _q_in_o(blocks: BlockSizes, h: int, vd: int) -> bool:
  # Without `persistent`, the query tile is staged in the output tile's SMEM when the two have
  # one width (the output is written only after the last step), which leaves room for a third
  # stage at H = 128. A persistent CTA loads the next item's queries while it runs this one, so
  # they get their own buffer. The CPU interpreter runs persistent launches as one tile per CTA
  # (`_streaming.num_sms`) and with this layout too (docs/results, run 15).
  return h == vd and not (blocks.persistent and not st.interpreted())


def _a_in_smem(blocks: BlockSizes, h: int, vd: int, save_a: bool) -> bool:
  # The Cartesian query tile a has its own SMEM tile when it is QKᵀ's SMEM operand, or when it
  # is saved and cannot pass through the output tile's (2 halves of width H = V).
  return not blocks.a_in_registers or (save_a and h != vd)


def _scratch(blocks: BlockSizes, stages: int, h: int, vd: int, dtype, save_a: bool,
             tables: bool) -> list:
  """The forward kernel's SMEM buffers and barriers, in the kernel's argument order (`tables`:
  `use_query_tables`)."""
  bq, bk, d, wgs = blocks.block_q, blocks.block_kv, 2 * h, blocks.forward_warpgroups
  tf = st.tile_transforms()
  scratch = [plgpu.SMEM((wgs, bq, d), dtype, transforms=tf)] if _a_in_smem(
      blocks, h, vd, save_a) else []
  if tables:  # cos and sin of the query angles (`pope_attention.query_angles`)
    trig = [plgpu.SMEM((wgs, bq, h), TABLE_DTYPE, transforms=st.tile_transforms(h))] * 2
  else:  # the query angles' positions
    trig = [plgpu.SMEM((wgs, bq), jnp.float32)]
  scratch += [
      plgpu.SMEM((wgs, bq, vd), dtype, transforms=tf),
      plgpu.SMEM((wgs, bq), jnp.float32),
      plgpu.SMEM((wgs, bq), jnp.float32),
      plgpu.SMEM((wgs, 2, h), jnp.float32),
      *trig,
      plgpu.SMEM((stages, bk, d), dtype, transforms=tf),
      plgpu.SMEM((stages, bk, vd), dtype, transforms=tf),
      plgpu.SMEM((stages, bk), jnp.float32),
      plgpu.Barrier(num_arrivals=3 + len(trig), num_barriers=wgs),
      plgpu.Barrier(num_barriers=wgs),
      st.ready_barrier(stages, 3),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
      # the ping-pong handshake of two warpgroups, or the turns of `st.RingSchedule`
      plgpu.Barrier(num_arrivals=wgs) if wgs == 2 else plgpu.Barrier(num_barriers=wgs),
  ]
  if not _q_in_o(blocks, h, vd):
    scratch.append(plgpu.SMEM((wgs, bq, h), dtype, transforms=st.tile_transforms(h)))
  if blocks.row_sum_mma:
    scratch.append(plgpu.SMEM((wgs, bk, ROW_SUM_COLS), dtype,
                              transforms=st.tile_transforms(ROW_SUM_COLS)))
  return scratch


def resolve_forward(blocks: BlockSizes, h: int, vd: int, dtype) -> BlockSizes:
  """`blocks` with the forward's schedule decided where it is None: `forward_warpgroups` None
  becomes 3 where three warpgroups' buffers fit in SMEM at the forward's least depth
  (`stages_fwd`, else `stages`; see `forward_stages`) with a saved for the backward, without
  the query tables (`st.smem_bytes` against `st.smem_limit`; not with `overlap`), else 2: one
  answer for the forward of inference and of training, whose visit tables it shapes. Then
  `ping_pong` None becomes True with two warpgroups and False with three (docs/results, run
  29).

  Args:
    blocks: tile sizes; h: PoPE head dim H; vd: value width V (padded to a multiple of 64);
    dtype: q's dtype.
  """
  wgs = blocks.forward_warpgroups
  if wgs is not None and blocks.ping_pong is not None:
    return blocks
  if wgs is None:
    wgs = 2
    if not blocks.overlap:
      three = dataclasses.replace(blocks, forward_warpgroups=3, ping_pong=False)
      least = blocks.stages if blocks.stages_fwd is None else blocks.stages_fwd
      if st.smem_bytes(_scratch(three, least, h, vd, dtype, True, False)) <= st.smem_limit():
        wgs = 3
  ping_pong = wgs == 2 if blocks.ping_pong is None else blocks.ping_pong
  return dataclasses.replace(blocks, forward_warpgroups=wgs, ping_pong=ping_pong)


def forward_stages(blocks: BlockSizes, h: int, vd: int, dtype, save_a: bool) -> int:
  """The forward's pipeline depth: `blocks.stages_fwd`, or if that is None max(3, stages)
  where its buffers fit in SMEM (`st.smem_bytes` against `st.smem_limit`), else `stages`.

  Args:
    blocks: tile sizes; h: PoPE head dim H; vd: value width V (padded to a multiple of 64);
    dtype: q's dtype; save_a: whether the forward saves a for the backward (training).
  """
  if blocks.stages_fwd is not None:
    return blocks.stages_fwd
  blocks = resolve_forward(blocks, h, vd, dtype)
  deep = max(3, blocks.stages)
  fits = st.smem_bytes(_scratch(blocks, deep, h, vd, dtype, save_a, False)) <= st.smem_limit()
  return deep if fits else blocks.stages


def use_query_tables(blocks: BlockSizes, h: int, vd: int, dtype, save_a: bool) -> bool:
  """Whether the forward maps the queries from cos and sin tables: `blocks.query_tables`,
  where the tables' SMEM tiles fit beside the `forward_stages` pipeline (they never cost a
  stage; e.g. not at H = 64 with V = 128). Arguments as `forward_stages`."""
  blocks = resolve_forward(blocks, h, vd, dtype)
  stages = forward_stages(blocks, h, vd, dtype, save_a)
  return blocks.query_tables and (
      st.smem_bytes(_scratch(blocks, stages, h, vd, dtype, save_a, True)) <= st.smem_limit())


@functools.partial(jax.jit, static_argnames=('blocks', 'magnitude_scale', 'save_a'))
def pope_attention_fwd(q, rot, trig, b, v, q_pos, k_pos, table, schedule, bounded, *,
                       blocks: BlockSizes, magnitude_scale: float, save_a: bool = False):
  """Runs the forward kernel.

  Args:
    q: [B, T, N, H] bf16/fp16 raw queries (before softplus).
    rot, trig: the query angles, `pope_attention.query_angles`: where `use_query_tables`,
      rot = (cos, sin) of the query phase -δ, each [N, H] float32, and trig [2, B or 1, T, H]
      float16 the cos and sin of the positions' angles pos·θ; else rot = (θ [H], -δ [N, H])
      float32 and trig the positions [B or 1, T] float32, mapped in the kernel
      (`cartesian_halves`). Padding rows: any finite value.
    b: [B, S, K, D] Cartesian keys, same dtype, D = 2H.
    v: [B, S, K, V] values, same dtype.
    q_pos: [B, T] float32 query positions (padding rows: st.QUERY_PAD).
    k_pos: [B, S] float32 key positions (padding rows: st.KEY_PAD).
    table: [B, ceil(T / (W block_q)), 2 + 4 W] int32 from `st.visit_table`, W =
      `blocks.forward_warpgroups`.
    schedule: the CTAs' items, int32 from `st.launch_schedule` (queries resident, tiles of
      W block_q rows).
    bounded: under `bounded_softmax`, [B, N, ceil(T / (W block_q))] int32, 1 where every score of
      the tile is within ±BOUNDED_SCORE_LIMIT (`pope_attention.bounded_tiles`); else None.
    blocks: tile sizes.
    magnitude_scale: factor of the query magnitudes (the logit scale times log2 e).
    save_a: also return the Cartesian queries a.

  Returns:
    out [B, T, N, V] in q's dtype (zero rows where no key is visible),
    lse [B, N, T] float32 base-2 log-sum-exp (1e30 where no key is visible) and, if save_a,
    a [B, T, N, D] in q's dtype.
  """
  bsz, t_len, n_heads, h = q.shape
  _, s_len, kv_heads, vd = v.shape
  d = 2 * h
  group = n_heads // kv_heads
  dtype = q.dtype
  blocks = resolve_forward(blocks, h, vd, dtype)
  stages = forward_stages(blocks, h, vd, dtype, save_a)
  tables = use_query_tables(blocks, h, vd, dtype, save_a)
  if trig.ndim != (4 if tables else 2):
    raise ValueError(f"trig has shape {trig.shape}; use_query_tables is {tables} here")
  bq, bk, wgs = blocks.block_q, blocks.block_kv, blocks.forward_warpgroups
  n_tiles = -(-t_len // (wgs * bq))
  grid = schedule.shape[0]
  q_in_o, a_in_smem = _q_in_o(blocks, h, vd), _a_in_smem(blocks, h, vd, save_a)

  # The CPU interpreter runs each warpgroup as its own XLA:CPU execution, and on a 2-core machine
  # not all of them start at once. Two ways this can hang there, both seen under jit:
  # - the ping-pong handshake needs both compute warpgroups running together (warpgroup 0
  #   waiting in the handshake, the TMA warpgroup waiting for releases, warpgroup 1 not
  #   started), so interpreted runs (tests) keep the plain schedule; the GPU check of
  #   experiments.bench_attention covers the ping-pong one;
  # - at some shapes (e.g. H = 32, V = 96) XLA:CPU's concurrency-optimised scheduler runs one
  #   warpgroup's blocking barrier waits while the others never start; tests/conftest.py turns
  #   that scheduler off (--xla_cpu_enable_concurrency_optimized_scheduler=false).
  ping_pong = blocks.ping_pong and not st.interpreted()
  registers, memory_registers = st.warpgroup_registers(wgs)

  def query_rows(tile, wg):
    """(rows, live) of a warpgroup's query tile. Where T is not a multiple of the group's
    rows (three warpgroups), the tiles of the last group past the queries (which visit no
    keys, `st.visit_table`) load the last tile's rows and store nothing (live False); else
    every tile is live (None)."""
    start = (tile * wgs + wg) * bq
    if t_len % (wgs * bq) == 0:
      return pl.ds(start, bq), None
    return pl.ds(jnp.minimum(start, t_len - bq), bq), start < t_len

  def when_live(live, fn):
    if live is None:
      fn()
    else:
      pl.when(live)(fn)

  def pope_fwd_kernel(q_ref, rot0_ref, rot1_ref, trig_ref, b_ref, v_ref, qpos_ref, kpos_ref,
                      tab_ref, sched_ref, *rest):
    bnd_ref, *rest = rest if bounded is not None else (None, *rest)
    o_ref, lse_ref, *rest = rest
    if save_a:
      a_ref, *rest = rest
    if a_in_smem:
      a_smem, *rest = rest
    else:
      a_smem = None
    o_smem, qpos_smem, lse_smem, rot_smem, *rest = rest
    trig_smem, rest = rest[:2 if tables else 1], rest[2 if tables else 1:]
    (b_smem, v_smem, kpos_smem, q_bar, qpos_bar, ready, consumed, handshake_bar, *rest) = rest
    q_smem = o_smem if q_in_o else rest.pop(0)
    ones_smem = rest.pop(0) if blocks.row_sum_mma else None
    wg = lax.axis_index("wg")
    ring = st.RingSchedule(handshake_bar, wg, wgs) if ping_pong and wgs > 2 else None
    handshake = ((lambda: st.schedule_barrier(handshake_bar)) if ping_pong and ring is None
                 else None)
    # Under ping-pong: what opens and closes a run of ping-pong items, and what follows the
    # QKᵀ issue (`then`).
    if ring is not None:
      run_start, run_end, after_qk = ring.start, ring.end, ring.pass_on
    else:
      run_start = lambda: pl.when(wg == 1)(handshake)
      run_end = lambda: pl.when(wg == 0)(handshake)
      after_qk = handshake

    tile_of = lambda item: st.last_tile_first(item, n_heads, n_tiles)

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(registers, action="increase")
      item_of, count = st.cta_items(sched_ref)

      def load_queries(item):
        """Issues the copies of this warpgroup's query rows of an item: raw queries, the
        angles (`rot` and `trig`; to q_bar), and the masking positions (to qpos_bar)."""
        batch, head, tile = tile_of(item)
        rows, _ = query_rows(tile, wg)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[wg], q_bar.at[wg])
        for i, ref in enumerate((rot0_ref, rot1_ref)):
          plgpu.copy_gmem_to_smem(ref if rot[i].ndim == 1 else ref.at[head],
                                  rot_smem.at[wg, i], q_bar.at[wg])
        trig_batch = batch if trig.shape[-3 if tables else -2] > 1 else 0
        if tables:
          for i, buf in enumerate(trig_smem):
            plgpu.copy_gmem_to_smem(trig_ref.at[i, trig_batch, rows], buf.at[wg], q_bar.at[wg])
        else:
          plgpu.copy_gmem_to_smem(trig_ref.at[trig_batch, rows], trig_smem[0].at[wg],
                                  q_bar.at[wg])
        plgpu.copy_gmem_to_smem(qpos_ref.at[batch, rows], qpos_smem.at[wg], qpos_bar.at[wg])

      if not q_in_o:
        load_queries(item_of(0))
      if ones_smem is not None:  # P @ 1: the row sums of P (`BlockSizes.row_sum_mma`)
        ones_smem.at[wg][...] = plgpu.layout_cast(jnp.ones((bk, ROW_SUM_COLS), dtype),
                                                  plgpu.Layout.WGMMA)
        plgpu.commit_smem()
      def is_bounded(j):
        """Whether item j of this CTA takes the bounded softmax (the flag of its tile)."""
        if not bounded_softmax(blocks, dtype):
          return jnp.bool_(False)
        batch, head, tile = tile_of(item_of(jnp.clip(j, 0, count - 1)))
        return bnd_ref[batch, head, tile] != 0

      # Under ping-pong with two warpgroups, each step of an online-softmax item makes two
      # handshakes (after issuing its matmuls, after the softmax; the overlapped schedule's
      # `last` makes none). Over each run of consecutive such items, warpgroup 1 makes one
      # more before the run's first step and warpgroup 0 one more after its last, so they
      # alternate, also across the run's items. With three, each step takes one turn of the
      # ring (`st.RingSchedule`, which opens and closes the runs likewise). Bounded items
      # (`bounded_softmax`; all warpgroups see the same tile's flag) make none: their
      # softmax is short enough that the warpgroups run side by side.
      def item_body(j, base):
        item = item_of(j)
        batch, head, tile = tile_of(item)
        rows, live = query_rows(tile, wg)
        bounded_item = is_bounded(j)
        if ping_pong:  # the start of a run of ping-pong items
          pl.when(~bounded_item & ((j == 0) | is_bounded(j - 1)))(run_start)
        if q_in_o:  # The previous item's output store must have read the tile first.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          load_queries(item)
        with jax.named_scope("wait_q"):
          plgpu.barrier_wait(q_bar.at[wg])
        with jax.named_scope("query_map"):
          x = plgpu.load(q_smem.at[wg], layout=plgpu.Layout.WGMMA)
          rot_rows = [st.row_vector(rot_smem.at[wg, i], 1) for i in range(2)]
          if tables:
            cos_t, sin_t = (plgpu.load(buf.at[wg], layout=plgpu.Layout.WGMMA)
                            for buf in trig_smem)
            halves = cartesian_halves_from_tables(x, cos_t, sin_t, *rot_rows, magnitude_scale,
                                                  dtype)
          else:
            halves = cartesian_halves(x, st.row_vector(trig_smem[0].at[wg], 0), *rot_rows,
                                      magnitude_scale, dtype)
          a = plgpu.layout_cast(jnp.concatenate(halves, axis=1), plgpu.Layout.WGMMA)
        plgpu.barrier_wait(qpos_bar.at[wg])
        qpos = st.row_vector(qpos_smem.at[wg], 0)
        if a_smem is not None:  # (after the previous item's store of a has read it)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          a_smem.at[wg][...] = a
        if a_smem is not None or not q_in_o:
          # Makes a visible to TMA and wgmma, and orders every thread's reads of the query
          # buffers before the next item's copies into them.
          plgpu.commit_smem()
        if not q_in_o:
          pl.when(j + 1 < count)(lambda: load_queries(item_of(j + 1)))
        if save_a and a_smem is not None:
          when_live(live, lambda: plgpu.copy_smem_to_gmem(a_smem.at[wg],
                                                          a_ref.at[batch, rows, head]))
        elif save_a:  # Each half through the output tile's SMEM (free until the final store,
          # which waits for the second half's copy to have read it).
          for i, half in enumerate(halves):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem.at[wg][...] = half
            plgpu.commit_smem()
            when_live(live, lambda i=i: plgpu.copy_smem_to_gmem(
                o_smem.at[wg], a_ref.at[batch, rows, head, pl.ds(i * h, h)]))
        # QKᵀ's left operand: a in registers (only b is then read from SMEM) or a's SMEM tile.
        a_lhs = a if blocks.a_in_registers else a_smem.at[wg]
        ranges = st.read_ranges(tab_ref, batch, tile, wg)
        origin = ranges[0] - base  # this item's first step is the ring's step `base`

        @jax.named_scope("wait_kv")
        def wait_step(s):
          slot = st.slot_of(s, origin, stages)
          plgpu.barrier_wait(ready.at[slot])
          return slot

        def scores(slot):
          return a_lhs, b_smem.at[slot].transpose((1, 0)), (bq, bk)

        @jax.named_scope("softmax")
        def softmax(s_blk, m_i, l_i, slot, mode, cast=True, bounded=False):
          """Online softmax of one score tile: (m, l, P, alpha), alpha the per-row factor of
          the old acc (`rescale`; 1 where the max stays, None: no rescale); P in q's dtype if
          `cast`, else float32. Under `blocks.rescale_threshold` a row's max m moves only
          when its block max exceeds it by more than that, so P <= 2**rescale_threshold.
          With `bounded` (every score within ±BOUNDED_SCORE_LIMIT) m stays 0: P =
          exp2(scores), no max and no rescale. Under `row_sum_mma` the returned l lacks this
          step's P, which `pv` adds, and its rescale, which `rescale` applies."""
          if mode == "masked":
            kpos = st.row_vector(kpos_smem.at[slot], 1)
            visible = st.broadcast(kpos, (bq, bk), 1) <= st.broadcast(qpos, (bq, bk), 0)
            s_blk = jnp.where(visible, s_blk, st.NEG_INF)
          if bounded:
            p = jnp.exp2(s_blk)
            if ones_smem is None:
              l_i = l_i + p.sum(axis=1)
            return m_i, l_i, p.astype(dtype) if cast else p, None
          m_blk = s_blk.max(axis=1)
          if blocks.rescale_threshold is None:
            m_new = jnp.maximum(m_i, m_blk)
          else:
            m_new = jnp.where(m_blk > m_i + blocks.rescale_threshold, m_blk, m_i)
          alpha = jnp.exp2(m_i - m_new)  # 1 where the max stays
          p = jnp.exp2(s_blk - st.broadcast(m_new, (bq, bk), 0))
          if ones_smem is None:  # (else [bq, ROW_SUM_COLS], rescaled with acc; P @ 1 in `pv`)
            l_i = l_i * alpha + p.sum(axis=1)
          if cast:
            p = p.astype(dtype)
          return m_new, l_i, p, alpha

        def hand_over(*values, pp=ping_pong):
          """Under ping-pong (`pp`): finish computing `values`, then the handshake that hands the
          tensor cores to the other warpgroup. As compiled, ptxas still moves the handshake's
          arrive (it depends on no register) to the start of the softmax; only its wait stays
          here (docs/results/attention_kernel.md, run 12)."""
          if not pp:
            return values
          values = lax.optimization_barrier(values)
          handshake()
          return values

        def rescale(acc, l_i, alpha):
          """acc, and under `row_sum_mma` l, times `softmax`'s per-row alpha; under
          `blocks.rescale_threshold` only in the warps where some row's max moved (alpha < 1;
          in the others every alpha is 1)."""
          scaled = (acc,) if ones_smem is None else (acc, l_i)
          times_alpha = lambda: tuple(x * st.broadcast(alpha, x.shape, 0) for x in scaled)
          if blocks.rescale_threshold is None:
            scaled = times_alpha()
          else:
            scaled = lax.cond(st.warp_any(alpha < 1.0), times_alpha, lambda: scaled)
          return scaled if ones_smem is not None else (scaled[0], l_i)

        def pv(acc, l_i, p, slot):
          """acc + P V and, under `row_sum_mma`, l + P 1, issued together."""
          if ones_smem is None:
            return st.matmul_acc(acc, p, v_smem.at[slot]), l_i
          return st.matmul_accs((acc, l_i), p, (v_smem.at[slot], ones_smem.at[wg]))

        def skip(s, carry, pp=ping_pong):
          plgpu.barrier_arrive(consumed.at[wait_step(s)])
          if pp and ring is not None:
            ring.wait()
            ring.pass_on()
          elif pp:
            handshake()
            handshake()
          return carry

        def step(s, carry, mode, bounded=False):
          """One step as written: QKᵀ, softmax, then PV, each awaited; with ping-pong handshakes
          unless `bounded`."""
          pp = ping_pong and not bounded
          if mode == "skip":
            return skip(s, carry, pp)
          acc, m_i, l_i = carry
          slot = wait_step(s)
          if pp and ring is not None:
            ring.wait()
          with jax.named_scope("qk"):
            s_blk = st.matmul(*scores(slot), then=after_qk if pp else None)
          m_i, l_i, p, alpha = softmax(s_blk, m_i, l_i, slot, mode, bounded=bounded)
          if alpha is not None:
            acc, l_i = rescale(acc, l_i, alpha)
          acc, m_i, l_i, p = hand_over(acc, m_i, l_i, p, pp=pp and ring is None)
          with jax.named_scope("pv"):
            acc, l_i = pv(acc, l_i, p, slot)
          plgpu.barrier_arrive(consumed.at[slot])
          return acc, m_i, l_i

        # The overlapped schedule (FlashAttention-3 §3.2): step s issues QKᵀ of s with PV of
        # s - 1, whose P it carries, and runs the softmax of s while PV runs; so a slot is released
        # one step later, after its PV. P is cast to q's dtype only after PV is awaited: ptxas
        # serialises the wgmmas when a wgmma operand register is written while one is in flight.
        def first(s, carry):
          acc, m_i, l_i, _ = carry
          slot = wait_step(s)
          with jax.named_scope("qk"):
            s_blk = st.matmul(*scores(slot), then=handshake)
          m_i, l_i, p, _ = softmax(s_blk, m_i, l_i, slot, "masked")
          m_i, l_i, p = hand_over(m_i, l_i, p)
          return acc, m_i, l_i, p

        def step_overlapped(s, carry, mode):
          acc, m_i, l_i, p_prev = carry
          slot, prev = wait_step(s), st.slot_of(s - 1, origin, stages)
          with jax.named_scope("qk_pv"):
            (m_i, l_i, p, alpha), acc = st.matmul_overlapped(
                *scores(slot), acc, p_prev, v_smem.at[prev],
                lambda s_blk: hand_over(*softmax(s_blk, m_i, l_i, slot, mode, cast=False)),
                then=handshake)
          plgpu.barrier_arrive(consumed.at[prev])
          acc, l_i = rescale(acc, l_i, alpha)
          return acc, m_i, l_i, p.astype(dtype)

        def last(s, carry):
          acc, m_i, l_i, p = carry
          slot = st.slot_of(s, origin, stages)
          with jax.named_scope("pv"):
            acc = st.matmul_acc(acc, p, v_smem.at[slot])
          plgpu.barrier_arrive(consumed.at[slot])
          return acc, m_i, l_i, p

        def loops(bounded):
          """The item's steps: (acc, m, l), m and l [bq] (l the row sums of exp2(s - m))."""
          acc = plgpu.layout_cast(jnp.zeros((bq, vd), jnp.float32), plgpu.Layout.WGMMA)
          m_i = plgpu.layout_cast(jnp.full((bq,), 0.0 if bounded else st.M_INIT, jnp.float32),
                                  plgpu.Layout.WGMMA.reduce(1))
          if ones_smem is None:
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
          else:
            l_i = plgpu.layout_cast(jnp.zeros((bq, ROW_SUM_COLS), jnp.float32),
                                    plgpu.Layout.WGMMA)
          if blocks.overlap:  # (BlockSizes refuses overlap with row_sum_mma, bounded_softmax)
            assert ones_smem is None and not bounded
            p = plgpu.layout_cast(jnp.zeros((bq, bk), dtype), plgpu.Layout.WGMMA)
            acc, m_i, l_i, _ = st.compute_loops_overlapped(
                ranges, (acc, m_i, l_i, p), skip, first, step_overlapped, last)
          else:
            acc, m_i, l_i = st.compute_loops(ranges, (acc, m_i, l_i),
                                             functools.partial(step, bounded=bounded))
          if ones_smem is not None:  # every column holds the row sums
            l_i = l_i.max(axis=1)
          return acc, m_i, l_i

        if bounded_softmax(blocks, dtype):  # per item: bounded scores skip the running max
          acc, m_i, l_i = lax.cond(bounded_item, lambda: loops(True), lambda: loops(False))
        else:
          acc, m_i, l_i = loops(False)

        with jax.named_scope("store"):
          # The copies of a (this item's) or of the output (the previous item's) must have
          # read the tiles first.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          empty = l_i == 0.0
          l_safe = jnp.where(empty, 1.0, l_i)
          o_smem.at[wg][...] = (acc / st.broadcast(l_safe, (bq, vd), 0)).astype(dtype)
          lse_smem.at[wg][...] = jnp.where(empty, 1e30,
                                           m_i + jnp.log(l_safe) * (1 / math.log(2)))
          plgpu.commit_smem()

          def store():
            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[batch, rows, head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, rows])
          when_live(live, store)
        if ping_pong:  # the end of a run of ping-pong items
          pl.when(~bounded_item & ((j == count - 1) | is_bounded(j + 1)))(run_end)
        return base + ranges[1] - ranges[0]

      lax.fori_loop(0, count, item_body, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == wgs)
    def _memory():
      st.stream_keys(st.for_each_item(sched_ref), tile_of, tab_ref, (b_ref, v_ref, kpos_ref),
                     (b_smem, v_smem, kpos_smem), group, bk, stages, consumed, ready,
                     memory_registers)

  scratch = _scratch(blocks, stages, h, vd, dtype, save_a, tables)
  st.check_smem(scratch, "forward", f"at {stages} stages (BlockSizes.stages_fwd="
                f"{blocks.stages_fwd}, stages={blocks.stages}) lower stages_fwd (or stages when "
                "it is None), block_kv or block_q"
                + ("" if blocks.a_in_registers else ", or set a_in_registers")
                + (", or set forward_warpgroups 2 (or None)" if wgs == 3 else ""))
  out_type = (jax.ShapeDtypeStruct((bsz, t_len, n_heads, vd), dtype),
              jax.ShapeDtypeStruct((bsz, n_heads, t_len), jnp.float32))
  if save_a:
    out_type += (jax.ShapeDtypeStruct((bsz, t_len, n_heads, d), dtype),)
  return plgpu.kernel(
      pope_fwd_kernel,
      out_type=out_type,
      scratch_types=scratch,
      grid=(grid,),
      grid_names=("cta",),
      num_threads=wgs + 1,
      thread_name="wg",
      compiler_params=st.compiler_params(),
  )(q, *rot, trig, b, v, q_pos, k_pos, table, schedule, *([] if bounded is None else [bounded]))
