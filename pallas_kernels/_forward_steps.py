"""The streamed steps of one item of the forward kernel: QKᵀ, online softmax, PV.

`ItemSteps` runs a compute warpgroup's steps over an item's visit ranges for
`pope_attention_fwd._ForwardKernel`, whose static settings and refs it reads.

Shape letters: bq resident query rows, bk streamed key rows, V value width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _streaming as st
from pallas_kernels import _warpgroup_ops as ops

# Width of the ones tile and of the row-sum accumulator of `BlockSizes.row_sum_mma`: the
# narrowest wgmma B operand (a 32-byte swizzle of 16-bit elements).
ROW_SUM_COLS = 16


class ItemSteps:
  """The streamed steps of one item of a compute warpgroup: QKᵀ, the online softmax of the
  score tile, and PV (`step`), over the item's visit ranges (`loops`)."""

  def __init__(self, k, wg, a_lhs, qpos, ranges, origin):
    self.k, self.r, self.wg, self.a_lhs, self.qpos = k, k.refs, wg, a_lhs, qpos
    self.ranges, self.origin = ranges, origin  # this item's first step is the ring's `base`
    self.ones_smem, self.handshake = k.refs.ones_smem, k.handshake

  def softmax(self, s_blk, m_i, l_i, slot, mode, bounded=False):
    """Online softmax of one score tile: (m, l, P, alpha), alpha the per-row factor of the old
    acc (`rescale`; 1 where the max stays, None: no rescale); P in q's dtype. Under
    `rescale_threshold` a row's max moves only when its block max exceeds it by more than
    that, so P <= 2**rescale_threshold. With `bounded` (every score within
    ±BOUNDED_SCORE_LIMIT) m stays 0: P = exp2(scores), no max and no rescale. Under
    `row_sum_mma` the returned l lacks this step's P, which `pv` adds, and its rescale, which
    `rescale` applies."""
    k, bq, bk = self.k, self.k.bq, self.k.bk
    with jax.named_scope("softmax"):
      if mode == "masked":
        s_blk = st.causal_mask(s_blk, st.row_vector(self.r.kpos_smem.at[slot], 1), self.qpos, 1)
      if bounded:
        p = jnp.exp2(s_blk)
        if self.ones_smem is None:
          l_i = l_i + p.sum(axis=1)
        return m_i, l_i, p.astype(k.dtype), None
      m_blk = s_blk.max(axis=1)
      if k.blocks.rescale_threshold is None:
        m_new = jnp.maximum(m_i, m_blk)
      else:
        m_new = jnp.where(m_blk > m_i + k.blocks.rescale_threshold, m_blk, m_i)
      alpha = jnp.exp2(m_i - m_new)  # 1 where the max stays
      p = jnp.exp2(s_blk - st.broadcast(m_new, (bq, bk), 0))
      if self.ones_smem is None:  # (else [bq, ROW_SUM_COLS], rescaled with acc; P @ 1 in `pv`)
        l_i = l_i * alpha + p.sum(axis=1)
      return m_new, l_i, p.astype(k.dtype), alpha

  def rescale(self, acc, l_i, alpha):
    """acc, and under `row_sum_mma` l, times `softmax`'s per-row alpha; under
    `rescale_threshold` only in the warps where some row's max moved (alpha < 1; in the
    others every alpha is 1)."""
    scaled = (acc,) if self.ones_smem is None else (acc, l_i)
    times_alpha = lambda: tuple(x * st.broadcast(alpha, x.shape, 0) for x in scaled)
    if self.k.blocks.rescale_threshold is None:
      scaled = times_alpha()
    else:
      scaled = lax.cond(ops.warp_any(alpha < 1.0), times_alpha, lambda: scaled)
    return scaled if self.ones_smem is not None else (scaled[0], l_i)

  def pv(self, acc, l_i, p, slot):
    """acc + P V and, under `row_sum_mma`, l + P 1, issued together."""
    if self.ones_smem is None:
      return ops.matmul_acc(acc, p, self.r.v_smem.at[slot]), l_i
    return ops.matmul_accs((acc, l_i), p, (self.r.v_smem.at[slot], self.ones_smem.at[self.wg]))

  def step(self, slot, carry, mode, bounded=False):
    """One step as written: QKᵀ, softmax, then PV, each awaited; with ping-pong handshakes
    unless `bounded` (the second hands the tensor cores to the other warpgroup once the
    softmax is done: ptxas may hoist its arrive; its wait stays here)."""
    pp = self.k.ping_pong and not bounded
    acc, m_i, l_i = carry
    with jax.named_scope("qk"):
      s_blk = ops.matmul(self.a_lhs, self.r.b_smem.at[slot].transpose((1, 0)),
                         (self.k.bq, self.k.bk), then=self.handshake if pp else None)
    m_i, l_i, p, alpha = self.softmax(s_blk, m_i, l_i, slot, mode, bounded=bounded)
    if alpha is not None:
      acc, l_i = self.rescale(acc, l_i, alpha)
    if pp:
      acc, m_i, l_i, p = lax.optimization_barrier((acc, m_i, l_i, p))
      self.handshake()
    with jax.named_scope("pv"):
      acc, l_i = self.pv(acc, l_i, p, slot)
    return acc, m_i, l_i

  def loops(self, bounded):
    """The item's steps: (acc, m, l), m and l [bq] (l the row sums of exp2(s - m))."""
    k, bq, wgmma = self.k, self.k.bq, plgpu.Layout.WGMMA
    acc = plgpu.layout_cast(jnp.zeros((bq, k.vd), jnp.float32), wgmma)
    m_i = plgpu.layout_cast(jnp.full((bq,), 0.0 if bounded else st.M_INIT, jnp.float32),
                            wgmma.reduce(1))
    if self.ones_smem is None:
      l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), wgmma.reduce(1))
    else:
      l_i = plgpu.layout_cast(jnp.zeros((bq, ROW_SUM_COLS), jnp.float32), wgmma)
    pp = self.k.ping_pong and not bounded
    acc, m_i, l_i = st.compute_loops(
        self.ranges, self.origin, (acc, m_i, l_i), functools.partial(self.step, bounded=bounded),
        self.k.stages, self.r.ready, self.r.consumed,
        skipped=(lambda: (self.handshake(), self.handshake())) if pp else None)
    if self.ones_smem is not None:  # every column holds the row sums
      l_i = l_i.max(axis=1)
    return acc, m_i, l_i
