"""Backward kernels of fused PoPE attention: dq (resident queries) and dk, dv (resident keys).

For O = softmax₂(a bᵀ) v with P = exp2(a bᵀ - lse), Δ = rowsum(dO ∘ O) and dS = P ∘ (dO vᵀ - Δ)
(FlashAttention-2, Alg. 2): da = ln 2 · dS·b, db = ln 2 · dSᵀ·a, dv = Pᵀ·dO in float32. The
epilogues map da, db through the Cartesian maps' VJP (`cartesian_vjp`) to the raw q, k.

Shape letters: B batch, T padded query length, S padded key length, N query heads, K kv heads,
D = 2H q/k width, V value width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _streaming as st
from pallas_kernels import _warpgroup_ops as ops
from pallas_kernels.pope_attention_config import BlockSizes

_LN2 = math.log(2.0)
# Below this magnitude μ, g(μ) = (1 - e^-μ) / μ is evaluated by its Taylor series (error < μ³/24).
_G_SERIES_BELOW = 1.0 / 64


def cartesian_vjp(cart, d_cart, magnitude_scale: float):
  """VJP of the PoPE Cartesian map (Eq. 7-10) from its own output x' = s·μ·[cos φ, sin φ]:
    dx = g(μ)·(dx'_c x'_c + dx'_s x'_s),   dφ = dx'_s x'_c - dx'_c x'_s,
  μ = |x'| / s, g(μ) = (1 - e^-μ) / μ (softplus' over μ), so no angles or raw inputs are needed.
  From cart [R, 2H] x' (any float dtype; its rounding carries into μ and φ), d_cart [R, 2H]
  float32 cotangent of x' and magnitude_scale s > 0: (dx, dφ), each [R, H] float32."""
  rows, width = cart.shape
  h = width // 2
  half = lambda x, i: lax.slice(x, (0, i * h), (rows, (i + 1) * h)).astype(jnp.float32)
  c, s = half(cart, 0), half(cart, 1)
  dc, ds = half(d_cart, 0), half(d_cart, 1)
  mu = jnp.sqrt(c * c + s * s) * (1.0 / magnitude_scale)
  series = 1.0 - mu * (0.5 - mu * (1.0 / 6.0))
  g = jnp.where(mu < _G_SERIES_BELOW, series, (1.0 - jnp.exp(-mu)) / mu)
  return g * (dc * c + ds * s), ds * c - dc * s


def _tiles(count: int, rows: int, names, d: int, vd: int, dtype) -> dict:
  """SMEM buffers of `count` tiles of `rows` rows by operand name, in the order of `names`:
  a, b [rows, D] and do, v [rows, V] in `dtype`; lse, delta, qpos, kpos, qseg, kseg [rows]
  float32."""
  widths = {"a": d, "b": d, "do": vd, "v": vd}
  return {n: plgpu.SMEM((count, rows, widths[n]), dtype, transforms=st.tile_transforms())
          if n in widths else plgpu.SMEM((count, rows), jnp.float32) for n in names}


def _fork(sched_ref, item_body, memory) -> None:
  """A backward kernel's warpgroups: each compute warpgroup wg runs base = item_body(item,
  base, wg) over its CTA's items (base: the ring's step at the item's first step) and awaits
  its stores; the memory warpgroup runs memory(for_items) (`st.for_each_item`)."""
  wg = lax.axis_index("wg")
  for_items = st.for_each_item(sched_ref)

  @pl.when(wg < st.COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    for_items(lambda item, base: item_body(item, base, wg), jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  pl.when(wg == st.COMPUTE_WGS)(lambda: memory(for_items))


def _mask_rows(smem, names, index, axis: int):
  """The positions and, where the kernel has them, segment ids of one tile: row vectors along
  `axis` of smem[name].at[index] for each of `names` present in `smem` (`st.causal_mask`)."""
  return tuple(st.row_vector(smem[n].at[index], axis) for n in names if n in smem)


def _masked(scores, k_rows, q_rows, key_axis: int):
  """`st.causal_mask` of scores by `_mask_rows`' (position, segment id) of keys and queries."""
  return st.causal_mask(scores, k_rows[0], q_rows[0], key_axis, *k_rows[1:], *q_rows[1:])


@functools.partial(jax.jit, static_argnames=('blocks', 'magnitude_scale'))
def pope_attention_dq(a, b, v, do, lse, delta, q_pos, k_pos, table, schedule, segments=None, *,
                      blocks: BlockSizes, magnitude_scale: float | None):
  """The queries' gradient from da = ln 2 · dS·b per query head.

  Args:
    a: [B, T, N, D] the forward's Cartesian queries (scale s); b: [B, S, K, D];
      v: [B, S, K, V]; do: [B, T, N, V] (one dtype).
    lse, delta: [B, N, T] float32 (base-2 log-sum-exp; rowsum(dO ∘ O)).
    q_pos: [B, T], k_pos: [B, S] float32 positions with padding sentinels.
    table, schedule: `st.visit_table` and `st.launch_schedule` int32 (queries resident).
    segments: None or the float32 segment ids (q [B, T], k [B, S]) the forward masked by.
    blocks: tile sizes; magnitude_scale: s, or None to return da (fp16: the caller maps it).

  Returns:
    With `magnitude_scale`, dq and dφ (each element's angle gradient; the phase's is its sum
    over B and T), [B, T, N, H] each; else da [B, T, N, D]; in a's dtype.

  Raises:
    ValueError: the buffers exceed SMEM.
  """
  bsz, t_len, n_heads, d = a.shape
  vd, group, h = v.shape[-1], n_heads // b.shape[2], d // 2
  bq, bk, stages = blocks.block_q_dq, blocks.block_kv_dq, blocks.stages
  dtype, wgs = a.dtype, st.COMPUTE_WGS
  n_tiles = t_len // (wgs * bq)
  mapped = magnitude_scale is not None
  seg = segments is not None
  resident = _tiles(wgs, bq, ("a", "do", "lse", "delta", "qpos"), d, vd, dtype)
  if mapped:  # [wg, 0] dq, [wg, 1] dφ: the same bytes as a's tile [wg]
    resident["a"] = plgpu.RefUnion(resident["a"], plgpu.SMEM(
        (wgs, 2, bq, h), dtype, transforms=st.tile_transforms(h)))
  streamed = _tiles(stages, bk, ("b", "v", "kpos"), d, vd, dtype)
  # The segment ids' buffers come after the others (the unsegmented kernel's layout stays).
  seg_tiles = ([_tiles(wgs, bq, ("qseg",), d, vd, dtype)["qseg"],
                _tiles(stages, bk, ("kseg",), d, vd, dtype)["kseg"]] if seg else [])
  scratch = [*resident.values(), *streamed.values(),
             plgpu.Barrier(num_barriers=(len(resident) + seg) * wgs),
             plgpu.Barrier(num_arrivals=len(streamed) + seg, num_barriers=stages),
             plgpu.Barrier(num_arrivals=wgs, num_barriers=stages), *seg_tiles]

  def pope_dq_kernel(a_ref, b_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref,
                     tab_ref, sched_ref, *rest):
    qseg_ref, kseg_ref = rest[:2] if seg else (None, None)
    (out_refs, a_smem, do_smem, lse_smem, delta_smem, qpos_smem, b_smem, v_smem, kpos_smem,
     res_bar, ready, consumed, *seg_smem) = rest[2:] if seg else rest
    q_smem = {"qpos": qpos_smem} | ({"qseg": seg_smem[0]} if seg else {})
    k_smem = {"kpos": kpos_smem} | ({"kseg": seg_smem[1]} if seg else {})
    # Mapped, a's tile stages dq and dφ once the VJP has read it (`stage`, wg's rows alike).
    a_smem, stage = a_smem if mapped else (a_smem, None)
    tile_of = lambda item: st.item_coords(item, n_heads, n_tiles, last_tile_first=True)

    def item_body(item, base, wg):
      batch, head, tile = tile_of(item)
      rows = pl.ds((tile * wgs + wg) * bq, bq)
      loads = ((a_ref.at[batch, rows, head], a_smem), (do_ref.at[batch, rows, head], do_smem),
               (lse_ref.at[batch, head, rows], lse_smem),
               (delta_ref.at[batch, head, rows], delta_smem),
               (qpos_ref.at[batch, rows], qpos_smem))
      if seg:
        loads += ((qseg_ref.at[batch, rows], q_smem["qseg"]),)
      st.load_resident(loads, wg, res_bar)
      lse, dlt = (st.row_vector(x.at[wg], 0) for x in (lse_smem, delta_smem))
      q_rows = _mask_rows(q_smem, ("qpos", "qseg"), wg, 0)
      ranges = st.read_ranges(tab_ref, batch, tile, wg)
      origin = ranges[0] - base  # this item's first step is the ring's step `base`

      def step(slot, dq_acc, mode):
        def probs(s_blk):
          if mode == "masked":
            s_blk = _masked(s_blk, _mask_rows(k_smem, ("kpos", "kseg"), slot, 1), q_rows, 1)
          return jnp.exp2(s_blk - st.broadcast(lse, (bq, bk), 0))

        _, (dq_acc,) = ops.gradient_step(
            (a_smem.at[wg], b_smem.at[slot].transpose((1, 0)), (bq, bk)),
            (do_smem.at[wg], v_smem.at[slot].transpose((1, 0)), (bq, bk)),
            probs, lambda p, dp: p * (dp - st.broadcast(dlt, (bq, bk), 0)),
            (), ((dq_acc, b_smem.at[slot]),), dtype, overlap=blocks.overlap_bwd)
        return dq_acc

      dq_acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
      dq_acc = st.compute_loops(ranges, origin, dq_acc, step, stages, ready, consumed)
      if not mapped:
        a_smem.at[wg][...] = (dq_acc * _LN2).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(a_smem.at[wg], out_refs["da"].at[batch, rows, head])
      else:
        grads = cartesian_vjp(plgpu.load(a_smem.at[wg], layout=plgpu.Layout.WGMMA),
                              dq_acc * _LN2, magnitude_scale)
        plgpu.commit_smem()  # (the warpgroup has read a)
        for i, grad in enumerate(grads):
          stage.at[wg, i][...] = grad.astype(dtype)
        plgpu.commit_smem()
        for i, name in enumerate(("dq", "d_angle")):
          plgpu.copy_smem_to_gmem(stage.at[wg, i], out_refs[name].at[batch, rows, head])
      return base + ranges[1] - ranges[0]

    _fork(sched_ref, item_body, lambda for_items: st.stream_keys(
        for_items, tile_of, tab_ref, (b_ref, v_ref, kpos_ref, *([kseg_ref] if seg else [])),
        (b_smem, v_smem, *k_smem.values()), group, bk, stages, consumed, ready))

  st.check_smem(scratch, "dq", f"lower BlockSizes.stages ({stages}), block_q_dq ({bq}) or "
                f"block_kv_dq ({bk})")
  grad = jax.ShapeDtypeStruct((bsz, t_len, n_heads, h), dtype)
  out_type = {"dq": grad, "d_angle": grad} if mapped else {"da": jax.ShapeDtypeStruct(
      a.shape, dtype)}
  out = st.launch(pope_dq_kernel, out_type, scratch, ctas=schedule.shape[0], compute_wgs=wgs)(
      a, b, v, do, lse, delta, q_pos, k_pos, table, schedule, *(segments or ()))
  return (out["dq"], out["d_angle"]) if mapped else out["da"]


@functools.partial(jax.jit, static_argnames=('blocks',))
def pope_attention_dkv(a, b, v, do, lse, delta, q_pos, k_pos, table, schedule, segments=None, *,
                       blocks: BlockSizes):
  """Per query head, the raw keys' gradient dk (db = ln 2 · dSᵀ·a through the key map's VJP,
  s = 1) and dv = Pᵀ·dO; the caller sums a GQA group.

  Each compute warpgroup owns a key tile of `block_kv_dkv` rows, or, with `blocks.dkv_roles`,
  both share one: warpgroup 0 computes S, P, dP and dS, accumulates dv and hands dS over
  through SMEM (one buffer per ring slot); warpgroup 1 accumulates db = dSᵀ·a and maps it (at
  H = 128, db's 2H-wide float32 accumulator with S, dP and dv spills one warpgroup's registers).

  Args: as `pope_attention_dq`'s, with keys resident in table and schedule.

  Returns:
    dk [B, S, N, H] and dv [B, S, N, V] in a's dtype.

  Raises:
    ValueError: the buffers exceed SMEM.
  """
  roles = blocks.dkv_roles
  bsz, _, n_heads, d = a.shape
  h, group = d // 2, n_heads // b.shape[2]
  s_len, vd = v.shape[1], v.shape[-1]
  bk, bq, stages = blocks.block_kv_dkv, blocks.block_q_dkv, blocks.stages
  dtype, wgs = a.dtype, st.COMPUTE_WGS
  n_tiles = s_len // (bk if roles else wgs * bk)
  resident, streamed = ("b", "kpos", "v"), ("a", "do", "lse", "qpos", "delta")
  if segments is not None:
    resident, streamed = resident + ("kseg",), streamed + ("qseg",)

  def scratch_types(dk_in_v: bool):
    res_types = _tiles(wgs, bk, ("b", "v", "kpos") + resident[3:], d, vd, dtype)
    if not dk_in_v:
      res_types["dk"] = plgpu.SMEM((wgs, bk, h), dtype, transforms=st.tile_transforms(h))
    if roles:  # dS handed from warpgroup 0 to 1, per ring slot
      res_types["ds"] = plgpu.SMEM((stages, bk, bq), dtype, transforms=st.tile_transforms(bq))
    return (res_types, _tiles(stages, bq, streamed, d, vd, dtype),
            plgpu.Barrier(num_barriers=len(resident) * wgs),
            plgpu.Barrier(num_arrivals=len(streamed), num_barriers=stages),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            *[plgpu.Barrier(num_barriers=stages)] * roles)

  # dk is staged in v's tile before dv's store where V = H and SMEM is short (roles: always).
  dk_in_v = vd == h and (roles or st.smem_bytes(scratch_types(False)) > st.smem_limit())
  scratch = scratch_types(dk_in_v)

  def pope_dkv_kernel(a_ref, b_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref,
                      tab_ref, sched_ref, *rest):
    qseg_ref, kseg_ref = rest[:2] if segments is not None else (None, None)
    out_refs, smem, str_smem, res_bar, ready, consumed, *handed = (
        rest if segments is None else rest[2:])
    a_smem, do_smem = str_smem["a"], str_smem["do"]

    def tile_of(item):
      """(batch, head, kv head, resident key tile) of an item."""
      batch, head, rank = st.item_coords(item, n_heads, n_tiles, last_tile_first=False)
      return batch, head, lax.div(head, jnp.int32(group)), rank

    def gradient_step(wg, k_rows, slot, mode, p_terms, ds_terms, ds_to=None):
      """`ops.gradient_step` of wg's resident keys (`_mask_rows` `k_rows`) and the slot's
      queries."""
      def probs(s_t):
        if mode == "masked":
          s_t = _masked(s_t, k_rows, _mask_rows(str_smem, ("qpos", "qseg"), slot, 1), 0)
        lse = st.row_vector(str_smem["lse"].at[slot], 1)
        return jnp.exp2(s_t - st.broadcast(lse, (bk, bq), 1))

      def ds_of(p_t, dp_t):
        dlt = st.row_vector(str_smem["delta"].at[slot], 1)
        return p_t * (dp_t - st.broadcast(dlt, (bk, bq), 1))

      return ops.gradient_step(
          (smem["b"].at[wg], a_smem.at[slot].transpose((1, 0)), (bk, bq)),
          (smem["v"].at[wg], do_smem.at[slot].transpose((1, 0)), (bk, bq)),
          probs, ds_of, p_terms, ds_terms, dtype, overlap=blocks.overlap_bwd, ds_to=ds_to)

    def zeros(width):
      return plgpu.layout_cast(jnp.zeros((bk, width), jnp.float32), plgpu.Layout.WGMMA)

    def store(o, acc, wg, batch, cols, head, wait: bool):
      """Stages output o's accumulator in SMEM (its own tile, or warpgroup wg's v tile) and
      stores it; with `wait`, once the previous store from that tile has read it."""
      staging = smem["dk"] if o == "dk" and not dk_in_v else smem["v"]
      if wait:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      staging.at[wg][...] = acc.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(staging.at[wg], out_refs[o].at[batch, cols, head])

    def key_map_vjp(db, wg):  # db through the key map's VJP (s = 1): the raw keys' gradient
      return cartesian_vjp(plgpu.load(smem["b"].at[wg], layout=plgpu.Layout.WGMMA),
                           db * _LN2, 1.0)[0]

    def item_body(item, base, wg):
      batch, head, kv_head, tile = tile_of(item)
      cols = pl.ds((tile * wgs + wg) * bk, bk)
      src = {"b": b_ref.at[batch, cols, kv_head], "v": v_ref.at[batch, cols, kv_head],
             "kpos": kpos_ref.at[batch, cols]}
      if kseg_ref is not None:
        src["kseg"] = kseg_ref.at[batch, cols]
      st.load_resident([(src[name], smem[name]) for name in resident], wg, res_bar)
      kpos = _mask_rows(smem, ("kpos", "kseg"), wg, 0)
      ranges = st.read_ranges(tab_ref, batch, tile, wg)
      origin = ranges[0] - base  # this item's first step is the ring's step `base`

      def step(slot, accs, mode):
        db, dv = accs
        (dv,), (db,) = gradient_step(wg, kpos, slot, mode, ((dv, do_smem.at[slot]),),
                                     ((db, a_smem.at[slot]),))
        return db, dv

      db, dv = st.compute_loops(ranges, origin, (zeros(d), zeros(vd)), step, stages, ready,
                                consumed)
      store("dk", key_map_vjp(db, wg), wg, batch, cols, head, wait=False)  # (load_resident's)
      store("dv", dv, wg, batch, cols, head, wait=dk_in_v)
      return base + ranges[1] - ranges[0]

    def roles_item_body(item, base, wg):
      batch, head, kv_head, tile = tile_of(item)
      cols = pl.ds(tile * bk, bk)
      ranges = st.read_ranges(tab_ref, batch, tile, 0)
      origin = ranges[0] - base

      @pl.when(wg == 0)
      def _scores_and_dv():
        st.load_resident([(b_ref.at[batch, cols, kv_head], smem["b"]),
                          (v_ref.at[batch, cols, kv_head], smem["v"]),
                          (kpos_ref.at[batch, cols], smem["kpos"]),
                          *([(kseg_ref.at[batch, cols], smem["kseg"])] if kseg_ref is not None else [])],
                         0, res_bar)
        kpos = _mask_rows(smem, ("kpos", "kseg"), 0, 0)

        def step(slot, dv, mode):
          def hand_over(ds):
            smem["ds"].at[slot][...] = ds
            plgpu.commit_smem()
            plgpu.barrier_arrive(handed[0].at[slot])
          (dv,), _ = gradient_step(0, kpos, slot, mode, ((dv, do_smem.at[slot]),), (), hand_over)
          return dv

        dv = st.compute_loops(ranges, origin, zeros(vd), step, stages, ready, consumed)
        store("dv", dv, 0, batch, cols, head, wait=False)  # (load_resident waited)

      @pl.when(wg == 1)
      def _dk():
        # Its own keys for the VJP (warpgroup 0, barriers 0, 2, 4, may load the next item's).
        plgpu.copy_gmem_to_smem(b_ref.at[batch, cols, kv_head], smem["b"].at[1], res_bar.at[1])

        def step(slot, db, mode):
          plgpu.barrier_wait(handed[0].at[slot])
          return ops.matmul_acc(db, smem["ds"].at[slot], a_smem.at[slot])

        db = st.compute_loops(ranges, origin, zeros(d), step, stages, ready, consumed)
        plgpu.barrier_wait(res_bar.at[1])
        store("dk", key_map_vjp(db, 1), 1, batch, cols, head, wait=True)

      return base + ranges[1] - ranges[0]

    def copies(item, s):
      batch, head, _, _ = tile_of(item)
      rows = pl.ds(s * bq, bq)
      src = {"a": a_ref.at[batch, rows, head], "do": do_ref.at[batch, rows, head],
             "lse": lse_ref.at[batch, head, rows], "delta": delta_ref.at[batch, head, rows],
             "qpos": qpos_ref.at[batch, rows]}
      if qseg_ref is not None:
        src["qseg"] = qseg_ref.at[batch, rows]
      return tuple((src[n], str_smem[n]) for n in streamed)

    _fork(sched_ref, roles_item_body if roles else item_body,
          lambda for_items: st.memory_warpgroup(for_items, tile_of, tab_ref, copies, stages,
                                                consumed, ready))

  st.check_smem(scratch, "dk/dv", f"lower BlockSizes.stages ({stages}), block_kv_dkv ({bk}) or "
                f"block_q_dkv ({bq})")
  out_type = {"dk": jax.ShapeDtypeStruct((bsz, s_len, n_heads, h), dtype),
              "dv": jax.ShapeDtypeStruct((bsz, s_len, n_heads, vd), dtype)}
  out = st.launch(pope_dkv_kernel, out_type, scratch, ctas=schedule.shape[0], compute_wgs=wgs)(
      a, b, v, do, lse, delta, q_pos, k_pos, table, schedule, *(segments or ()))
  return out["dk"], out["dv"]
