"""Shared pieces of the warp-specialised PoPE attention kernels (Mosaic GPU, Hopper).

Each kernel's CTA (at most one per SM) runs items, a resident tile per compute warpgroup (with
`dkv_roles` one for both), as a static schedule assigns them (`launch_schedule`); a memory
warpgroup streams the other operand's tiles through a ring of `stages` SMEM slots with TMA. Which
streamed steps a resident tile visits is precomputed in XLA from the positions
(`visit_table`), so causal block skipping is exact for any positions:

  [u_lo, lo)   visited by another warpgroup only: wait, release, no math
  [lo, flo)    partly visible: masked by position
  [flo, fhi)   fully visible: no mask
  [fhi, hi)    partly visible: masked by position
  [hi, u_hi)   as the first range

Shape letters: B batch, R resident tiles, C streamed steps.
"""

from __future__ import annotations

import heapq
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config
from jax._src.pallas.mosaic_gpu import core as pallas_mgpu_core
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# --- Trace time (XLA, numpy): the steps each resident tile visits; which CTA runs which items.

COMPUTE_WGS = 2
# Positions travel as float32 (exact below 2**24); padding rows get these sentinels.
KEY_PAD = 1e9
QUERY_PAD = -1e9
QUERY_SEES_ALL = 5e8
M_INIT = -1e30


def visit_table(row_pos: jax.Array, col_pos: jax.Array, row_block: int, col_block: int, *,
                rows_are_queries: bool, wgs: int = COMPUTE_WGS, row_seg=None,
                col_seg=None) -> jax.Array:
  """Per group of `wgs` resident tiles (an item) the streamed-step ranges of its warpgroups,
  [B, ceil(R / wgs), 2 + 4 * wgs] int32, a row [u_lo, u_hi, lo0, flo0, fhi0, hi0, lo1, ...],
  from the float32 positions row_pos [B, R * row_block] of the resident side (queries in the
  forward and dq, by `rows_are_queries`; keys in dk/dv) and col_pos [B, C * col_block] of the
  streamed side, and optionally their float32 segment ids row_seg, col_seg of the same shapes
  (a key is visible only in its query's segment: tiles whose id ranges do not meet are skipped,
  and only tiles of a single common id are unmasked). `wgs`: compute warpgroups per CTA; where
  R is not a multiple of it, the last group has tiles past the rows, which visit nothing."""
  b = row_pos.shape[0]
  rows = -(-row_pos.shape[1] // (wgs * row_block)) * wgs * row_block
  row_pos = jnp.pad(row_pos, ((0, 0), (0, rows - row_pos.shape[1])),
                    constant_values=QUERY_PAD if rows_are_queries else KEY_PAD)
  r = row_pos.reshape(b, -1, row_block)
  c = col_pos.reshape(b, -1, col_block)
  rmin, rmax = r.min(-1)[:, :, None], r.max(-1)[:, :, None]
  cmin, cmax = c.min(-1)[:, None, :], c.max(-1)[:, None, :]
  if rows_are_queries:  # key s visible to query t iff kpos[s] <= qpos[t]
    any_vis, all_vis = cmin <= rmax, cmax <= rmin
  else:
    any_vis, all_vis = rmin <= cmax, rmax <= cmin
  if row_seg is not None:  # the tiles' segment id ranges [lo, hi] must meet (all: one id)
    row_seg = jnp.pad(row_seg, ((0, 0), (0, rows - row_seg.shape[1])), mode="edge")
    rs, cs = row_seg.reshape(b, -1, row_block), col_seg.reshape(b, -1, col_block)
    rs_lo, rs_hi = rs.min(-1)[:, :, None], rs.max(-1)[:, :, None]
    cs_lo, cs_hi = cs.min(-1)[:, None, :], cs.max(-1)[:, None, :]
    any_vis &= (rs_lo <= cs_hi) & (cs_lo <= rs_hi)
    all_vis &= (rs_lo == rs_hi) & (cs_lo == cs_hi) & (rs_lo == cs_lo)
  n_cols = c.shape[1]
  idx = jnp.arange(n_cols, dtype=jnp.int32)[None, None, :]
  lo = jnp.where(any_vis, idx, n_cols).min(-1)
  hi = jnp.where(any_vis, idx + 1, 0).max(-1)
  empty = hi <= lo
  lo, hi = jnp.where(empty, 0, lo), jnp.where(empty, 0, hi)
  inside = (idx >= lo[..., None]) & (idx < hi[..., None])
  flo = jnp.where(all_vis & inside, idx, hi[..., None]).min(-1)
  fhi = jnp.where((idx >= flo[..., None]) & ~all_vis, idx, hi[..., None]).min(-1)
  fhi = jnp.minimum(fhi, hi)
  pair = lambda x: x.reshape(b, -1, wgs)
  lo, flo, fhi, hi, empty = map(pair, (lo, flo, fhi, hi, empty))
  big = jnp.int32(n_cols + 1)
  u_lo = jnp.where(empty, big, lo).min(-1)
  u_hi = jnp.where(empty, 0, hi).max(-1)
  all_empty = u_hi <= 0
  u_lo, u_hi = jnp.where(all_empty, 0, u_lo), jnp.where(all_empty, 0, u_hi)
  fill = lambda x: jnp.where(empty, u_lo[..., None], x)
  lo, flo, fhi, hi = map(fill, (lo, flo, fhi, hi))
  per_wg = jnp.stack([lo, flo, fhi, hi], axis=-1).reshape(b, -1, 4 * wgs)
  return jnp.concatenate([u_lo[..., None], u_hi[..., None], per_wg], axis=-1).astype(jnp.int32)


def causal_steps(n_tiles: int, tile_rows: int, n_cols: int, step_cols: int, offset: int, *,
                 causal: bool, rows_are_queries: bool) -> np.ndarray:
  """Estimated streamed steps per resident tile for `launch_schedule`, at the default positions
  (query t at offset + t, key s at s); without `causal`, all of them."""
  tiles = np.arange(n_tiles)
  if not causal:
    return np.full(n_tiles, -(-n_cols // step_cols))
  if rows_are_queries:  # keys up to the tile's last query
    visible = np.clip(offset + (tiles + 1) * tile_rows, 0, n_cols)
  else:  # queries from the tile's first key on
    visible = n_cols - np.clip(tiles * tile_rows - offset, 0, n_cols)
  return -(-visible // step_cols)


def num_sms() -> int:
  """Streaming multiprocessors of the first device (132 on the H200); unlimited in the CPU
  interpreter, so each CTA runs one item (several per CTA can hang on a machine with few cores)."""
  if interpreted():
    return 2 ** 31 - 1
  return getattr(jax.local_devices()[0], "core_count", 132)


def launch_schedule(bsz: int, n_heads: int, n_tiles: int, steps: np.ndarray,
                    longest_last_tile: bool) -> np.ndarray:
  """Which CTA runs which of a kernel's items (`item_coords`; rank 0 is the last tile when
  `longest_last_tile`, else tile 0), [grid, 1 + max items per CTA] int32: per CTA its item count,
  then its items (-1 padding). At most one CTA per SM (`num_sms`); each item in launch order goes
  to the CTA with the least work so far by `causal_steps`' [n_tiles] `steps`, so a batch's items
  run together and its keys stay in L2."""
  ranks = np.arange(n_tiles)
  per_rank = steps[n_tiles - 1 - ranks] if longest_last_tile else steps[ranks]
  lengths = np.tile(np.repeat(per_rank, n_heads), bsz)  # per item, in launch order
  grid = min(len(lengths), num_sms())
  loads = [(0.0, c) for c in range(grid)]
  items = [[] for _ in range(grid)]
  for item, length in enumerate(lengths):
    load, c = heapq.heappop(loads)
    items[c].append(item)
    heapq.heappush(loads, (load + float(length) + 1.0, c))  # + a tile's prologue and epilogue
  table = np.full((grid, 1 + max(len(x) for x in items)), -1, np.int32)
  for c, x in enumerate(items):
    table[c, 0], table[c, 1:1 + len(x)] = len(x), x
  return table


# --- In the kernel: a CTA's items, and a compute warpgroup's loops over its visit ranges.

def cta_items(schedule_ref):
  """This CTA's items from its row of the `launch_schedule` table (in GMEM): (item_of, count),
  item_of(j) its j-th item for j < count."""
  c = lax.axis_index("cta")
  return (lambda j: schedule_ref[c, 1 + j]), schedule_ref[c, 0]


def for_each_item(schedule_ref):
  """for_items(body, carry): carry = body(item, carry) over this CTA's items (`cta_items`)."""
  item_of, count = cta_items(schedule_ref)
  return lambda body, carry: lax.fori_loop(0, count, lambda j, c: body(item_of(j), c), carry)


def item_coords(item, n_heads: int, n_tiles: int, *, last_tile_first: bool):
  """(batch, head, resident tile) of a flat item index: heads vary fastest, then the rank,
  then the batch. Rank 0 is the tile that sees the most of the stream under a causal mask: the
  last one with `last_tile_first` (resident queries), else tile 0 (resident keys)."""
  batch, head, rank = lax.div(item, n_heads * n_tiles), lax.rem(item, n_heads), lax.rem(
      lax.div(item, n_heads), n_tiles)
  return batch, head, n_tiles - 1 - rank if last_tile_first else rank


def read_ranges(tab_ref, batch, tile, wg):
  """(u_lo, u_hi, lo, flo, fhi, hi) of an item's warpgroup `wg` from the visit table."""
  u_lo, u_hi = tab_ref[batch, tile, 0], tab_ref[batch, tile, 1]
  return (u_lo, u_hi, *(tab_ref[batch, tile, 2 + 4 * wg + i] for i in range(4)))


def load_resident(copies, wg, barriers) -> None:
  """A backward compute warpgroup's resident tiles: once the previous item's stores have read
  SMEM, copies each (gmem ref, smem buffers) of `copies` into the buffers' row `wg`, and waits."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for i, (src, dst) in enumerate(copies):
    plgpu.copy_gmem_to_smem(src, dst.at[wg], barriers.at[i * COMPUTE_WGS + wg])
  for i in range(len(copies)):
    plgpu.barrier_wait(barriers.at[i * COMPUTE_WGS + wg])


def compute_loops(ranges, origin, carry, step, stages: int, ready, consumed, skipped=None):
  """A compute warpgroup's steps s of one item over its five ranges: each waits for its ring
  slot (origin = u_lo - the ring's step at u_lo, `memory_warpgroup`), runs carry = step(slot,
  carry, mode), mode "masked" or "full" (a "skip" step calls `skipped` after), and releases it."""
  def run(s, carry, mode):
    with jax.named_scope("wait_kv"):
      slot = lax.rem(s - origin, stages)
      plgpu.barrier_wait(ready.at[slot])
    if mode != "skip":
      carry = step(slot, carry, mode)
    plgpu.barrier_arrive(consumed.at[slot])
    if mode == "skip" and skipped is not None:
      skipped()
    return carry

  u_lo, u_hi, lo, flo, fhi, hi = ranges
  for start, stop, mode in ((u_lo, lo, "skip"), (lo, flo, "masked"), (flo, fhi, "full"),
                            (fhi, hi, "masked"), (hi, u_hi, "skip")):
    carry = lax.fori_loop(start, stop, lambda s, c, mode=mode: run(s, c, mode), carry)
  return carry


def causal_mask(scores, k_pos, q_pos, key_axis: int, k_seg=None, q_seg=None):
  """`scores` where the key position (`k_pos`, along `key_axis`) is <= the query's and, given
  segment ids `k_seg`, `q_seg` (laid out as the positions), the key's id equals the query's;
  else -inf."""
  key = lambda x: broadcast(x, scores.shape, key_axis)
  query = lambda x: broadcast(x, scores.shape, 1 - key_axis)
  visible = key(k_pos) <= query(q_pos)
  if k_seg is not None:
    visible &= key(k_seg) == query(q_seg)
  return jnp.where(visible, scores, float("-inf"))


# --- The memory warpgroup: one ring of SMEM slots over all of a CTA's items.

def memory_warpgroup(for_items, tile_of, tab_ref, copies, stages: int, consumed, ready,
                     registers: int = 40):
  """The TMA warpgroup of every kernel here. For each item (`for_items`), whose resident tile
  tile_of(item) = (batch, ..., tile) visits the steps [u_lo, u_hi) of `tab_ref` (`visit_table`),
  step s is the ring's step n = base + s - u_lo: once step n - stages released slot n % stages,
  each (gmem ref, smem buffers) of `copies(item, s)` is copied into it, signalling its `ready`
  barrier (the next item's copies overlap this one's math). Ends once the last steps released."""
  plgpu.set_max_registers(registers, action="decrease")

  def item_body(item, base):
    coords = tile_of(item)
    u_lo, u_hi = tab_ref[coords[0], coords[-1], 0], tab_ref[coords[0], coords[-1], 1]

    def step(s, _):
      n = base + s - u_lo
      slot = lax.rem(n, stages)

      @pl.when(n >= stages)
      def _wait():
        with jax.named_scope("wait_release"):
          plgpu.barrier_wait(consumed.at[slot])

      for src, dst in copies(item, s):
        plgpu.copy_gmem_to_smem(src, dst.at[slot], ready.at[slot])

    lax.fori_loop(u_lo, u_hi, step, None)
    return base + u_hi - u_lo

  steps = for_items(item_body, jnp.int32(0))
  lax.fori_loop(jnp.maximum(steps - stages, 0), steps,
                lambda n, _: plgpu.barrier_wait(consumed.at[lax.rem(n, stages)]), None)


def stream_keys(for_items, tile_of, tab_ref, gmem, smem, group: int, block_kv: int,
                stages: int, consumed, ready, registers: int = 40):
  """`memory_warpgroup` for resident queries (forward, dq): per step rows of `gmem` (b [B, S, K, D],
  v [B, S, K, V], key positions [B, S], then optionally key segment ids [B, S]) into `smem`'s
  slots; `group` query heads per kv head."""
  def copies(item, s):
    batch, head, _ = tile_of(item)
    kv_head = lax.div(head, jnp.int32(group))
    cols = pl.ds(s * block_kv, block_kv)
    b_ref, v_ref, *per_key = gmem
    return zip((b_ref.at[batch, cols, kv_head], v_ref.at[batch, cols, kv_head],
                *(ref.at[batch, cols] for ref in per_key)), smem)

  memory_warpgroup(for_items, tile_of, tab_ref, copies, stages, consumed, ready, registers)


# --- SMEM budget, platform and compiler settings.

def smem_bytes(scratch) -> int:
  """An upper bound on a scratch pytree's SMEM bytes (buffers, barriers aligned as Pallas does)."""
  sizes = [math.prod(buf.shape) * jnp.dtype(buf.dtype).itemsize
           if isinstance(buf, pallas_mgpu_core.GPUMemoryRef) else 8 * math.prod(buf.num_barriers)
           for buf in jax.tree.leaves(scratch)]
  return sum(pallas_mgpu_core.align_to(n, pallas_mgpu_core.SMEM_ALIGNMENT) for n in sizes)


def smem_limit() -> int:
  """SMEM per CTA of the first device (227 KiB on Hopper, and in the interpreter)."""
  return getattr(jax.local_devices()[0], "shared_memory_per_block_optin", 227 * 1024)


def check_smem(scratch, kernel: str, hint: str) -> None:
  """Raises ValueError naming the kernel and `hint` where its scratch does not fit in SMEM."""
  need, limit = smem_bytes(scratch), smem_limit()
  if need > limit:
    raise ValueError(f"The PoPE {kernel} kernel's SMEM buffers need about {need} bytes, more "
                     f"than the {limit} available: {hint}")


def interpreted() -> bool:
  return jax.default_backend() != "gpu"


# Set, kernels compiled afterwards write a Perfetto trace per call here (`trace_attention`).
PROFILE_DIR_ENV = "POPE_KERNEL_PROFILE_DIR"
PROFILE_SPACE = 512  # scopes recorded per warpgroup and call; later ones are dropped


def launch(body, out_type, scratch, *, ctas: int, compute_wgs: int):
  """`plgpu.kernel` of a body with `compute_wgs` compute warpgroups and one memory warpgroup,
  with approximate math and, under PROFILE_DIR_ENV, the profiler."""
  profile_dir = os.environ.get(PROFILE_DIR_ENV, "")
  params = plgpu.CompilerParams(approx_math=True, profile_dir=profile_dir,
                                profile_space=PROFILE_SPACE if profile_dir else 0,
                                profile_bounds_check=bool(profile_dir))
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(ctas,),
                      grid_names=("cta",), num_threads=compute_wgs + 1, thread_name="wg",
                      compiler_params=params)


# --- Register layouts.

def row_vector(smem_ref, rows_axis: int):
  """Loads a [n] float32 SMEM vector laid out along `rows_axis` of a WGMMA tile."""
  return plgpu.load(smem_ref, layout=plgpu.Layout.WGMMA.reduce(1 - rows_axis))


def broadcast(x, shape, axis: int):
  return lax.broadcast_in_dim(x, shape, [axis])


def tile_transforms(width: int = 64):
  """SMEM tiling and swizzle of a 16-bit tile `width` (16, 32, or k·64) or more columns wide."""
  swizzle = min(width, 64) * 2
  return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


# --- The magnitude map (PoPE Eq. 3).

# log1p(e) = e·P(e) on [0, 1], P of degree 6 with P(0) = 1, fitted to the relative error.
_LOG1P_COEFFS = (1.0, -0.49990746, 0.33140427, -0.23611341, 0.15102765, -0.06785116, 0.014588303)
# `softplus`'s relative error bound against the exact softplus, every float32 x.
SOFTPLUS_RTOL = 2e-6


def softplus(x):
  """μ = softplus(x) = max(x, 0) + log1p(exp(-|x|)) in float32 with log1p(e) = e·P(e)
  (`_LOG1P_COEFFS`; six FMAs, so the key map runs at memory speed): the kernels' magnitude map
  (PoPE Eq. 3), within SOFTPLUS_RTOL relatively for every x, tiny μ included."""
  x = x.astype(jnp.float32)
  e = jnp.exp(-jnp.abs(x))
  poly = _LOG1P_COEFFS[-1]
  for c in reversed(_LOG1P_COEFFS[:-1]):
    poly = poly * e + c
  return jnp.maximum(x, 0.0) + poly * e


def hopper_reason(kernel: str) -> str | None:
  """Why `kernel` cannot run here, or None: Hopper GPUs (sm90) and the Mosaic GPU interpreter
  (`plgpu.force_gpu_interpret_mode()`) run the kernels of this package."""
  # The interpreter switch has no public getter; read the config it sets.
  if jax_config.pallas_tpu_interpret_mode_context_manager.value is not None:
    return None
  device = jax.devices()[0]
  capability = str(getattr(device, "compute_capability", "") or "")
  if device.platform == "gpu" and capability.startswith("9."):
    return None
  where = f"{device.platform!r} {capability}".rstrip()
  return f"{kernel} runs on NVIDIA Hopper GPUs (sm90), not on {where}"
