"""Compute-warpgroup operations whose GPU and CPU-interpreter paths differ.

On the GPU: wgmma matmuls (fresh, accumulating, the backward's gradient step) and a lane vote;
in the CPU interpreter (`_streaming.interpreted`), which has no register-operand wgmma, no
`run_state` and no warp vote, the same values computed in turn with jnp.

Shape letters: M rows of the resident tile, N columns of the streamed step, W accumulator width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import state
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, nvvm, vector

from pallas_kernels import _streaming as st


def matmul(a, b, shape, then=None) -> jax.Array:
  """a @ b (wgmma; a an SMEM ref or registers, b an SMEM ref) into a fresh float32 `shape`;
  `then()` runs between issue and wait (the ping-pong handshake). The interpreter multiplies a
  register lhs with jnp.dot."""
  if st.interpreted() and not isinstance(a, state.AbstractRef | state.TransformedRef):
    out = jnp.dot(a, b[...], preferred_element_type=jnp.float32)
    if then is not None:
      then()
    return out

  def run(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    if then is not None:
      then()
    return acc_ref[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def matmul_acc(acc: jax.Array, a, b) -> jax.Array:
  """acc + a @ b (wgmma accumulating in registers; the interpreter adds a fresh product)."""
  return matmul_accs((acc,), a, (b,))[0]


def matmul_accs(accs, a, bs) -> tuple:
  """acc + a @ b for each (acc, b) of zip(accs, bs), all issued before any is awaited."""
  if st.interpreted():  # The interpreter does not implement run_state.
    return tuple(acc + matmul(a, b, acc.shape) for acc, b in zip(accs, bs))

  def run(acc_refs):
    for acc_ref, b in zip(acc_refs, bs):
      plgpu.wgmma(acc_ref, a, b)
  return tuple(pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc in accs)))


def gradient_step(scores, dscores, probs, ds_of, p_terms, ds_terms, dtype, *, overlap: bool,
                  ds_to=None):
  """One streamed step of a flash-attention backward (FlashAttention-2, Alg. 2): S, P = probs(S),
  dP (only with `ds_terms` or `ds_to`), dS = ds_of(P, dP); each (acc, rhs) of `p_terms` becomes
  acc + P @ rhs and of `ds_terms` acc + dS @ rhs (P, dS cast to `dtype`); `ds_to(dS)` runs once
  dS is computed, before P's updates are awaited. Each wgmma is awaited in turn, or with
  `overlap` (not in the interpreter) in FlashAttention-3's backward order: S and dP issued
  together, P's updates in flight while dS is computed (two float32 score tiles live).
  scores, dscores: (lhs, rhs, [M, N]) SMEM operands of S and dP; probs, ds_of: float32 tile
  maps; p_terms, ds_terms: ((float32 [M, W], SMEM rhs [N, W]), ...); ds_to: None, or a function
  of dS [M, N] in `dtype` (e.g. a store for another warpgroup). Returns the updated accumulators
  of p_terms and of ds_terms, two tuples."""
  need_ds = bool(ds_terms) or ds_to is not None
  if not overlap or st.interpreted():
    p = probs(matmul(*scores))
    p_low = p.astype(dtype)
    p_accs = tuple(matmul_acc(acc, p_low, rhs) for acc, rhs in p_terms)
    if not need_ds:
      return p_accs, ()
    ds = ds_of(p, matmul(*dscores)).astype(dtype)
    if ds_to is not None:
      ds_to(ds)
    return p_accs, tuple(matmul_acc(acc, ds, rhs) for acc, rhs in ds_terms)

  terms = p_terms + ds_terms

  def run(s_ref, *refs):
    dp_ref, acc_refs = (refs[0], refs[1:]) if need_ds else (None, refs)
    for ref, (acc, _) in zip(acc_refs, terms):
      ref[...] = acc
    plgpu.wgmma(s_ref, *scores[:2])
    if need_ds:
      plgpu.wgmma(dp_ref, *dscores[:2])
    p = probs(plgpu.wgmma_accumulator_load(s_ref, wait_n=1 if need_ds else 0))
    p_low = p.astype(dtype)
    for ref, (_, rhs) in zip(acc_refs, p_terms):
      plgpu.wgmma(ref, p_low, rhs)
    if need_ds:  # dP was issued before P's updates: it completes first.
      dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=len(p_terms))
      ds = ds_of(p, dp).astype(dtype)
      if ds_to is not None:
        ds_to(ds)
      for ref, (_, rhs) in zip(acc_refs[len(p_terms):], ds_terms):
        plgpu.wgmma(ref, ds, rhs)
    return tuple(ref[...] for ref in acc_refs)

  allocs = [plgpu.ACC(scores[2], jnp.float32)]
  allocs += [plgpu.ACC(dscores[2], jnp.float32)] if need_ds else []
  allocs += [plgpu.ACC(acc.shape, jnp.float32) for acc, _ in terms]
  accs = pl.run_scoped(run, *allocs)
  return accs[:len(p_terms)], accs[len(p_terms):]


def warp_any(flags: jax.Array) -> jax.Array:
  """Whether any row of `flags` ([rows] bool, WGMMA row layout) in this warp is set (a lane
  vote): uniform per warp only, though declared WG_SPLAT, so only for a `lax.cond` without
  warpgroup-wide operations. The interpreter ORs over all rows."""
  if st.interpreted():
    return jnp.any(flags)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(1),),
                     return_type=plgpu.ShapeDtypeStruct((), jnp.bool_, plgpu.Layout.WG_SPLAT))
  def vote(_, flags):
    i1 = ir.IntegerType.get_signless(1)
    lane = None
    for reg in flags.registers.flat:
      for i in range(ir.VectorType(reg.type).shape[0]):
        bit = vector.extract(reg, [], [i])
        lane = bit if lane is None else arith.ori(lane, bit)
    assert lane.type == i1, lane.type
    full_mask = arith.constant(ir.IntegerType.get_signless(32), 0xFFFFFFFF)
    return mgpu.FragmentedArray.splat(nvvm.vote_sync(full_mask, lane, "any"), (), is_signed=False)

  return vote(flags)
