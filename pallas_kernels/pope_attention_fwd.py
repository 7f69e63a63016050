"""Forward kernel of fused PoPE attention: flash attention over the Cartesian PoPE form.

Each resident query tile is mapped in registers to a = [μq cos(tθ-δ), μq sin(tθ-δ)]·scale·log2 e
(`cartesian_halves`, PoPE Eq. 7-10); b = [μk cos sθ, μk sin sθ] streams; O = softmax₂(a bᵀ) v
with masking by position. Also returns the base-2 log-sum-exp and, for the backward, a.

Shape letters: B batch, T padded query length, S padded key length, N query heads, K kv heads,
H head dim, D = 2H width of the Cartesian a and b, V value width (a multiple of 64), R rows of a
tile; bq resident query rows, bk streamed key rows of the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _streaming as st
from pallas_kernels import _warpgroup_ops as ops
from pallas_kernels.pope_attention_config import BlockSizes


# Tiles whose scores (log2 units) lie within ± this take exp2 of the scores (`bounded_softmax`):
# P, its row sums and P V stay in float32's and bf16's range for S < 2**24 and |v| < 2**38.
BOUNDED_SCORE_LIMIT = 64.0
# Width of `row_sum_mma`'s ones tile and row-sum accumulator: the narrowest wgmma B (32 bytes).
ROW_SUM_COLS = 16
# 2π in two parts (Cody-Waite): turns · _TWO_PI_HI is exact for |turns| < 2**16.
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 2 * math.pi - _TWO_PI_HI
# The query tables' dtype (`ForwardPlan.tables`): float16 holds [-1, 1] to 2**-12 (bf16: 2**-9).
TABLE_DTYPE = jnp.float16


def cartesian_halves(x, pos, freq, phase, magnitude_scale: float, dtype):
  """(μ cos φ, μ sin φ)·magnitude_scale, each [R, H] in `dtype` (PoPE Eq. 7-10), μ =
  softplus(x) of x [R, H], φ = pos·θ + phase from pos [R], freq θ and phase [H] float32: pos·θ
  one float32 product as in the reference, reduced to [-π, π] before the phase is added."""
  rows, h = x.shape
  ang = st.broadcast(pos, (rows, h), 0) * st.broadcast(freq, (rows, h), 1)
  turns = jnp.round(ang * (1 / (2 * math.pi)))
  ang = ang - turns * _TWO_PI_HI - turns * _TWO_PI_LO + st.broadcast(phase, (rows, h), 1)
  ang = jnp.where(ang > math.pi, ang - 2 * math.pi, jnp.where(ang < -math.pi, ang + 2 * math.pi,
                                                              ang))
  mag = st.softplus(x) * magnitude_scale
  return (mag * jnp.cos(ang)).astype(dtype), (mag * jnp.sin(ang)).astype(dtype)


def cartesian_halves_from_tables(x, cos_t, sin_t, cos_p, sin_p, magnitude_scale: float, dtype):
  """`cartesian_halves` from cos_t, sin_t [R, H] of pos·θ and cos_p, sin_p [H] float32 of the
  phase, by angle addition (`ForwardPlan.tables`): two transcendentals, not four."""
  rows, h = x.shape
  cos_t, sin_t = cos_t.astype(jnp.float32), sin_t.astype(jnp.float32)
  cos_p, sin_p = st.broadcast(cos_p, (rows, h), 1), st.broadcast(sin_p, (rows, h), 1)
  mag = st.softplus(x) * magnitude_scale
  return ((mag * (cos_t * cos_p - sin_t * sin_p)).astype(dtype),
          (mag * (sin_t * cos_p + cos_t * sin_p)).astype(dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardPlan:
  """The forward kernel's static schedule, decided once per call (`plan_forward`)."""
  blocks: BlockSizes
  h: int               # PoPE head dim H
  vd: int              # value width V (a multiple of 64)
  dtype: jnp.dtype     # q's
  warpgroups: int      # compute warpgroups W
  ping_pong: bool      # the two warpgroups' handshakes (the interpreter runs without)
  stages: int          # pipeline depth
  tables: bool         # the query map reads float16 cos, sin tables of pos·θ (half the SFU work)
  save_a: bool         # also returns a for the backward
  bounded: bool        # bf16 `bounded_softmax` (fp16's P would overflow above 2**16)
  segments: bool = False  # masks by segment ids too (packed documents)

  @property
  def tile_rows(self) -> int:
    """Query rows per CTA item (W block_q), the unit of the bounded flags."""
    return self.warpgroups * self.blocks.block_q


def plan_forward(blocks: BlockSizes, h: int, vd: int, dtype, save_a: bool) -> ForwardPlan:
  """The forward's schedule for head dim h, value width vd (a multiple of 64), q's dtype and
  whether a is saved: three warpgroups where `forward_warpgroups` is None and they fit (tested
  with a saved, no tables: one answer for both forwards), then max(3, stages), then the query
  tables, each where it fits."""
  def fits(**change):
    return st.smem_bytes(_scratch(dataclasses.replace(plan, **change))) <= st.smem_limit()

  plan = ForwardPlan(blocks=blocks, h=h, vd=vd, dtype=jnp.dtype(dtype), save_a=True,
                     warpgroups=blocks.forward_warpgroups or 2, ping_pong=False,
                     stages=blocks.stages, tables=False,
                     bounded=blocks.bounded_softmax and jnp.dtype(dtype) == jnp.bfloat16)
  if blocks.forward_warpgroups is None and fits(warpgroups=3):
    plan = dataclasses.replace(plan, warpgroups=3)
  plan = dataclasses.replace(plan, save_a=save_a,
                             ping_pong=blocks.ping_pong and plan.warpgroups == 2)
  if fits(stages=max(3, blocks.stages)):
    plan = dataclasses.replace(plan, stages=max(3, blocks.stages))
  return dataclasses.replace(plan, tables=fits(tables=True))


def _scratch(p: ForwardPlan) -> dict:
  """The forward kernel's SMEM buffers and barriers by name, in the kernel's argument order."""
  bq, bk, h, vd, wgs = p.blocks.block_q, p.blocks.block_kv, p.h, p.vd, p.warpgroups
  d, dtype, stages, tf = 2 * h, p.dtype, p.stages, st.tile_transforms()
  scratch = ({"a_smem": plgpu.SMEM((wgs, bq, d), dtype, transforms=tf)}
             if p.save_a and h != vd else {})  # a's own tile where V != H, else the output's
  if p.tables:  # cos and sin of the query angles (`pope_attention.query_table`)
    trig = (plgpu.SMEM((wgs, bq, h), TABLE_DTYPE, transforms=st.tile_transforms(h)),) * 2
  else:  # the query angles' positions
    trig = (plgpu.SMEM((wgs, bq), jnp.float32),)
  scratch |= {
      "o_smem": plgpu.SMEM((wgs, bq, vd), dtype, transforms=tf),
      "qpos_smem": plgpu.SMEM((wgs, bq), jnp.float32),
      "lse_smem": plgpu.SMEM((wgs, bq), jnp.float32),
      "rot_smem": plgpu.SMEM((wgs, 2, h), jnp.float32),
      "trig_smem": trig,
      "b_smem": plgpu.SMEM((stages, bk, d), dtype, transforms=tf),
      "v_smem": plgpu.SMEM((stages, bk, vd), dtype, transforms=tf),
      "kpos_smem": plgpu.SMEM((stages, bk), jnp.float32),
      "q_bar": plgpu.Barrier(num_arrivals=3 + len(trig), num_barriers=wgs),
      "qpos_bar": plgpu.Barrier(num_arrivals=1 + p.segments, num_barriers=wgs),
      "ready": plgpu.Barrier(num_arrivals=3 + p.segments, num_barriers=stages),
      "consumed": plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
      # the ping-pong handshake (with three warpgroups unused, as in the tuned programs)
      "handshake_bar": (plgpu.Barrier(num_arrivals=wgs) if wgs == 2
                        else plgpu.Barrier(num_barriers=wgs)),
      "q_smem": plgpu.SMEM((wgs, bq, h), dtype, transforms=st.tile_transforms(h)),
  }
  if p.segments:  # the query and key segment ids, beside their positions
    scratch |= {"qseg_smem": plgpu.SMEM((wgs, bq), jnp.float32),
                "kseg_smem": plgpu.SMEM((stages, bk), jnp.float32)}
  if p.blocks.row_sum_mma:
    scratch["ones_smem"] = plgpu.SMEM((wgs, bk, ROW_SUM_COLS), dtype,
                                      transforms=st.tile_transforms(ROW_SUM_COLS))
  return scratch


@functools.partial(jax.jit, static_argnames=("plan", "magnitude_scale"))
def pope_attention_fwd(q, rot, trig, b, v, q_pos, k_pos, table, schedule, bounded,
                       segments=None, *, plan: ForwardPlan, magnitude_scale: float):
  """Runs the forward kernel.

  Args:
    q: [B, T, N, H] bf16/fp16 raw queries (before softplus).
    rot, trig: with `plan.tables` (cos -δ, sin -δ) [N, H] and the query table (cos, sin of
      pos·θ [2, B or 1, T, H], `pope_attention.query_table`), else (θ [H] or per head [N, H],
      -δ [N, H]) and the query angles' positions [B or 1, T] float32.
    b: [B, S, K, D] Cartesian keys, same dtype, D = 2H; v: [B, S, K, V] values, same dtype.
    q_pos: [B, T], k_pos: [B, S] float32 positions (padding: st.QUERY_PAD, st.KEY_PAD).
    table, schedule: [B, ceil(T / (W block_q)), 2 + 4 W] `st.visit_table`, the CTAs' items
      (`st.launch_schedule`, queries resident), int32.
    bounded: with `plan.bounded`, [B, N, ceil(T / (W block_q))] int32, 1 where every score of
      the tile is within ±BOUNDED_SCORE_LIMIT (`pope_attention.bounded_tiles`); else None.
    segments: with `plan.segments`, the float32 segment ids (q [B, T], k [B, S]): a key is
      visible only to queries of its id; else None.
    plan: `plan_forward`'s; magnitude_scale: the logit scale times log2 e.

  Returns:
    out [B, T, N, V] in q's dtype (zero rows where no key is visible), lse [B, N, T] float32
    base-2 log-sum-exp (1e30 where no key is visible) and, with `plan.save_a`, a [B, T, N, D].

  Raises:
    ValueError: trig or bounded that do not match the plan, or buffers that exceed SMEM.
  """
  bsz, t_len, n_heads, h = q.shape
  vd = v.shape[-1]
  if (trig.ndim != (4 if plan.tables else 2) or (bounded is not None) != plan.bounded
      or (segments is not None) != plan.segments):
    raise ValueError(f"trig {trig.shape}, bounded flags ({bounded is not None}) and segment ids "
                     f"({segments is not None}) must match the plan's tables ({plan.tables}), "
                     f"bounded ({plan.bounded}) and segments ({plan.segments})")
  kernel = _ForwardKernel(plan, q, rot, trig, v, magnitude_scale)
  st.check_smem(kernel.scratch, "forward", f"at {plan.stages} stages lower BlockSizes.stages, "
                "block_kv or block_q" + (", or set forward_warpgroups 2 (or None)"
                                         if plan.warpgroups == 3 else ""))
  out_type = (jax.ShapeDtypeStruct((bsz, t_len, n_heads, vd), q.dtype),
              jax.ShapeDtypeStruct((bsz, n_heads, t_len), jnp.float32))
  if plan.save_a:
    out_type += (jax.ShapeDtypeStruct((bsz, t_len, n_heads, 2 * h), q.dtype),)
  return st.launch(kernel.pope_fwd_kernel, out_type, tuple(kernel.scratch.values()),
                   ctas=schedule.shape[0], compute_wgs=plan.warpgroups)(
      q, *rot, trig, b, v, q_pos, k_pos, table, schedule, *([] if bounded is None else [bounded]),
      *(segments or ()))


class _ForwardKernel:
  """The forward kernel's body: `pope_fwd_kernel` forks the warpgroups; each item of a compute
  warpgroup loads and maps its queries, runs its streamed steps (`_steps`) and stores (`_item`)."""

  def __init__(self, plan: ForwardPlan, q, rot, trig, v, magnitude_scale: float):
    self.plan, self.blocks, self.magnitude_scale = plan, plan.blocks, magnitude_scale
    self.bq, self.bk, self.wgs = plan.blocks.block_q, plan.blocks.block_kv, plan.warpgroups
    _, self.t_len, n_heads, _ = q.shape
    self.group = n_heads // v.shape[2]
    self.tile_of = functools.partial(st.item_coords, n_heads=n_heads, last_tile_first=True,
                                     n_tiles=-(-self.t_len // (self.wgs * self.bq)))
    self.rot_per_head = tuple(r.ndim != 1 for r in rot)  # θ [H] is shared by the heads
    self.trig_batched = trig.shape[-3 if plan.tables else -2] > 1
    # In the interpreter (warpgroups as separate XLA:CPU runs) the handshake can hang.
    self.ping_pong = plan.ping_pong and not st.interpreted()
    # Registers per thread (compute, memory warpgroup): an SM's 64 K split as FlashAttention-3 does.
    self.registers, self.memory_registers = (232, 40) if self.wgs == 2 else (160, 32)
    self.scratch = _scratch(plan)

  def query_rows(self, tile, wg):
    """(rows, live) of a warpgroup's query tile: tiles past T (three warpgroups) load the last
    rows and store nothing (`pl.when(live)`); live is True where every tile is live."""
    start = (tile * self.wgs + wg) * self.bq
    if self.t_len % (self.wgs * self.bq) == 0:
      return pl.ds(start, self.bq), True
    return pl.ds(jnp.minimum(start, self.t_len - self.bq), self.bq), start < self.t_len

  def pope_fwd_kernel(self, q_ref, rot0_ref, rot1_ref, trig_ref, b_ref, v_ref, qpos_ref,
                      kpos_ref, tab_ref, sched_ref, *rest):
    """The kernel: names the refs (the scratch as `_scratch` does) and forks the warpgroups."""
    rest = list(rest)
    bnd_ref = rest.pop(0) if self.plan.bounded else None
    qseg_ref, kseg_ref = (rest.pop(0), rest.pop(0)) if self.plan.segments else (None, None)
    o_ref, lse_ref = rest.pop(0), rest.pop(0)
    a_ref = rest.pop(0) if self.plan.save_a else None
    smem = ({"a_smem": None, "ones_smem": None, "qseg_smem": None, "kseg_smem": None}
            | dict(zip(self.scratch, rest)))
    self.refs = r = types.SimpleNamespace(
        q=q_ref, rot=(rot0_ref, rot1_ref), trig=trig_ref, qpos=qpos_ref, qseg=qseg_ref,
        tab=tab_ref, sched=sched_ref, bnd=bnd_ref, o=o_ref, lse=lse_ref, a=a_ref, **smem)
    per_key = ((kpos_ref, r.kpos_smem),) + (((kseg_ref, r.kseg_smem),) if self.plan.segments
                                             else ())
    wg = lax.axis_index("wg")
    pl.when(wg < self.wgs)(lambda: self._compute(wg))
    pl.when(wg == self.wgs)(lambda: st.stream_keys(
        st.for_each_item(sched_ref), self.tile_of, tab_ref,
        (b_ref, v_ref, *(g for g, _ in per_key)), (r.b_smem, r.v_smem, *(s for _, s in per_key)),
        self.group, self.bk, self.plan.stages, r.consumed, r.ready, self.memory_registers))

  def handshake(self):
    """One handshake of the two compute warpgroups' ping-pong (FlashAttention-3 §3.1): each
    passes when the other arrived, so one's softmax overlaps the other's matmuls."""
    with jax.named_scope("handshake"):
      plgpu.barrier_arrive(self.refs.handshake_bar)
      plgpu.barrier_wait(self.refs.handshake_bar)

  def _compute(self, wg):
    """A compute warpgroup: its CTA's items in turn."""
    r = self.refs
    plgpu.set_max_registers(self.registers, action="increase")
    self.item_of, self.count = st.cta_items(r.sched)
    self._load_queries(self.item_of(0), wg)
    if r.ones_smem is not None:  # P @ 1: the row sums of P (`BlockSizes.row_sum_mma`)
      r.ones_smem.at[wg][...] = plgpu.layout_cast(
          jnp.ones((self.bk, ROW_SUM_COLS), self.plan.dtype), plgpu.Layout.WGMMA)
      plgpu.commit_smem()
    lax.fori_loop(0, self.count, lambda j, base: self._item(j, base, wg), jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  def _load_queries(self, item, wg):
    """Issues the copies of an item's query rows, angles (q_bar) and positions (qpos_bar)."""
    r = self.refs
    batch, head, tile = self.tile_of(item)
    rows, _ = self.query_rows(tile, wg)
    plgpu.copy_gmem_to_smem(r.q.at[batch, rows, head], r.q_smem.at[wg], r.q_bar.at[wg])
    for i, ref in enumerate(r.rot):
      plgpu.copy_gmem_to_smem(ref.at[head] if self.rot_per_head[i] else ref,
                              r.rot_smem.at[wg, i], r.q_bar.at[wg])
    trig_batch = batch if self.trig_batched else 0
    for i, buf in enumerate(r.trig_smem):  # the cos and sin tables, or the angles' positions
      src = r.trig.at[i, trig_batch, rows] if self.plan.tables else r.trig.at[trig_batch, rows]
      plgpu.copy_gmem_to_smem(src, buf.at[wg], r.q_bar.at[wg])
    plgpu.copy_gmem_to_smem(r.qpos.at[batch, rows], r.qpos_smem.at[wg], r.qpos_bar.at[wg])
    if r.qseg is not None:
      plgpu.copy_gmem_to_smem(r.qseg.at[batch, rows], r.qseg_smem.at[wg], r.qpos_bar.at[wg])

  def is_bounded(self, j):
    """Whether item j of this CTA takes the bounded softmax (the flag of its tile)."""
    if not self.plan.bounded:
      return jnp.bool_(False)
    batch, head, tile = self.tile_of(self.item_of(jnp.clip(j, 0, self.count - 1)))
    return self.refs.bnd[batch, head, tile] != 0

  def _map_queries(self, wg):
    """(a [bq, D] in WGMMA layout, its two halves [bq, H]) of the resident query tile."""
    r = self.refs
    with jax.named_scope("wait_q"):
      plgpu.barrier_wait(r.q_bar.at[wg])
    with jax.named_scope("query_map"):
      x = plgpu.load(r.q_smem.at[wg], layout=plgpu.Layout.WGMMA)
      rot_rows = [st.row_vector(r.rot_smem.at[wg, i], 1) for i in range(2)]
      if self.plan.tables:
        cos_t, sin_t = (plgpu.load(buf.at[wg], layout=plgpu.Layout.WGMMA) for buf in r.trig_smem)
        halves = cartesian_halves_from_tables(x, cos_t, sin_t, *rot_rows,
                                              self.magnitude_scale, self.plan.dtype)
      else:
        halves = cartesian_halves(x, st.row_vector(r.trig_smem[0].at[wg], 0), *rot_rows,
                                  self.magnitude_scale, self.plan.dtype)
      a = plgpu.layout_cast(jnp.concatenate(halves, axis=1), plgpu.Layout.WGMMA)
    return a, halves

  def _stage_a(self, a, halves, j, wg, batch, head, rows, live):
    """With `save_a`, stores a (through its SMEM tile, or each half through the output
    tile's); then issues the next item's query copies into the freed buffers."""
    r, h = self.refs, self.plan.h
    if r.a_smem is not None:  # (after the previous item's store of a has read it)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      r.a_smem.at[wg][...] = a
    # Publishes a to TMA and wgmma, and orders the query-buffer reads before the next copies.
    plgpu.commit_smem()
    pl.when(j + 1 < self.count)(lambda: self._load_queries(self.item_of(j + 1), wg))
    if r.a_smem is not None:
      pl.when(live)(lambda: plgpu.copy_smem_to_gmem(r.a_smem.at[wg], r.a.at[batch, rows, head]))
    elif self.plan.save_a:  # (the final store waits for the second half's copy to have read it)
      for i, half in enumerate(halves):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        r.o_smem.at[wg][...] = half
        plgpu.commit_smem()
        pl.when(live)(lambda i=i: plgpu.copy_smem_to_gmem(
            r.o_smem.at[wg], r.a.at[batch, rows, head, pl.ds(i * h, h)]))

  def _item(self, j, base, wg):
    """Item j of this CTA, whose first step is the ring's step `base`; returns the next
    item's. Under ping-pong, each run of consecutive online-softmax items is opened by
    warpgroup 1's handshake and closed by warpgroup 0's (bounded items make none)."""
    r = self.refs
    batch, head, tile = self.tile_of(self.item_of(j))
    rows, live = self.query_rows(tile, wg)
    bounded_item = self.is_bounded(j)
    if self.ping_pong:  # the start of a run of ping-pong items
      pl.when(~bounded_item & ((j == 0) | self.is_bounded(j - 1)))(
          lambda: pl.when(wg == 1)(self.handshake))
    a, halves = self._map_queries(wg)
    plgpu.barrier_wait(r.qpos_bar.at[wg])
    # The query tile's positions and, with segments, its segment ids (`_softmax`'s mask).
    qpos = (st.row_vector(r.qpos_smem.at[wg], 0),)
    if r.qseg_smem is not None:
      qpos += (st.row_vector(r.qseg_smem.at[wg], 0),)
    self._stage_a(a, halves, j, wg, batch, head, rows, live)
    ranges = st.read_ranges(r.tab, batch, tile, wg)
    origin = ranges[0] - base
    steps = functools.partial(self._steps, wg, a, qpos, ranges, origin)
    if self.plan.bounded:  # per item: bounded scores skip the max
      acc, m_i, l_i = lax.cond(bounded_item, lambda: steps(True), lambda: steps(False))
    else:
      acc, m_i, l_i = steps(False)
    self._store(acc, m_i, l_i, wg, batch, head, rows, live)
    if self.ping_pong:  # the end of a run of ping-pong items
      pl.when(~bounded_item & ((j == self.count - 1) | self.is_bounded(j + 1)))(
          lambda: pl.when(wg == 0)(self.handshake))
    return base + ranges[1] - ranges[0]

  def _steps(self, wg, a, qpos, ranges, origin, bounded):
    """An item's streamed steps over its visit ranges, its first step the ring's step at
    `origin` (`st.compute_loops`): (acc, m, l), m and l [bq] (l the row sums of exp2(s - m)).
    Each step as written: QKᵀ, softmax, then PV (with P 1 under `row_sum_mma`), each awaited;
    with ping-pong handshakes unless `bounded` (the second hands the tensor cores to the other
    warpgroup once the softmax is done: ptxas may hoist its arrive; its wait stays here)."""
    r, bq, wgmma = self.refs, self.bq, plgpu.Layout.WGMMA
    pp = self.ping_pong and not bounded

    def step(slot, carry, mode):
      acc, m_i, l_i = carry
      with jax.named_scope("qk"):
        s_blk = ops.matmul(a, r.b_smem.at[slot].transpose((1, 0)), (bq, self.bk),
                           then=self.handshake if pp else None)
      m_i, l_i, p, alpha = self._softmax(s_blk, m_i, l_i, qpos, slot, mode, bounded)
      if alpha is not None:
        acc, l_i = self._rescale(acc, l_i, alpha)
      if pp:
        acc, m_i, l_i, p = lax.optimization_barrier((acc, m_i, l_i, p))
        self.handshake()
      with jax.named_scope("pv"):  # acc + P V and l + P 1, issued together
        if r.ones_smem is None:
          acc = ops.matmul_acc(acc, p, r.v_smem.at[slot])
        else:
          acc, l_i = ops.matmul_accs((acc, l_i), p, (r.v_smem.at[slot], r.ones_smem.at[wg]))
      return acc, m_i, l_i

    acc = plgpu.layout_cast(jnp.zeros((bq, self.plan.vd), jnp.float32), wgmma)
    m_i = plgpu.layout_cast(jnp.full((bq,), 0.0 if bounded else st.M_INIT, jnp.float32),
                            wgmma.reduce(1))
    l_i = (plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), wgmma.reduce(1)) if r.ones_smem is None
           else plgpu.layout_cast(jnp.zeros((bq, ROW_SUM_COLS), jnp.float32), wgmma))
    acc, m_i, l_i = st.compute_loops(
        ranges, origin, (acc, m_i, l_i), step, self.plan.stages, r.ready, r.consumed,
        skipped=(lambda: (self.handshake(), self.handshake())) if pp else None)
    if r.ones_smem is not None:  # every column holds the row sums
      l_i = l_i.max(axis=1)
    return acc, m_i, l_i

  def _softmax(self, s_blk, m_i, l_i, qpos, slot, mode, bounded):
    """Online softmax of one score tile: (m, l, P, alpha), alpha the per-row factor of the old
    acc (`_rescale`; 1 where the max stays, None: no rescale); P in q's dtype. Under
    `rescale_threshold` a row's max moves only when its block max exceeds it by more than that,
    so P <= 2**rescale_threshold. With `bounded` (every score within ±BOUNDED_SCORE_LIMIT) m
    stays 0: P = exp2(scores), no max, no rescale. Under `row_sum_mma` l lacks this step's P (the
    PV step adds it) and its rescale (`_rescale` applies it)."""
    row_sums_here = self.refs.ones_smem is None
    with jax.named_scope("softmax"):
      if mode == "masked":
        keys = (self.refs.kpos_smem,) + ((self.refs.kseg_smem,) if len(qpos) > 1 else ())
        k_pos, *k_seg = (st.row_vector(x.at[slot], 1) for x in keys)
        s_blk = st.causal_mask(s_blk, k_pos, qpos[0], 1, *k_seg, *qpos[1:])
      if bounded:
        p = jnp.exp2(s_blk)
        if row_sums_here:
          l_i = l_i + p.sum(axis=1)
        return m_i, l_i, p.astype(self.plan.dtype), None
      m_blk = s_blk.max(axis=1)
      if self.blocks.rescale_threshold is None:
        m_new = jnp.maximum(m_i, m_blk)
      else:
        m_new = jnp.where(m_blk > m_i + self.blocks.rescale_threshold, m_blk, m_i)
      alpha = jnp.exp2(m_i - m_new)  # 1 where the max stays
      p = jnp.exp2(s_blk - st.broadcast(m_new, (self.bq, self.bk), 0))
      if row_sums_here:  # (else [bq, ROW_SUM_COLS], rescaled with acc; P @ 1 in the PV step)
        l_i = l_i * alpha + p.sum(axis=1)
      return m_new, l_i, p.astype(self.plan.dtype), alpha

  def _rescale(self, acc, l_i, alpha):
    """acc, and under `row_sum_mma` l, times `_softmax`'s per-row alpha; under `rescale_threshold`
    only in the warps where some row's max moved (alpha < 1; in the others every alpha is 1)."""
    row_sum_mma = self.refs.ones_smem is not None
    scaled = (acc, l_i) if row_sum_mma else (acc,)
    times_alpha = lambda: tuple(x * st.broadcast(alpha, x.shape, 0) for x in scaled)
    if self.blocks.rescale_threshold is None:
      scaled = times_alpha()
    else:
      scaled = lax.cond(ops.warp_any(alpha < 1.0), times_alpha, lambda: scaled)
    return scaled if row_sum_mma else (scaled[0], l_i)

  def _store(self, acc, m_i, l_i, wg, batch, head, rows, live):
    """out = acc / l and lse = m + log2(l) (zero rows and 1e30 where no key is visible)."""
    r, bq, vd = self.refs, self.bq, self.plan.vd
    with jax.named_scope("store"):
      # Waits until the copies of a (this item's) or of the output (the previous one's) read them.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      empty = l_i == 0.0
      l_safe = jnp.where(empty, 1.0, l_i)
      r.o_smem.at[wg][...] = (acc / st.broadcast(l_safe, (bq, vd), 0)).astype(self.plan.dtype)
      r.lse_smem.at[wg][...] = jnp.where(empty, 1e30, m_i + jnp.log(l_safe) * (1 / math.log(2)))
      plgpu.commit_smem()

      def store():
        plgpu.copy_smem_to_gmem(r.o_smem.at[wg], r.o.at[batch, rows, head])
        plgpu.copy_smem_to_gmem(r.lse_smem.at[wg], r.lse.at[batch, head, rows])
      pl.when(live)(store)
