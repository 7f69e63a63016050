"""Time the float32 dq traffic that a fused PoPE backward (dq added into GMEM per step) adds.

A FlashAttention-3-style fused backward keeps each CTA's key tiles resident and, at every
streamed query step, adds that step's dq rows into a float32 buffer by TMA reduce-add (as
FlashAttention-3's backward accumulates dQ). This script runs only that traffic: a Mosaic GPU
kernel on the dk/dv kernel's persistent schedule (`pallas_kernels._streaming.launch_schedule`)
whose every step writes a [64, W] float32 tile to SMEM and adds it into dq [B, T, N, W] (B=4,
N=16, T=S=4096, causal), with nothing else in the kernel: the memory traffic that a fused kernel
adds to its own, timed alone, to set beside the dq kernel that fusion would remove
(docs/kernel.md, "Why the backward is two kernels"). Cases (`CASES`): W = H (dq through the
query map's VJP at each step) or 2H (the Cartesian da), 64 or 128 keys per CTA, and the same
bytes stored without the reduction.

    python -m experiments.bench_dq_reduce [--out bench_dq_reduce.json] [--iters 20]

Prints per case: ms per call (the median of five windows of --iters calls, after two warm-up
calls, less the time of the zero fill of dq timed alike), GB added and the rate; and whether dq holds the exact
count of adds (each add is 1.0). Needs a Hopper GPU.
"""

from __future__ import annotations

import json
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from experiments import _timing, common
from pallas_kernels import _streaming as st

BATCH, HEADS, SEQ, QUERY_ROWS = 4, 16, 4096, 64
# float32 SMEM tiles: 32 columns (128 bytes) per swizzle atom.
F32_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


class Case(NamedTuple):
  label: str
  width: int       # dq columns added per query row and step (W)
  key_rows: int    # keys resident per CTA item (a fused kernel's key tiles)
  reduce: bool     # TMA reduce-add; False: the same bytes stored


CASES = (
    Case("H=128, 64 keys per CTA, dq through the VJP per step (W=H)", 128, 64, True),
    Case("H=128, 64 keys per CTA, the same bytes stored", 128, 64, False),
    Case("H=128, 64 keys per CTA, Cartesian da (W=2H)", 256, 64, True),
    Case("H=128, 128 keys per CTA, W=H", 128, 128, True),
    Case("H=64, 128 keys per CTA, Cartesian da (W=2H)", 128, 128, True),
    Case("H=64, 128 keys per CTA, dq through the VJP per step (W=H)", 64, 128, True),
)


def visits_per_tile(key_rows: int) -> np.ndarray:
  """Causal query steps of `QUERY_ROWS` rows that each resident key tile of `key_rows` keys
  visits, [SEQ / key_rows] int."""
  return SEQ // QUERY_ROWS - np.arange(SEQ // key_rows) * (key_rows // QUERY_ROWS)


def added_gb(case: Case) -> float:
  """GB of float32 that `case` adds into dq per call."""
  steps = float(visits_per_tile(case.key_rows).sum()) * BATCH * HEADS
  return steps * QUERY_ROWS * case.width * 4e-9


def dq_adds(case: Case):
  """A jitted () -> dq [B, T, N, W] float32: zeros, then 1.0 added at every (key tile, query
  step) visit by a one-warpgroup persistent kernel (TMA reduce-add, or plain stores)."""
  steps = visits_per_tile(case.key_rows)
  n_tiles = len(steps)
  schedule = jnp.asarray(st.launch_schedule(BATCH, HEADS, n_tiles, steps, longest_last_tile=False))
  first_step = lambda tile: tile * (case.key_rows // QUERY_ROWS)

  def body(sched_ref, dq_ref, _, staging):
    ones = plgpu.layout_cast(jnp.full((QUERY_ROWS, case.width), 1.0, jnp.float32),
                             plgpu.Layout.WGMMA)

    def item_body(item, carry):
      batch, head, tile = st.item_coords(item, HEADS, n_tiles, last_tile_first=False)

      def step(s, n):
        buf = lax.rem(n, 2)
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the add two steps back read it
        staging.at[buf][...] = ones
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staging.at[buf], dq_ref.at[batch, pl.ds(s * QUERY_ROWS,
                                                                         QUERY_ROWS), head],
                                reduction_op="add" if case.reduce else None)
        return n + 1
      return lax.fori_loop(first_step(tile), SEQ // QUERY_ROWS, step, carry)

    st.for_each_item(sched_ref)(item_body, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((1,), jnp.float32), grid=(schedule.shape[0],),
      grid_names=("cta",), num_threads=1, thread_name="wg",
      scratch_types=[plgpu.SMEM((2, QUERY_ROWS, case.width), jnp.float32,
                                transforms=F32_TRANSFORMS)])

  @jax.jit
  def run():
    dq = jax.new_ref(jnp.zeros((BATCH, SEQ, HEADS, case.width), jnp.float32))
    kernel(schedule, dq)
    return jax.freeze(dq)
  return run


def measure(case: Case, iters: int) -> dict:
  """One case's row: ms (zero fill subtracted), GB, TB/s and whether every add landed."""
  adds = dq_adds(case)
  fill = jax.jit(lambda: jnp.zeros((BATCH, SEQ, HEADS, case.width), jnp.float32))
  # Windows of exactly --iters calls, five of them.
  total_ms, fill_ms = (_timing.wall_ms(f, iters=iters, windows=5, min_window_ms=0.0)
                       for f in (adds, fill))
  dq = adds()
  ms, gb = total_ms - fill_ms, added_gb(case)
  row = {"case": case.label, **case._asdict(), "ms": ms, "gb": gb, "tb_per_s": gb / ms}
  if case.reduce:  # query row t is visited by key tiles 0 .. t // key_rows
    want = (np.arange(SEQ) // case.key_rows + 1).astype(np.float32)
    row["sums_exact"] = bool(np.array_equal(np.asarray(dq[:, :, :, 0]),
                                            np.broadcast_to(want[None, :, None], dq.shape[:3])))
  return row


def main(argv=None):
  parser = common.make_parser("bench_dq_reduce", __doc__)
  parser.add_argument("--out", default="bench_dq_reduce.json", help="JSON results file")
  parser.add_argument("--iters", type=common.positive_int, default=20,
                      help="calls per timing window")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    parser.error("needs a GPU (Hopper): the kernel uses TMA reduce-add")
  rows = []
  print({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "date": time.strftime("%Y-%m-%d %H:%M:%S"), "iters": args.iters}, flush=True)
  for case in CASES:
    row = measure(case, args.iters)
    rows.append(row)
    exact = {True: "; every add landed", False: "; ADDS MISSING"}.get(row.get("sums_exact"), "")
    print(f"{case.label}: {row['ms']:.3f} ms, {row['gb']:.2f} GB, {row['tb_per_s']:.2f} TB/s"
          f"{exact}", flush=True)
  with open(args.out, "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
  return 0 if all(r.get("sums_exact", True) for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
