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
  """Tile sizes of the forward, dq and dk/dv kernels.

  Each kernel runs two compute warpgroups per CTA (the forward two or three,
  `forward_warpgroups`), each owning one resident tile of `block_*`
  rows at a time (several in turn when `persistent`), and one memory warpgroup that streams the
  other operand through a pipeline of SMEM slots (`stages` in the backward kernels,
  `stages_fwd` in the forward).

  Attributes:
    block_q, block_kv: forward query rows per warpgroup / streamed key rows per step.
    block_q_dq, block_kv_dq: dq kernel (resident queries, streamed keys).
    block_kv_dkv, block_q_dkv: dk/dv kernel (resident keys, streamed queries).
    stages: SMEM pipeline depth of the streamed operand (>= 2) in the backward kernels, and
      the forward's least depth when `stages_fwd` is None.
    stages_fwd: the forward's pipeline depth. None (default): max(3, stages) where that fits
      in SMEM at the call's shapes, else `stages` (`pope_attention_fwd.forward_stages`); the
      forward has room for a deeper pipeline than the backward kernels, whose resident tiles
      are larger.
    ping_pong: forward only: the two compute warpgroups take turns on the tensor cores, one's
      softmax overlapping the other's matmuls (FlashAttention-3 §3.1); with three
      (`forward_warpgroups`), a ring of turns. None: on with two forward warpgroups, off with
      three (`pope_attention_fwd.resolve_forward`). On by default here; `default_block_sizes`
      sets None at head dim <= 64 and off at 128. As compiled (ptxas 13.5), the
      handshake after the softmax arrives at its start, so the schedule orders the QKᵀ issues
      and the softmaxes may overlap (docs/results, run 12).
    overlap: forward only: each compute warpgroup issues the QKᵀ of step s together with the
      PV of step s - 1 and runs the softmax of s while PV is on the tensor cores
      (FlashAttention-3 §3.2, intra-warpgroup overlap). A slot is then released one step
      later, so with `ping_pong` it needs a forward depth >= 3 (`stages_fwd`, or `stages` if
      that is None; with 2 the handshake and the slot reuse wait on each other: deadlock).
      Off by default: on the H200 its forward ties the default's at H = 64 (with ping-pong
      and 3 stages; forward+backward is slower there) and is slower at H = 128 (docs/results,
      runs 11 and 13).
    a_in_registers: forward only: keep each warpgroup's Cartesian query tile a in registers
      as the left operand of QKᵀ, so the tensor cores read only the streamed keys from SMEM
      (a 64-row wgmma with both operands in SMEM can ask for as many bytes per cycle as the
      SMEM delivers). Costs block_q·D / 256 32-bit registers per thread for the whole loop (32
      at H = 64, 64 at H = 128) and frees a's SMEM tile (when a is saved for the backward and
      V = H, a passes through the output tile's SMEM). On the H200 (docs/results, run 13):
      alone (two stages) 2.7 % faster at H = 128 and 4.3 % at H = 64 in one call; with the
      third forward stage it makes room for at H = 128, 4.6-5.8 % faster at H = 128 and
      within noise to 6 % at H = 64 over three calls.
    overlap_bwd: dq and dk/dv kernels: each step issues S and dP together, computes P while dP
      is on the tensor cores and issues P's updates (dv) before awaiting dP
      (`_streaming.gradient_step`, the order of FlashAttention-3's backward), instead of
      awaiting each wgmma in turn. Two float32 score tiles are then live at once, so it suits
      64-wide streamed tiles (block_kv_dq, block_q_dkv); with 128-wide ones at H = 64, ptxas
      spills 1,072 bytes in dk/dv and 48 in dq. `default_block_sizes` turns it on at head dim
      128, where it spills more (dq 236 -> 376 bytes, dk/dv 244 -> 380) and still runs
      0.5-1.1 % faster (docs/results, run 14).
    row_sum_mma: forward only: the softmax's row sums l (FlashAttention's denominator) come
      from the tensor cores, as P @ 1 against a 16-column tile of ones in SMEM, one more wgmma
      (N = 16) issued with PV, instead of a float32 sum of P per row (at block_kv = 128, 64
      adds and 4 shuffles per thread and step; the softmax's instructions bound the forward at
      H = 64, docs/results run 12). l then sums P as rounded to q's dtype, the P that PV
      multiplies. Not with `overlap`.
    bounded_softmax: forward only, bfloat16 only: a query tile whose scores are all within
      ±`pope_attention_fwd.BOUNDED_SCORE_LIMIT` (log2 units) by PoPE's magnitude bound
      |a_ts| <= scale |softplus(q_t)| |softplus(k_s)| (Cauchy-Schwarz on the Cartesian vectors;
      `pope_attention.bounded_tiles`, an XLA reduction over q and one over k per call) takes
      P = exp2(scores) directly: no running row max, no rescaling of the accumulator
      (FlashAttention's online max only keeps exp2 in range, which the bound already does).
      Other tiles keep the online softmax. Under `ping_pong`, bounded tiles run without the
      handshakes (the two warpgroups side by side), the others keep them. Off by default: on
      the H200 (docs/results, run 17) with every tile bounded (N(0, 1) inputs) the forward was
      3.6-7.9 % faster at H = 64 and 2.7-4.7 % at H = 128; with none bounded (queries ×8) 6.8 %
      slower at H = 64 and 3.0-5.7 % at H = 128, the cost of the bound's XLA reductions
      (about 0.025 ms of device time at H = 64, 0.045 at H = 128; run 18). A GPT-2-124M-shaped
      PoPE language model trained on Shakespeare had 43.8 % of its tiles bounded (2.9 % in its
      last layer; run 18 D): measure a model's share with `experiments.score_bounds` before
      turning this on. Not with `overlap`.
    rescale_threshold: forward only, online-softmax tiles: None (default) rescales the
      accumulator at every step (the classic online softmax); a number of log2 units is how
      far a row's running max may grow before the accumulator is rescaled (FlashAttention-4's
      conditional rescaling; tokamax's `rescale_threshold` is the same idea as a factor).
      Until then the row keeps its stale max, so P = exp2(s - m) is at most
      2**rescale_threshold, and the output and log-sum-exp, normalised by row sums taken
      against the same max, are exact. The rescale of the [block_q, V] accumulator then runs
      in a branch that each warp takes only where one of its rows' max moved (a lane vote,
      `_streaming.warp_any`), so most steps skip its multiplies; 0.0 moves the max whenever
      it grows. At most `MAX_RESCALE_THRESHOLD` (15), which keeps P within float16's range.
      On the H200 (docs/results, runs 26 and 27), against None (no vote, no branch) on one
      machine, 8 made the H = 128 forward 0.8-2.9 % faster (and 1.9 % faster than 0), so
      `default_block_sizes` sets 8 there; at H = 64, under ping-pong, the vote and branch made
      the forward 1.8-4.2 % slower, so there it stays None.
    query_tables: forward only: the query map reads the cos and sin of each row's angles
      pos·θ from a float16 table [2, T, H] (`pope_attention.query_table`, shared by the heads;
      a trace-time constant for concrete positions) and rotates them by the head's phase -δ,
      instead of computing cos and sin per element in the kernel: two transcendentals per
      element instead of four, and no range reduction, on the SFUs the softmax's exp2 needs.
      Costs two [block_q, H] float16 SMEM tiles per compute warpgroup, used only where they
      fit beside the forward's stages (`pope_attention_fwd.use_query_tables`; not at H = 64
      with V = 128); `default_block_sizes` turns it off at head dim 128, where they never do.
      On the H200 (docs/results, run 21) the H = 64 forward 3.6 % faster on average over four
      pairs (each pair's faster row), kernel device time 0.411 -> 0.398 ms.
    persistent: launch at most one CTA per SM, each looping over its share of the resident
      tiles, instead of one CTA per tile. The memory warpgroup streams the next tile's first
      keys (or queries) while the compute warpgroups finish a tile, and the forward loads the
      next query tile while it runs this one (the query tile then has its own SMEM buffer;
      with one CTA per tile it is staged in the output tile's when V = H). Which CTA runs which
      tiles is a static greedy schedule (`_streaming.item_schedule`). On the H200 (docs/results,
      run 15) 2-7 % faster forward and 1.1-3.4 % faster forward+backward at H = 64 and 128, in
      eight pairs. The CPU interpreter runs one tile per CTA (`_streaming.num_sms`).
    forward_warpgroups: forward only: compute warpgroups per CTA, 2, 3, or None: 3 where their
      buffers fit in SMEM at the forward's least depth (`stages_fwd`, else `stages`) with a
      saved for the backward (not with `overlap`), else 2 (`pope_attention_fwd.resolve_forward`,
      at the call's shapes; at H = 64, 3 with V = 64, 2 with V = 128). Each warpgroup has its
      own `block_q` query rows (FlashAttention-3 runs three of 64 rows at head dim 64): with three,
      two warpgroups' matmuls can run while a third computes its softmax, which bounds the
      forward at H = 64 (docs/results, run 12). With 3 the compute warpgroups get 160 registers
      per thread instead of 232 (at H = 64 ptxas spills none with the defaults, 40-52 bytes
      with `a_in_registers` False); at H = V = 64 the forward keeps three stages, beside which
      the query tables do not fit (`query_tables`; the query map then computes cos and sin
      itself, once per query tile); and `ping_pong` becomes a ring: each warpgroup issues its
      QKᵀ after the previous one's (`_streaming.RingSchedule`; its forward was 0.8-1.6 % slower
      than without it in five of six pairs, 0.3 % faster in one). A CTA's last group of query
      tiles may be partial: its warpgroups past the queries' length visit no keys and store
      nothing (no extra padding). Not with `overlap`. On the H200 (docs/results, run 29) three
      warpgroups made the H = 64 forward 6.6-8.5 % faster than two with ping-pong, in six
      rounds on two machines; `default_block_sizes` sets None (and `ping_pong` None: no ring)
      at head dim <= 64 and 2 at 128, where the a tile alone would take 64 of the 160
      registers.
    split_dkv: compute the key-side gradients dk and dv in two launches rather than one
      (`pope_attention_dkv`): the dv launch repeats a bᵀ and the pass over the queries, but at
      head dim 128, where one launch's float32 accumulators (db, D wide, and dv) spill, two
      measured faster (docs/results, run 9); `default_block_sizes` turns it on there.
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

  Measured on the H200 (docs/results/attention_kernel.md): at H <= 64 the best of four block
  shapes; with two forward warpgroups the ping-pong forward was 6 % faster there (runs 3-6),
  with three (below) no ring was; at H = 128 ping-pong made no difference beyond
  run-to-run noise (-4 % and +0.4 % in two runs), so the plain schedule stays.
  At both, the forward keeps a in registers and takes three stages where they fit (run 13;
  not at H = 128 when V != H and a is saved, nor at H = 64 with V > 64); the backward kernels
  keep two (at H = 128 three do not fit). At H = 128 the backward steps run in
  FlashAttention-3's order (`overlap_bwd`: 0.5-1.1 % faster fwd+bwd in three calls, run 14);
  at H = 64 that order with 64-wide streamed tiles was 1-3 % slower than these defaults.
  Every kernel is persistent (`BlockSizes.persistent`, run 15). At H = 128 the row sums come
  from the tensor cores (`row_sum_mma`: 2.6-3.4 % faster forward there in one A/B call, within
  noise at H = 64; run 16). `bounded_softmax` stays off: it pays only where the magnitudes
  bound every score (run 17: 3.6-7.9 % faster forward then, 6.8 % slower where no tile is
  bounded), and a trained 12-layer PoPE language model had 43.8 % of its tiles bounded (run 18).
  At H <= 64 the forward maps the queries from cos and sin tables where they fit
  (`query_tables`, run 21; with three forward warpgroups at H = V = 64 they do not fit beside
  three stages on the GPU), and runs three compute warpgroups where they fit
  (`forward_warpgroups` None, run 29: 6.6-8.5 % faster forward at H = 64 than two; H = 32 was
  checked on the GPU, not timed).
  At H = 128 the forward rescales its accumulator conditionally (`rescale_threshold` 8, runs 26
  and 27; at H = 64 that was slower).
  """
  if head_dim <= 64:
    return BlockSizes(block_q=64, block_kv=128, block_kv_dq=128, block_q_dkv=128, stages=2,
                      forward_warpgroups=None, ping_pong=None)
  return BlockSizes(block_q=64, block_kv=64, stages=2, ping_pong=False, overlap_bwd=True,
                    split_dkv=True, row_sum_mma=True, query_tables=False, rescale_threshold=8.0)
