"""Forward kernel of fused PoPE attention: flash attention over the Cartesian PoPE form.

Each resident query tile is mapped in registers to a = [μq cos(tθ-δ), μq sin(tθ-δ)]·scale·log2 e
(`_query_map`); b = [μk cos sθ, μk sin sθ] streams; O = softmax₂(a bᵀ) v with masking by
position. Also returns the base-2 log-sum-exp and, for the backward, a.

Shape letters: B batch, T padded query length, S padded key length, N query heads, K kv heads,
H head dim, D = 2H width of the Cartesian a and b, V value width (a multiple of 64).
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
from pallas_kernels._forward_steps import ROW_SUM_COLS, ItemSteps
from pallas_kernels._query_map import (TABLE_DTYPE, cartesian_halves,  # noqa: F401
                                       cartesian_halves_from_tables)
from pallas_kernels.pope_attention_config import BlockSizes


# Tiles whose scores (log2 units) lie within ± this take exp2 of the scores (`bounded_softmax`):
# P, its row sums and P V stay in float32's and bf16's range for S < 2**24 and |v| < 2**38.
BOUNDED_SCORE_LIMIT = 64.0


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

  @property
  def tile_rows(self) -> int:
    """Query rows per CTA item (W block_q), the unit of the bounded flags."""
    return self.warpgroups * self.blocks.block_q

  @property
  def a_in_smem(self) -> bool:
    """a is staged for its store in its own SMEM tile (else through the output tile's)."""
    return self.save_a and self.h != self.vd


def plan_forward(blocks: BlockSizes, h: int, vd: int, dtype, save_a: bool) -> ForwardPlan:
  """The forward's schedule for head dim h, value width vd (a multiple of 64), q's dtype and
  whether a is saved: three warpgroups where `forward_warpgroups` is None and they fit (with a
  saved, no tables: one answer for both forwards), then max(3, stages) where that fits, then
  the query tables where they fit beside."""
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


def _scratch(p: ForwardPlan) -> list:
  """The forward kernel's SMEM buffers and barriers, in the kernel's argument order."""
  bq, bk, h, vd, wgs = p.blocks.block_q, p.blocks.block_kv, p.h, p.vd, p.warpgroups
  d, dtype, stages, tf = 2 * h, p.dtype, p.stages, st.tile_transforms()
  scratch = [plgpu.SMEM((wgs, bq, d), dtype, transforms=tf)] if p.a_in_smem else []
  if p.tables:  # cos and sin of the query angles (`pope_attention.query_angles`)
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
      # the ping-pong handshake (with three warpgroups unused, as in the tuned programs)
      plgpu.Barrier(num_arrivals=wgs) if wgs == 2 else plgpu.Barrier(num_barriers=wgs),
      plgpu.SMEM((wgs, bq, h), dtype, transforms=st.tile_transforms(h)),
  ]
  if p.blocks.row_sum_mma:
    scratch.append(plgpu.SMEM((wgs, bk, ROW_SUM_COLS), dtype,
                              transforms=st.tile_transforms(ROW_SUM_COLS)))
  return scratch


@functools.partial(jax.jit, static_argnames=("plan", "magnitude_scale"))
def pope_attention_fwd(q, rot, trig, b, v, q_pos, k_pos, table, schedule, bounded, *,
                       plan: ForwardPlan, magnitude_scale: float):
  """Runs the forward kernel.

  Args:
    q: [B, T, N, H] bf16/fp16 raw queries (before softplus).
    rot, trig: the query angles (`pope_attention.query_angles`).
    b: [B, S, K, D] Cartesian keys, same dtype, D = 2H; v: [B, S, K, V] values, same dtype.
    q_pos: [B, T], k_pos: [B, S] float32 positions (padding: st.QUERY_PAD, st.KEY_PAD).
    table: [B, ceil(T / (W block_q)), 2 + 4 W] int32 from `st.visit_table`.
    schedule: the CTAs' items, int32 from `st.launch_schedule` (queries resident).
    bounded: with `plan.bounded`, [B, N, ceil(T / (W block_q))] int32, 1 where every score of
      the tile is within ±BOUNDED_SCORE_LIMIT (`pope_attention.bounded_tiles`); else None.
    plan: `plan_forward`'s; magnitude_scale: the logit scale times log2 e.

  Returns:
    out [B, T, N, V] in q's dtype (zero rows where no key is visible), lse [B, N, T] float32
    base-2 log-sum-exp (1e30 where no key is visible) and, with `plan.save_a`, a [B, T, N, D].

  Raises:
    ValueError: trig's rank does not match `plan.tables`, or the buffers exceed SMEM.
  """
  bsz, t_len, n_heads, h = q.shape
  kv_heads, vd = v.shape[2:]
  if trig.ndim != (4 if plan.tables else 2):
    raise ValueError(f"trig has shape {trig.shape}; the plan's tables are {plan.tables}")
  kernel = _ForwardKernel(
      plan, t_len=t_len, n_heads=n_heads, group=n_heads // kv_heads,
      magnitude_scale=magnitude_scale, has_bounded=bounded is not None,
      rot_per_head=tuple(r.ndim != 1 for r in rot),
      trig_batched=trig.shape[-3 if plan.tables else -2] > 1)
  scratch = _scratch(plan)
  st.check_smem(scratch, "forward", f"at {plan.stages} stages lower BlockSizes.stages, "
                "block_kv or block_q" + (", or set forward_warpgroups 2 (or None)"
                                         if plan.warpgroups == 3 else ""))
  out_type = (jax.ShapeDtypeStruct((bsz, t_len, n_heads, vd), q.dtype),
              jax.ShapeDtypeStruct((bsz, n_heads, t_len), jnp.float32))
  if plan.save_a:
    out_type += (jax.ShapeDtypeStruct((bsz, t_len, n_heads, 2 * h), q.dtype),)
  return st.launch(kernel.pope_fwd_kernel, out_type, scratch, ctas=schedule.shape[0],
                   compute_wgs=plan.warpgroups)(
      q, *rot, trig, b, v, q_pos, k_pos, table, schedule, *([] if bounded is None else [bounded]))


class _ForwardKernel:
  """The forward kernel's body: `pope_fwd_kernel` forks the warpgroups; each item of a compute
  warpgroup loads and maps its queries, runs its steps (`ItemSteps`) and stores (`_item`)."""

  def __init__(self, plan: ForwardPlan, *, t_len: int, n_heads: int, group: int,
               magnitude_scale: float, has_bounded: bool, rot_per_head: tuple,
               trig_batched: bool):
    self.plan, self.blocks, self.stages, self.tables = plan, plan.blocks, plan.stages, plan.tables
    self.save_a, self.dtype, self.h, self.vd = plan.save_a, plan.dtype, plan.h, plan.vd
    self.t_len, self.n_heads, self.group = t_len, n_heads, group
    self.magnitude_scale, self.has_bounded = magnitude_scale, has_bounded
    self.rot_per_head, self.trig_batched = rot_per_head, trig_batched
    self.bq, self.bk, self.wgs = plan.blocks.block_q, plan.blocks.block_kv, plan.warpgroups
    self.n_tiles = -(-t_len // (self.wgs * self.bq))
    # The interpreter runs each warpgroup as its own XLA:CPU execution, and the handshake
    # hangs where they do not all start at once (few cores); the GPU check covers ping-pong.
    self.ping_pong = plan.ping_pong and not st.interpreted()
    self.registers, self.memory_registers = st.warpgroup_registers(self.wgs)

  def query_rows(self, tile, wg):
    """(rows, live) of a warpgroup's query tile: tiles past T (three warpgroups) load the last
    rows and store nothing (live False); live is None where every tile is live."""
    start = (tile * self.wgs + wg) * self.bq
    if self.t_len % (self.wgs * self.bq) == 0:
      return pl.ds(start, self.bq), None
    return pl.ds(jnp.minimum(start, self.t_len - self.bq), self.bq), start < self.t_len

  def tile_of(self, item):
    return st.last_tile_first(item, self.n_heads, self.n_tiles)

  def pope_fwd_kernel(self, q_ref, rot0_ref, rot1_ref, trig_ref, b_ref, v_ref, qpos_ref,
                      kpos_ref, tab_ref, sched_ref, *rest):
    """The kernel: splits the refs (in `_scratch`'s order) and forks the warpgroups."""
    rest = list(rest)
    bnd_ref = rest.pop(0) if self.has_bounded else None
    o_ref, lse_ref = rest.pop(0), rest.pop(0)
    a_ref = rest.pop(0) if self.save_a else None
    a_smem = rest.pop(0) if self.plan.a_in_smem else None
    o_smem, qpos_smem, lse_smem, rot_smem, *rest = rest
    n_trig = 2 if self.tables else 1
    trig_smem, rest = rest[:n_trig], rest[n_trig:]
    (b_smem, v_smem, kpos_smem, q_bar, qpos_bar, ready, consumed, handshake_bar, q_smem,
     *rest) = rest
    ones_smem = rest.pop(0) if self.blocks.row_sum_mma else None
    self.refs = types.SimpleNamespace(
        q=q_ref, rot=(rot0_ref, rot1_ref), trig=trig_ref, qpos=qpos_ref, tab=tab_ref,
        sched=sched_ref, bnd=bnd_ref, o=o_ref, lse=lse_ref, a=a_ref, a_smem=a_smem,
        o_smem=o_smem, qpos_smem=qpos_smem, lse_smem=lse_smem, rot_smem=rot_smem,
        trig_smem=trig_smem, b_smem=b_smem, v_smem=v_smem, kpos_smem=kpos_smem, q_bar=q_bar,
        qpos_bar=qpos_bar, ready=ready, consumed=consumed, q_smem=q_smem, ones_smem=ones_smem)
    wg = lax.axis_index("wg")
    self.handshake = lambda: st.schedule_barrier(handshake_bar)

    @pl.when(wg < self.wgs)
    def _compute():
      self._compute(wg)

    @pl.when(wg == self.wgs)
    def _memory():
      st.stream_keys(st.for_each_item(sched_ref), self.tile_of, tab_ref,
                     (b_ref, v_ref, kpos_ref), (b_smem, v_smem, kpos_smem), self.group,
                     self.bk, self.stages, consumed, ready, self.memory_registers)

  def _compute(self, wg):
    """A compute warpgroup: its CTA's items in turn."""
    r = self.refs
    plgpu.set_max_registers(self.registers, action="increase")
    self.item_of, self.count = st.cta_items(r.sched)
    self._load_queries(self.item_of(0), wg)
    if r.ones_smem is not None:  # P @ 1: the row sums of P (`BlockSizes.row_sum_mma`)
      r.ones_smem.at[wg][...] = plgpu.layout_cast(
          jnp.ones((self.bk, ROW_SUM_COLS), self.dtype), plgpu.Layout.WGMMA)
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
    if self.tables:
      for i, buf in enumerate(r.trig_smem):
        plgpu.copy_gmem_to_smem(r.trig.at[i, trig_batch, rows], buf.at[wg], r.q_bar.at[wg])
    else:
      plgpu.copy_gmem_to_smem(r.trig.at[trig_batch, rows], r.trig_smem[0].at[wg],
                              r.q_bar.at[wg])
    plgpu.copy_gmem_to_smem(r.qpos.at[batch, rows], r.qpos_smem.at[wg], r.qpos_bar.at[wg])

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
      if self.tables:
        cos_t, sin_t = (plgpu.load(buf.at[wg], layout=plgpu.Layout.WGMMA)
                        for buf in r.trig_smem)
        halves = cartesian_halves_from_tables(x, cos_t, sin_t, *rot_rows,
                                              self.magnitude_scale, self.dtype)
      else:
        halves = cartesian_halves(x, st.row_vector(r.trig_smem[0].at[wg], 0), *rot_rows,
                                  self.magnitude_scale, self.dtype)
      a = plgpu.layout_cast(jnp.concatenate(halves, axis=1), plgpu.Layout.WGMMA)
    return a, halves

  def _stage_a(self, a, halves, j, wg, batch, head, rows, live):
    """With `save_a`, stores a (through its SMEM tile, or each half through the output
    tile's); then issues the next item's query copies into the freed buffers."""
    r, h = self.refs, self.h
    if r.a_smem is not None:  # (after the previous item's store of a has read it)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      r.a_smem.at[wg][...] = a
    # Makes a visible to TMA and wgmma, and orders every thread's reads of the query buffers
    # before the next item's copies into them.
    plgpu.commit_smem()
    pl.when(j + 1 < self.count)(lambda: self._load_queries(self.item_of(j + 1), wg))
    if self.save_a and r.a_smem is not None:
      _when_live(live, lambda: plgpu.copy_smem_to_gmem(r.a_smem.at[wg],
                                                       r.a.at[batch, rows, head]))
    elif self.save_a:  # (the final store waits for the second half's copy to have read it)
      for i, half in enumerate(halves):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        r.o_smem.at[wg][...] = half
        plgpu.commit_smem()
        _when_live(live, lambda i=i: plgpu.copy_smem_to_gmem(
            r.o_smem.at[wg], r.a.at[batch, rows, head, pl.ds(i * h, h)]))

  def _item(self, j, base, wg):
    """Item j of this CTA, whose first step is the ring's step `base`; returns the next
    item's. Under ping-pong, each run of consecutive online-softmax items is opened by
    warpgroup 1's handshake and closed by warpgroup 0's (bounded items make none)."""
    r = self.refs
    item = self.item_of(j)
    batch, head, tile = self.tile_of(item)
    rows, live = self.query_rows(tile, wg)
    bounded_item = self.is_bounded(j)
    if self.ping_pong:  # the start of a run of ping-pong items
      pl.when(~bounded_item & ((j == 0) | self.is_bounded(j - 1)))(
          lambda: pl.when(wg == 1)(self.handshake))
    a, halves = self._map_queries(wg)
    plgpu.barrier_wait(r.qpos_bar.at[wg])
    qpos = st.row_vector(r.qpos_smem.at[wg], 0)
    self._stage_a(a, halves, j, wg, batch, head, rows, live)
    ranges = st.read_ranges(r.tab, batch, tile, wg)
    steps = ItemSteps(self, wg, a, qpos, ranges, origin=ranges[0] - base)
    if self.plan.bounded:  # per item: bounded scores skip the max
      acc, m_i, l_i = lax.cond(bounded_item, lambda: steps.loops(True),
                               lambda: steps.loops(False))
    else:
      acc, m_i, l_i = steps.loops(False)
    self._store(acc, m_i, l_i, wg, batch, head, rows, live)
    if self.ping_pong:  # the end of a run of ping-pong items
      pl.when(~bounded_item & ((j == self.count - 1) | self.is_bounded(j + 1)))(
          lambda: pl.when(wg == 0)(self.handshake))
    return base + ranges[1] - ranges[0]

  def _store(self, acc, m_i, l_i, wg, batch, head, rows, live):
    """out = acc / l and lse = m + log2(l) (zero rows and 1e30 where no key is visible)."""
    r, bq, vd = self.refs, self.bq, self.vd
    with jax.named_scope("store"):
      # The copies of a (this item's) or of the output (the previous item's) must have
      # read the tiles first.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      empty = l_i == 0.0
      l_safe = jnp.where(empty, 1.0, l_i)
      r.o_smem.at[wg][...] = (acc / st.broadcast(l_safe, (bq, vd), 0)).astype(self.dtype)
      r.lse_smem.at[wg][...] = jnp.where(empty, 1e30,
                                         m_i + jnp.log(l_safe) * (1 / math.log(2)))
      plgpu.commit_smem()

      def store():
        plgpu.copy_smem_to_gmem(r.o_smem.at[wg], r.o.at[batch, rows, head])
        plgpu.copy_smem_to_gmem(r.lse_smem.at[wg], r.lse.at[batch, head, rows])
      _when_live(live, store)


def _when_live(live, fn):
  if live is None:
    fn()
  else:
    pl.when(live)(fn)
