"""Block sizes of the fused PoPE attention kernels (tuning knobs only; behaviour lives elsewhere).

Shape letters: H PoPE head dim (the kernels see q, k at width 2H), V value head dim.
"""

from __future__ import annotations

import dataclasses
import math

# The largest `BlockSizes.rescale_threshold`: P is at most 2**15, inside float16's range.
MAX_RESCALE_THRESHOLD = 15.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """Tile sizes and schedule switches; the defaults are the tuned values at H <= 64.

  Per CTA, two compute warpgroups (the forward two or three) each own a resident tile of
  `block_*` rows (`dkv_roles`: share one); a memory warpgroup streams the other operand.

  Attributes:
    block_q: forward query rows per compute warpgroup (resident).
    block_kv: forward key rows per pipeline step (streamed).
    block_q_dq: dq kernel query rows per compute warpgroup (resident).
    block_kv_dq: dq kernel key rows per pipeline step (streamed).
    block_kv_dkv: dk/dv kernel key rows per compute warpgroup (resident).
    block_q_dkv: dk/dv kernel query rows per pipeline step (streamed).
    stages: backward pipeline depth (>= 2); the forward takes max(3, stages) where it fits.
    forward_warpgroups: 2, 3, or None: 3 where they fit in SMEM (softmax overlaps two matmuls).
    ping_pong: two forward warpgroups take turns on the tensor cores (FA3 §3.1); not with 3.
    overlap_bwd: backward issues S and dP together (FA3's order); spills with 128-wide streams.
    dkv_roles: dk/dv kernel: both warpgroups on one key tile, one for dS and dv, one for dk.
    row_sum_mma: forward row sums as P @ 1 on the tensor cores; the softmax bounds the forward.
    bounded_softmax: bf16 forward skips the running max where PoPE's magnitudes bound a tile.
    rescale_threshold: log2 units a row's max may grow before rescaling (FA4); None: every step.
  """
  block_q: int = 64
  block_kv: int = 128
  block_q_dq: int = 64
  block_kv_dq: int = 128
  block_kv_dkv: int = 64
  block_q_dkv: int = 128
  stages: int = 2
  forward_warpgroups: int | None = None
  ping_pong: bool = True
  overlap_bwd: bool = False
  dkv_roles: bool = False
  row_sum_mma: bool = False
  bounded_softmax: bool = False
  rescale_threshold: float | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):  # field.type: the annotation's text (__future__)
      name, value = field.name, getattr(self, field.name)
      if field.type == "float | None" or (field.type == "int | None" and value is None):
        continue  # (rescale_threshold is checked below)
      want = bool if field.type == "bool" else int
      if not isinstance(value, want) or isinstance(value, bool) != (want is bool):
        raise TypeError(f"BlockSizes.{name} must be {'a bool' if want is bool else 'an int'}, "
                        f"got {value!r}")
      if name.startswith("block_") and (value <= 0 or value % 64):
        raise ValueError(f"BlockSizes.{name} must be a positive multiple of 64, got {value}")
    if self.stages < 2:
      raise ValueError(f"BlockSizes.stages must be at least 2, got {self.stages}")
    if self.forward_warpgroups not in (None, 2, 3):
      raise ValueError("BlockSizes.forward_warpgroups must be 2, 3 or None, got "
                       f"{self.forward_warpgroups}")
    threshold = self.rescale_threshold
    number = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
    if threshold is not None and not (number and 0.0 <= threshold <= MAX_RESCALE_THRESHOLD):
      raise ValueError("BlockSizes.rescale_threshold must be None or a number of log2 units in "
                       f"[0, {MAX_RESCALE_THRESHOLD}], got {threshold!r}")

  @property
  def seq_multiple(self) -> int:
    """Query and key lengths are zero-padded to a multiple of this."""
    return math.lcm(2 * self.block_q, self.block_kv, 2 * self.block_q_dq, self.block_kv_dq,
                    2 * self.block_kv_dkv, self.block_q_dkv)


def default_block_sizes(head_dim: int) -> BlockSizes:
  """The tuned values on the H200 for PoPE head dim H (the results page has the measurements).

  H <= 64: `BlockSizes()`. H = 128: two forward warpgroups without ping-pong, 64-row key steps,
  the backward in FA3's order with the dk/dv warpgroups in roles, row sums on the tensor cores
  and rescaling at 8. `bounded_softmax` stays off everywhere: it needs bounded tiles to pay off."""
  if head_dim <= 64:
    return BlockSizes()
  return BlockSizes(block_kv=64, block_kv_dq=64, block_q_dkv=64, forward_warpgroups=2,
                    ping_pong=False, overlap_bwd=True, dkv_roles=True, row_sum_mma=True,
                    rescale_threshold=8.0)
