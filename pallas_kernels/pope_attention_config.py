"""Block sizes of the fused PoPE attention kernels (tuning knobs only; behaviour lives elsewhere).

Shape letters: H PoPE head dim (the kernels see q, k at width 2H), V value head dim.
"""

from __future__ import annotations

import dataclasses

# The largest `BlockSizes.rescale_threshold`: P is at most 2**15, inside float16's range
# (65504) with room for the bf16/fp16 rounding of P.
MAX_RESCALE_THRESHOLD = 15.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """Tile sizes and schedule switches of the forward, dq and dk/dv kernels.

  Each kernel runs two compute warpgroups per CTA (the forward two or three), each owning one
  resident tile of `block_*` rows at a time, and one memory warpgroup that streams the other
  operand through a pipeline of SMEM slots.

  Attributes:
    block_q: forward query rows per compute warpgroup (resident).
    block_kv: forward key rows per pipeline step (streamed).
    block_q_dq: dq kernel query rows per compute warpgroup (resident).
    block_kv_dq: dq kernel key rows per pipeline step (streamed).
    block_kv_dkv: dk/dv kernel key rows per compute warpgroup (resident).
    block_q_dkv: dk/dv kernel query rows per pipeline step (streamed).
    stages: backward pipeline depth (>= 2; three do not fit at H = 128), the forward's least.
    stages_fwd: forward depth; None: max(3, stages) where it fits in SMEM, else `stages`.
    ping_pong: forward warpgroups take turns on the tensor cores (FA3 §3.1); None: only with two.
    overlap: forward issues QKᵀ of step s with PV of step s - 1 (FA3 §3.2); slower on the H200.
    a_in_registers: forward query tile a in registers, so QKᵀ reads only the keys from SMEM.
    overlap_bwd: backward issues S and dP together (FA3's order); spills with 128-wide streams.
    row_sum_mma: forward row sums as P @ 1 on the tensor cores; the softmax bounds the forward.
    bounded_softmax: bf16 forward skips the running max where PoPE's magnitudes bound a tile.
    rescale_threshold: log2 units a row's max may grow before rescaling (FA4); None: every step.
    query_tables: forward reads cos, sin of pos·θ from a float16 table: half the SFU work.
    persistent: at most one CTA per SM, looping over its tiles and prefetching the next one.
    forward_warpgroups: 2, 3, or None: 3 where they fit in SMEM (softmax overlaps two matmuls).
    split_dkv: dk and dv in two launches: one launch's float32 accumulators spill at H = 128.
  """
  block_q: int = 64
  block_kv: int = 128
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_kv_dkv: int = 64
  block_q_dkv: int = 64
  stages: int = 2
  stages_fwd: int | None = None
  ping_pong: bool | None = True
  overlap: bool = False
  a_in_registers: bool = True
  overlap_bwd: bool = False
  split_dkv: bool = False
  persistent: bool = True
  row_sum_mma: bool = False
  bounded_softmax: bool = False
  rescale_threshold: float | None = None
  query_tables: bool = True
  forward_warpgroups: int | None = 2

  def __post_init__(self):
    for field in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_kv_dkv",
                  "block_q_dkv", "stages", "forward_warpgroups"):
      value = getattr(self, field)
      if field == "forward_warpgroups" and value is None:
        continue
      if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"BlockSizes.{field} must be an int, got {value!r}")
    for field in ("ping_pong", "overlap", "a_in_registers", "overlap_bwd", "split_dkv",
                  "persistent", "row_sum_mma", "bounded_softmax", "query_tables"):
      if field == "ping_pong" and self.ping_pong is None:
        continue
      if not isinstance(getattr(self, field), bool):
        raise TypeError(f"BlockSizes.{field} must be a bool, got {getattr(self, field)!r}")
    for field in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_kv_dkv",
                  "block_q_dkv"):
      value = getattr(self, field)
      if value <= 0 or value % 64:
        raise ValueError(f"BlockSizes.{field} must be a positive multiple of 64, got {value}")
    if self.stages_fwd is not None and (not isinstance(self.stages_fwd, int)
                                        or isinstance(self.stages_fwd, bool)):
      raise TypeError(f"BlockSizes.stages_fwd must be an int or None, got {self.stages_fwd!r}")
    for field in ("stages", "stages_fwd"):
      value = getattr(self, field)
      if value is not None and value < 2:
        raise ValueError(f"BlockSizes.{field} must be at least 2, got {value}")
    if self.rescale_threshold is not None and (
        not isinstance(self.rescale_threshold, (int, float))
        or isinstance(self.rescale_threshold, bool)
        or not 0.0 <= self.rescale_threshold <= MAX_RESCALE_THRESHOLD):
      raise ValueError("BlockSizes.rescale_threshold must be None or a number of log2 units in "
                       f"[0, {MAX_RESCALE_THRESHOLD}], got {self.rescale_threshold!r}")
    least_fwd = self.stages if self.stages_fwd is None else self.stages_fwd
    if self.overlap and self.ping_pong is not False and least_fwd < 3:
      raise ValueError("BlockSizes.overlap with ping_pong needs stages_fwd >= 3 (or, with "
                       "stages_fwd None, stages >= 3): a slot is released one step later; got "
                       f"stages_fwd={self.stages_fwd}, stages={self.stages}")
    if self.forward_warpgroups not in (None, 2, 3):
      raise ValueError("BlockSizes.forward_warpgroups must be 2, 3 or None, got "
                       f"{self.forward_warpgroups}")
    if self.forward_warpgroups == 3 and self.overlap:
      raise ValueError("BlockSizes.overlap is not built for forward_warpgroups=3 (the default "
                       "at head dim <= 64): set forward_warpgroups=2 or overlap=False")
    for field in ("row_sum_mma", "bounded_softmax"):
      if self.overlap and getattr(self, field):
        raise ValueError(f"BlockSizes.{field} is not built for the overlapped schedule "
                         "(overlap=True): set one of them False (default_block_sizes(128) "
                         "sets row_sum_mma)")

  @property
  def seq_multiple(self) -> int:
    """Query and key lengths are zero-padded to a multiple of this."""
    sizes = (2 * self.block_q, self.block_kv, 2 * self.block_q_dq, self.block_kv_dq,
             2 * self.block_kv_dkv, self.block_q_dkv)
    multiple = 1
    for s in sizes:
      multiple = multiple * s // _gcd(multiple, s)
    return multiple


def _gcd(a: int, b: int) -> int:
  while b:
    a, b = b, a % b
  return a


def default_block_sizes(head_dim: int) -> BlockSizes:
  """Heuristic default for PoPE head dim H (q/k tiles are 2H wide; SMEM and registers bound).

  The tuned values on the H200 (the kernel's results page has the measurements):
  at H <= 64 three forward warpgroups where they fit, no ring (faster than two with ping-pong);
  at H = 128 no ping-pong (no gain there), `overlap_bwd`, `split_dkv` (two launches spill less),
  `row_sum_mma`, conditional rescaling at 8 (slower at H = 64) and no query tables (they do not
  fit); `bounded_softmax` stays off: it is slower where no tile is bounded.
  """
  if head_dim <= 64:
    return BlockSizes(block_q=64, block_kv=128, block_kv_dq=128, block_q_dkv=128, stages=2,
                      forward_warpgroups=None, ping_pong=None)
  return BlockSizes(block_q=64, block_kv=64, stages=2, ping_pong=False, overlap_bwd=True,
                    split_dkv=True, row_sum_mma=True, query_tables=False, rescale_threshold=8.0)
