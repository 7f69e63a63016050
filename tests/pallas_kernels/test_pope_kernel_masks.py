"""The fused PoPE kernel with key masks, packed-document segment ids and per-head frequencies,
against the XLA reference in the Mosaic GPU interpreter: the forward and the gradients of q, k,
v and δ.

The reference is the library's XLA path, or with segment ids `tests.pallas_kernels.masks.reference`
(the rule written out). Blocks of 64 keys put several tiles in 128 positions, so the
draws cross tile boundaries and skip whole tiles while every draw of a test shares one padded
shape (the kernels' compilations are reused; CI time).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _streaming
from pallas_kernels import pope_attention as kernel
from pallas_kernels.pope_attention_config import BlockSizes
from pope_jax import attention, encodings
from tests.pallas_kernels import entry
from tests.pallas_kernels.entry import kernel_attention
from tests.pallas_kernels.masks import reference

# As in test_pope_attention: a run that stops making progress in the interpreter is retried.
pytestmark = [pytest.mark.timeout(300, method="thread"), pytest.mark.flaky(reruns=2)]

# Several key tiles within one 128-row padded length.
SMALL_BLOCKS = BlockSizes(block_kv=64, block_kv_dq=64, block_q_dkv=64)
FAMILY = (2, 4, 2, 32)  # (B, N, K, H): GQA groups of two
ATOL = 1e-2
TOL = 2.5e-2  # bf16 inputs and probabilities; relative to the largest reference entry


_problem = entry.problem


def _value_and_grads(fn, q, k, v, delta, cot):
  def loss(q, k, v, delta):
    out = fn(q, k, v, delta)
    return (out.astype(jnp.float32) * cot).sum(), out
  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, delta)
  return (out, *grads)


def _check(problem, *, is_causal, key_mask=None, segment_ids=None, multiplier=None,
           blocks=SMALL_BLOCKS):
  """Kernel (interpreter, outside an outer jit so draws share compilations) vs `reference`."""
  masks = dict(key_mask=key_mask, multiplier=multiplier)
  if segment_ids is not None:
    masks |= dict(q_segment_ids=segment_ids[0], kv_segment_ids=segment_ids[1])
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads(lambda *x: kernel_attention(*x, is_causal=is_causal,
                                                       block_sizes=blocks, **masks), *problem)
  if segment_ids is None:  # the library's XLA path
    want_fn = lambda *x: attention.pope_attention(*x, implementation="xla", is_causal=is_causal,
                                                  key_mask=key_mask, multiplier=multiplier)
  else:
    want_fn = lambda *x: reference(*x, is_causal=is_causal, key_mask=key_mask,
                                   segment_ids=segment_ids, multiplier=multiplier)
  want = _value_and_grads(jax.jit(want_fn), *problem)
  for name, x, y in zip(("out", "dq", "dk", "dv", "ddelta"), got, want):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.all(np.isfinite(x)), name
    err = np.abs(x - y).max()
    assert err < TOL * np.abs(y).max() + ATOL, f"{name}: max error {err:.3g}"
  return got


@hst.composite
def key_masks(draw, b, s_len):
  """None or [B, S] bool: right padding, left padding or holes, per row (rows of no key too)."""
  kind = draw(hst.sampled_from(["none", "right", "left", "holes"]))
  if kind == "none":
    return None
  lengths = draw(hst.lists(hst.integers(0, s_len), min_size=b, max_size=b))
  idx = np.arange(s_len)[None]
  if kind == "right":
    return jnp.asarray(idx < np.array(lengths)[:, None])
  if kind == "left":
    return jnp.asarray(idx >= s_len - np.array(lengths)[:, None])
  bits = draw(hst.lists(hst.booleans(), min_size=b * s_len, max_size=b * s_len))
  return jnp.asarray(np.array(bits).reshape(b, s_len))


@hst.composite
def segment_ids(draw, b, t_len, s_len):
  """None or (q [B, T], kv [B, S]) int32: packed documents (runs of 1 to 40 tokens, single-token
  ones included, the queries the last T keys' ids) or independent ids in [0, 3]."""
  kind = draw(hst.sampled_from(["none", "packed", "random"]))
  if kind == "none":
    return None
  if kind == "random":
    ids = lambda n: np.array(draw(hst.lists(hst.integers(0, 3), min_size=b * n,
                                            max_size=b * n))).reshape(b, n)
    return jnp.asarray(ids(t_len), jnp.int32), jnp.asarray(ids(s_len), jnp.int32)
  rows = []
  for _ in range(b):
    runs = draw(hst.lists(hst.integers(1, 40), min_size=1, max_size=s_len))
    rows.append(np.repeat(np.arange(len(runs)), runs)[:s_len])
    rows[-1] = np.pad(rows[-1], (0, s_len - len(rows[-1])), mode="edge")
  k_seg = np.stack(rows)
  q_seg = np.pad(k_seg, ((0, 0), (max(t_len - s_len, 0), 0)), mode="edge")[:, -t_len:]
  return jnp.asarray(q_seg, jnp.int32), jnp.asarray(k_seg, jnp.int32)


@hst.composite
def _cases(draw, is_causal):
  b, n, kh, _ = FAMILY
  s_len = draw(hst.integers(1, 128))
  t_len = draw(hst.integers(1, s_len if is_causal else 128))
  mult = draw(hst.sampled_from([None, (0.5, 2.0), (1.0, 0.25)]))
  multiplier = None if mult is None else jnp.repeat(jnp.asarray(mult, jnp.float32), n // kh)
  return (t_len, s_len, is_causal, draw(key_masks(b, s_len)),
          draw(segment_ids(b, t_len, s_len)), multiplier, draw(hst.integers(0, 2**16)))


# Documents of 1, 1, 60 (across the 64-key tile boundary), 1 and 65 tokens, two rows.
_PACKED = np.repeat(np.arange(5), [1, 1, 60, 1, 65])[None].repeat(2, 0).astype(np.int32)


def _check_case(case):
  t_len, s_len, is_causal, key_mask, segments, multiplier, seed = case
  _check(_problem(FAMILY, t_len, s_len, seed), is_causal=is_causal, key_mask=key_mask,
         segment_ids=segments, multiplier=multiplier)


def test_masks_segments_and_multipliers_one_case():
  """Left padding, one row that sees no key, single-token and tile-crossing documents and
  per-head θ, in one call (the fast tier's sibling of the drawn test below)."""
  _check_case((100, 128, True, jnp.arange(128)[None] >= jnp.array([[40], [128]]),
               (jnp.asarray(_PACKED[:, 28:]), jnp.asarray(_PACKED)),
               jnp.asarray([0.5, 0.5, 2.0, 2.0]), 7))


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [True, False])
@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=hst.data())
def test_masks_segments_and_multipliers_match_reference(is_causal, data):
  _check_case(data.draw(_cases(is_causal)))


def _decode_case(t_len, s_len, seed=0):
  """A left-padded batch (row 1 starts at key 40) of two packed documents per row."""
  b = FAMILY[0]
  key_mask = jnp.arange(s_len)[None] >= jnp.array([[0], [min(40, s_len - 1)]])
  k_seg = (jnp.arange(s_len)[None] >= s_len // 3).astype(jnp.int32).repeat(b, 0)
  return (_problem(FAMILY, t_len, s_len, seed), key_mask,
          (k_seg[:, s_len - t_len:], k_seg))


# Fast-tier siblings: test_masks_segments_and_multipliers_one_case and the split-K kernel's tests
# (test_decode_attention.py).
@pytest.mark.slow
@pytest.mark.parametrize("t_len, s_len", [(1, 300), (7, 7), (1, 1), (7, 259)])
def test_decode_shapes(t_len, s_len):
  problem, key_mask, segments = _decode_case(t_len, s_len)
  _check(problem, is_causal=True, key_mask=key_mask, segment_ids=segments, blocks=None)


@pytest.mark.slow
@pytest.mark.timeout(400, method="thread")  # about 100 s alone on 2 cores
@pytest.mark.parametrize("t_len, s_len", [(1, 5000), (7, 4097)])
def test_decode_shapes_long(t_len, s_len):
  problem, key_mask, segments = _decode_case(t_len, s_len)
  _check(problem, is_causal=True, key_mask=key_mask, segment_ids=segments, blocks=None)


def test_rows_without_keys_give_zeros_and_zero_gradients():
  # Batch row 1 has no visible key; in row 0 queries of segment 1 see no key of theirs.
  problem = _problem(FAMILY, 100, 100, 3)
  key_mask = jnp.stack([jnp.ones(100, bool), jnp.zeros(100, bool)])
  q_seg = jnp.stack([jnp.where(jnp.arange(100) < 70, 0, 1), jnp.zeros(100, int)]).astype(jnp.int32)
  k_seg = jnp.zeros((2, 100), jnp.int32)
  out, dq, dk, dv, _ = _check(problem, is_causal=False, key_mask=key_mask,
                              segment_ids=(q_seg, k_seg))
  for x in (out[1], out[0, 70:], dq[1], dq[0, 70:], dk[1], dv[1]):
    assert np.all(np.asarray(x, np.float32) == 0.0)


def _visible(q_pos, k_pos, q_seg, k_seg):
  return (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_seg[:, None, :] == q_seg[:, :, None])


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(hst.integers(0, 2**16), hst.booleans(), hst.booleans(), hst.booleans())
def test_visit_table_covers_every_visible_pair(seed, causal, packed, key_mask):
  # Every visible (query, key) pair lies in a visited step; steps in the unmasked range
  # [flo, fhi) hold only visible pairs; with queries or keys resident.
  b, rows, cols, row_block, col_block = 2, 256, 384, 64, 128
  rng = np.random.default_rng(seed)
  draw_ids = lambda n, top: rng.integers(0, top + 1, (b, n))
  q_seg, k_seg = draw_ids(rows, 5), draw_ids(cols, 5)
  if packed:  # documents in order, the queries the last keys
    k_seg = np.sort(draw_ids(cols, 3), axis=1)
    q_seg = k_seg[:, -rows:]
  q_pos = (np.arange(rows)[None].repeat(b, 0) + 128 if causal
           else np.full((b, rows), _streaming.QUERY_SEES_ALL))
  hidden = draw_ids(cols, 3) == 0 if key_mask else np.zeros((b, cols), bool)
  k_pos = np.where(hidden, _streaming.KEY_PAD, np.arange(cols)[None])
  vis = _visible(q_pos, k_pos, q_seg, k_seg)                                        # [B, T, S]
  for queries in (True, False):
    pos, seg = ((q_pos, k_pos), (q_seg, k_seg)) if queries else ((k_pos, q_pos), (k_seg, q_seg))
    rb, cb = (row_block, col_block) if queries else (col_block // 2, row_block)
    table = np.asarray(_streaming.visit_table(
        *(jnp.asarray(x, jnp.float32) for x in pos), rb, cb, rows_are_queries=queries, wgs=1,
        row_seg=jnp.asarray(seg[0], jnp.float32), col_seg=jnp.asarray(seg[1], jnp.float32)))
    pairs = vis if queries else vis.transpose(0, 2, 1)
    for bi in range(b):
      for tile in range(table.shape[1]):
        lo, flo, fhi, hi = table[bi, tile, 2:6]
        block = pairs[bi, tile * rb:(tile + 1) * rb].reshape(rb, -1, cb)
        any_step = np.flatnonzero(block.any(axis=(0, 2)))
        assert all(lo <= s < hi for s in any_step), (queries, bi, tile)
        assert block[:, flo:fhi].all(), (queries, bi, tile)


def test_fully_masked_key_tiles_are_skipped():
  # Keys 0-255 masked (left padding): no query tile visits their two 128-key steps.
  plan = kernel._plan(BlockSizes(), 64, 64, jnp.bfloat16)
  key_mask = jnp.arange(512)[None] >= 256
  *_, visits = kernel._position_operands(np.arange(512), np.arange(512), key_mask, None,
                                         batch=1, t_len=512, s_len=512, is_causal=False,
                                         plan=plan)
  fwd = np.asarray(visits[0])
  assert np.all(fwd[..., 0] == 2) and np.all(fwd[..., 1] == 4)


@pytest.mark.parametrize("change, match", [
    (dict(key_mask=jnp.ones((2, 5), bool)), "key_mask"),
    (dict(key_mask=jnp.ones((2, 7), jnp.int32)), "key_mask"),
    (dict(q_segment_ids=jnp.zeros((2, 3), jnp.int32)), "together"),
    (dict(q_segment_ids=jnp.zeros((2, 3), jnp.float32),
          kv_segment_ids=jnp.zeros((2, 7), jnp.int32)), "q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 3), jnp.int32),
          kv_segment_ids=jnp.full((2, 7), 2**24, jnp.int32)), "kv_segment_ids"),
    (dict(frequencies=jnp.ones((3, 32))), "frequencies"),
])
def test_bad_masks_raise(change, match):
  q = jnp.zeros((2, 3, 4, 32), jnp.bfloat16)
  k = jnp.zeros((2, 7, 2, 32), jnp.bfloat16)
  kw = dict(frequencies=encodings.pope_frequencies(32), q_positions=np.arange(4, 7),
            k_positions=np.arange(7)) | change
  with plgpu.force_gpu_interpret_mode(), pytest.raises(ValueError, match=match):
    kernel.pope_attention(q, k, k, **kw)


@pytest.mark.slow
def test_traced_masks_match_concrete_ones():
  # Under jit (masks from the data, as in training) the visit tables are computed in the call.
  q, k, v, delta, _ = _problem(FAMILY, 50, 130, 5)
  key_mask = jnp.arange(130)[None] >= jnp.array([[0], [70]])
  seg = (jnp.arange(130)[None] // 45).astype(jnp.int32).repeat(2, 0)
  masks = dict(key_mask=key_mask, q_segment_ids=seg[:, 80:], kv_segment_ids=seg)
  call = lambda masks: kernel_attention(q, k, v, delta, is_causal=True, block_sizes=SMALL_BLOCKS,
                                        **masks)
  with plgpu.force_gpu_interpret_mode():
    traced = jax.jit(call)(masks)
    concrete = call(masks)
  np.testing.assert_array_equal(np.asarray(traced, np.float32), np.asarray(concrete, np.float32))
