"""Compute-warpgroup operations whose GPU and CPU-interpreter paths differ.

On the GPU: wgmma matmuls (fresh, accumulating, and the backward's gradient step)
and a lane vote; in the CPU interpreter (`_streaming.interpreted`), which has no register-operand
wgmma, no `run_state` and no warp vote, the same values computed in turn with jnp.

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
  """a @ b on the tensor cores (wgmma) into a fresh float32 accumulator of `shape`.

  a is an SMEM ref or a register value, b an SMEM ref. `then()`, if given, runs after the
  wgmma is issued and before its result is awaited (the ping-pong schedule barrier). The CPU
  interpreter's wgmma takes only SMEM operands, so there a register lhs is multiplied with
  jnp.dot (float32 accumulation).
  """
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
  """acc + a @ b for each (acc, b) of zip(accs, bs): wgmmas of one lhs a (SMEM ref or register
  value), all issued before any is awaited. The CPU interpreter computes them in turn."""
  if st.interpreted():  # The interpreter does not implement run_state.
    return tuple(acc + matmul(a, b, acc.shape) for acc, b in zip(accs, bs))

  def run(acc_refs):
    for acc_ref, b in zip(acc_refs, bs):
      plgpu.wgmma(acc_ref, a, b)
  return tuple(pl.run_state(run)(tuple(plgpu.ACC.init(acc) for acc in accs)))


def gradient_step(scores, dscores, probs, ds_of, p_terms, ds_terms, dtype, *, overlap: bool):
  """One streamed step of a flash-attention backward kernel (FlashAttention-2, Dao 2023, Alg. 2).

  S = scores' lhs @ rhs, P = probs(S), dP = dscores' lhs @ rhs and dS = ds_of(P, dP) (float32
  tiles); each (acc, rhs) of `p_terms` becomes acc + P @ rhs and each of `ds_terms` acc + dS @
  rhs, with P and dS cast to `dtype` (register operands). dP is computed only when `ds_terms`
  is not empty.

  In order (`overlap` False; also on the CPU interpreter) each wgmma is awaited before the
  next. With `overlap`, the order of FlashAttention-3's backward (Shah et al. 2024; its Hopper
  backward main loop, flash-attention `hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp`): S and dP
  are issued together and P is computed while dP is on the tensor cores; P's updates are
  issued before dP is awaited, so they run while dS is computed; S and dP are awaited as
  needed (leaving the later wgmmas in flight), the updates once, at the end. Both score tiles
  are live at once (register pressure: two [M, N] float32 tiles).

  Args:
    scores, dscores: (lhs, rhs, [M, N] shape) of S and dP; SMEM operands.
    probs: float32 [M, N] S -> float32 P; ds_of: (P, dP) -> float32 dS.
    p_terms, ds_terms: tuples of (float32 accumulator [M, W], SMEM rhs [N, W]).
    dtype: dtype of the register operands P and dS.
    overlap: the FlashAttention-3 order above.

  Returns:
    (the updated accumulators of p_terms, those of ds_terms), two tuples.
  """
  if not overlap or st.interpreted():
    p = probs(matmul(*scores))
    p_low = p.astype(dtype)
    p_accs = tuple(matmul_acc(acc, p_low, rhs) for acc, rhs in p_terms)
    if not ds_terms:
      return p_accs, ()
    ds = ds_of(p, matmul(*dscores)).astype(dtype)
    return p_accs, tuple(matmul_acc(acc, ds, rhs) for acc, rhs in ds_terms)

  terms = p_terms + ds_terms

  def run(s_ref, *refs):
    dp_ref, acc_refs = (refs[0], refs[1:]) if ds_terms else (None, refs)
    for ref, (acc, _) in zip(acc_refs, terms):
      ref[...] = acc
    plgpu.wgmma(s_ref, *scores[:2])
    if ds_terms:
      plgpu.wgmma(dp_ref, *dscores[:2])
    p = probs(plgpu.wgmma_accumulator_load(s_ref, wait_n=1 if ds_terms else 0))
    p_low = p.astype(dtype)
    for ref, (_, rhs) in zip(acc_refs, p_terms):
      plgpu.wgmma(ref, p_low, rhs)
    if ds_terms:  # dP was issued before P's updates: it completes first.
      dp = plgpu.wgmma_accumulator_load(dp_ref, wait_n=len(p_terms))
      ds = ds_of(p, dp).astype(dtype)
      for ref, (_, rhs) in zip(acc_refs[len(p_terms):], ds_terms):
        plgpu.wgmma(ref, ds, rhs)
    return tuple(ref[...] for ref in acc_refs)

  allocs = [plgpu.ACC(scores[2], jnp.float32)]
  allocs += [plgpu.ACC(dscores[2], jnp.float32)] if ds_terms else []
  allocs += [plgpu.ACC(acc.shape, jnp.float32) for acc, _ in terms]
  accs = pl.run_scoped(run, *allocs)
  return accs[:len(p_terms)], accs[len(p_terms):]


def warp_any(flags: jax.Array) -> jax.Array:
  """Whether any row of `flags` ([rows] bool, WGMMA row layout) held by this thread's warp is
  set: a scalar bool, uniform within each warp (the lanes' vote, `vote.sync.any`), that may
  differ between the warps of a warpgroup, for a `lax.cond` whose branches hold no
  warpgroup-wide operation (wgmma, barriers). The CPU interpreter runs a warpgroup as one
  program and takes the OR over all rows, which callers must accept as well (a branch taken
  where the warp's vote alone would have skipped it). The result is declared `WG_SPLAT` (one
  value per warpgroup) but is only uniform per warp: nothing may rely on it agreeing across
  the warpgroup's warps."""
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
    return mgpu.FragmentedArray.splat(nvvm.vote_sync(full_mask, lane, "any"), (),
                                      is_signed=False)

  return vote(flags)
