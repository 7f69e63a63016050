"""Fused PoPE attention kernel vs the XLA reference, run in the Mosaic GPU interpreter on CPU.

Hypothesis draws lengths off the block grid, Tq < Tk offsets, causal or not, GQA groups and head
dims 32/64/128. Lengths stay <= 128 so every draw pads to one 128-row tile and the compiled
kernels are shared between draws of one (B, N, K, H) family (CI time).
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import pope_attention as kernel
from pallas_kernels import _streaming
from pallas_kernels.pope_attention_bwd import cartesian_vjp
from pallas_kernels.pope_attention_config import BlockSizes, default_block_sizes
from pallas_kernels.shapes import CHECK_TOLERANCES, SHAPES, random_inputs
from pallas_kernels.pope_attention_fwd import (TABLE_DTYPE, cartesian_halves,
                                               cartesian_halves_from_tables, plan_forward)
from pope_jax import attention, encodings, positions
from tests.pallas_kernels import entry
from tests.pallas_kernels.entry import kernel_attention

# The interpreter's known hangs on few cores are avoided in tests/conftest.py. As a backstop, a
# test that stops making progress is ended (pytest-timeout) and run again in a fresh worker
# (pytest-rerunfailures); a real failure still fails, after three tries. The timeout is about
# four times the slowest of these tests on 2 cores (33 s).
pytestmark = [pytest.mark.timeout(120, method="thread"), pytest.mark.flaky(reruns=2)]

# (B, N, K, H): kernel-shape families; lengths vary freely inside each. GQA with two kv heads
# (H = 32) and with one (H = 128), batch 2 (H = 64), two heads without GQA (H = 64); few heads, as
# the interpreter's time grows with the resident tiles (CI time).
FAMILIES = ((1, 4, 2, 32), (2, 1, 1, 64), (1, 2, 1, 128), (1, 2, 2, 64))
ATOL = 1e-2
TOL = 2.5e-2  # bf16 inputs and probabilities; relative to the largest reference entry


_problem = entry.problem


def _value_and_grads(impl, q, k, v, delta, cot, **kw):
  """Output and gradients (q, k, v, δ) of `pope_attention(implementation=impl)`. The pallas
  path runs outside an outer jit: the kernel's own jitted pieces then see the padded shapes,
  which every draw of a family shares, so hypothesis' draws reuse their compilations (CI time)."""
  def loss(q, k, v, delta):
    out = attention.pope_attention(q, k, v, delta, implementation=impl, **kw)
    return (out.astype(jnp.float32) * cot).sum(), out
  grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  (_, out), grads = (grad if impl == "pallas" else jax.jit(grad))(q, k, v, delta)
  return (out, *grads)


def _kernel_value_and_grads(blocks, q, k, v, delta, cot, **kw):
  """The kernel's output and gradients (q, k, v, δ) at `blocks`, in the interpreter."""
  def loss(q, k, v, delta):
    out = kernel_attention(q, k, v, delta, block_sizes=blocks, **kw)
    return (out.astype(jnp.float32) * cot).sum(), out

  with plgpu.force_gpu_interpret_mode():
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, delta)
  return (out, *grads)


def _assert_close(got, want):
  for name, x, y in zip(("out", "dq", "dk", "dv", "ddelta"), got, want):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.all(np.isfinite(x)), name
    # Relative to the largest reference entry, with an absolute floor: a gradient that is zero in
    # exact arithmetic (one visible key: softmax is constant) is bf16 rounding noise here.
    err = np.abs(x - y).max()
    assert err < TOL * np.abs(y).max() + ATOL, f"{name}: max error {err:.3g}"


@hst.composite
def _cases(draw, families=FAMILIES):
  family = draw(hst.sampled_from(families))
  is_causal = draw(hst.booleans())
  s_len = draw(hst.integers(1, 128))
  t_len = draw(hst.integers(1, s_len)) if is_causal else draw(hst.integers(1, 128))
  return family, t_len, s_len, is_causal, draw(hst.integers(0, 2**16))


def _check_case(case):
  family, t_len, s_len, is_causal, seed = case
  problem = _problem(family, t_len, s_len, seed)
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads("pallas", *problem, is_causal=is_causal)
  want = _value_and_grads("xla", *problem, is_causal=is_causal)
  _assert_close(got, want)


# 12 draws per family (48 in all; about 80 s per family alone on 2 cores): one test per family
# spreads them over the workers and keeps what a rerun repeats small.
@pytest.mark.slow
@pytest.mark.timeout(400, method="thread")
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: "B{}N{}K{}H{}".format(*f))
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=hst.data())
def test_matches_reference_forward_and_grads(family, data):
  _check_case(data.draw(_cases((family,))))


@settings(max_examples=2, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(_cases())
def test_matches_reference_forward_and_grads_few_draws(case):
  # The fast tier's sibling of the per-family tests above: the first draws of the same strategy.
  _check_case(case)


@pytest.mark.parametrize("head_dim, max_position", [(32, 4096), (128, 400_000), (64, 2**20)])
def test_cartesian_halves_match_reference_map(head_dim, max_position):
  # The forward kernel's query map, run as plain jnp on CPU (exact cos/sin here; the GPU's
  # approximations add ~1e-6, checked end to end by the tests/gpu/ tests). Both
  # it and the reference map take pos·θ as one float32 product; the kernel then reduces it by
  # 2π, exactly below 4e5 rad and within half an ulp of pos·θ above.
  ks = jax.random.split(jax.random.key(head_dim), 3)
  x = jax.random.uniform(ks[0], (64, head_dim), jnp.float32, -30.0, 30.0)
  pos = jnp.concatenate([jnp.arange(32.0), jax.random.randint(ks[1], (32,), 0, max_position)
                         .astype(jnp.float32)])
  freq = encodings.pope_frequencies(head_dim)
  phase = jax.random.uniform(ks[2], (head_dim,), jnp.float32, 0.0, 2 * math.pi)
  got = np.asarray(jnp.concatenate(cartesian_halves(x, pos, freq, phase, 0.5, jnp.float32),
                                   axis=1), np.float64)

  pos_theta = pos[:, None] * freq                                      # float32, as both maps
  mag = 0.5 * np.logaddexp(0.0, np.asarray(x, np.float64))
  reduction = (2.0**-24 * np.abs(np.asarray(pos_theta, np.float64)) if max_position > 400_000
               else 1e-5)                                              # rad
  tol = np.tile(mag * (reduction + 2.0**-21 + _streaming.SOFTPLUS_RTOL), 2) + 2.0**-23
  # PoPE Eq. 7-10 in float64 from the float32 pos·θ.
  ang = np.asarray(pos_theta, np.float64) + np.asarray(phase, np.float64)
  want = np.concatenate([mag * np.cos(ang), mag * np.sin(ang)], axis=1)
  assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)
  # The library's reference map (the XLA path; the backward applies `cartesian_vjp` to a).
  ref = 0.5 * encodings.polar_to_cartesian(x[None, :, None], pos_theta[None, :, None], phase)
  ref = np.asarray(ref, np.float64).reshape(got.shape)
  assert np.all(np.abs(got - ref) <= 2 * tol), np.max(np.abs(got - ref) / tol)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_cartesian_halves_from_tables_match_reference_map(head_dim):
  # The forward's query map from float16 cos and sin tables of pos·θ (`ForwardPlan.tables`)
  # against PoPE Eq. 7-10 in float64 from the same float32 pos·θ: each table entry is within
  # 2**-12 of its value, so cos φ and sin φ by angle addition are within 2**-12·√2.
  ks = jax.random.split(jax.random.key(head_dim), 3)
  x = jax.random.uniform(ks[0], (64, head_dim), jnp.float32, -30.0, 30.0)
  pos = jnp.concatenate([jnp.arange(32.0), jax.random.randint(ks[1], (32,), 0, 1 << 20)
                         .astype(jnp.float32)])
  freq = encodings.pope_frequencies(head_dim)
  phase = jax.random.uniform(ks[2], (head_dim,), jnp.float32, -2 * math.pi, 0.0)
  pos_theta = pos[:, None] * freq                                      # float32
  tables = (jnp.cos(pos_theta).astype(TABLE_DTYPE), jnp.sin(pos_theta).astype(TABLE_DTYPE))
  got = cartesian_halves_from_tables(x, *tables, jnp.cos(phase), jnp.sin(phase), 0.5,
                                     jnp.float32)
  got = np.asarray(jnp.concatenate(got, axis=1), np.float64)
  mag = 0.5 * np.logaddexp(0.0, np.asarray(x, np.float64))
  ang = np.asarray(pos_theta, np.float64) + np.asarray(phase, np.float64)
  want = np.concatenate([mag * np.cos(ang), mag * np.sin(ang)], axis=1)
  tol = np.tile(mag * (2.0**-12 * math.sqrt(2) + 2.0**-20), 2) + 2.0**-23
  assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)
  assert np.abs(got - want).max() > 2.0**-16  # the tables' rounding shows: float16, not 32


def test_softplus_matches_float64_relatively():
  # The kernels' softplus (log1p as a polynomial) against float64, relative error, from tiny
  # magnitudes (x = -80: μ ~ 2e-35) through the polynomial's whole interval to large x.
  x = np.concatenate([np.linspace(-80.0, 40.0, 200_001), [0.0, -1e-7, 1e-7]]).astype(np.float32)
  mu = np.asarray(_streaming.softplus(jnp.asarray(x)), np.float64)
  exact = np.logaddexp(0.0, x.astype(np.float64))
  assert np.abs(mu / exact - 1).max() < _streaming.SOFTPLUS_RTOL


def test_explicit_positions_and_empty_rows():
  # Batch-dependent positions; query 0 of batch 1 sits before every key: zero row, finite grads.
  q, k, v, delta, cot = _problem((2, 2, 1, 32), 40, 70, seed=3)
  k_pos = jnp.stack([jnp.arange(70), jnp.arange(70) + 5]).astype(jnp.int32)
  q_pos = jnp.stack([jnp.arange(40) + 30, jnp.arange(40) * 2 + 4]).astype(jnp.int32)
  kw = dict(is_causal=True, q_positions=q_pos, k_positions=k_pos)
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads("pallas", q, k, v, delta, cot, **kw)
  want = _value_and_grads("xla", q, k, v, delta, cot, **kw)
  assert np.all(np.asarray(got[0][1, 0]) == 0)
  _assert_close(got, want)


@pytest.mark.slow  # a kernel run per position value; explicit positions run in the fast tier
def test_traced_positions_match_reference_for_each_value():
  # Positions as jit arguments take the traced path of `_position_operands` (visit tables in
  # the call); one compilation must serve both position values.
  q, k, v, delta, cot = _problem((1, 2, 1, 32), 60, 150, seed=21)

  def loss(q, k, v, delta, q_pos, k_pos):
    out = kernel_attention(q, k, v, delta, is_causal=True, q_positions=q_pos,
                                k_positions=k_pos)
    return (out.astype(jnp.float32) * cot).sum(), out

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  for q_pos, k_pos in ((jnp.arange(90, 150), jnp.arange(150)),
                       (jnp.arange(60) * 2 + 20, jnp.arange(150) + 10)):
    with plgpu.force_gpu_interpret_mode():
      (_, out), grads = step(q, k, v, delta, q_pos, k_pos)
    kw = dict(is_causal=True, q_positions=q_pos, k_positions=k_pos)
    _assert_close((out, *grads), _value_and_grads("xla", q, k, v, delta, cot, **kw))


@pytest.mark.parametrize("positions", [
    {}, {"q_positions": np.arange(20, 40), "k_positions": np.arange(40)},
    {"q_positions": list(range(20, 40)), "k_positions": list(range(40))},
    {"q_positions": jnp.arange(20, 40)[None], "k_positions": jnp.arange(40)[None]}])
def test_concrete_positions_are_trace_time_constants(positions):
  # Defaults, numpy, int lists and closed-over jax arrays reach the kernels as constants:
  # under jit the call holds no reduction (the visit tables' min / max over the positions).
  q, k, v, delta, _ = _problem((1, 2, 1, 32), 20, 40, seed=2)
  fn = lambda q: attention.pope_attention(q, k, v, delta, is_causal=True,
                                          implementation="pallas", **positions)
  traced = lambda q, p: kernel_attention(q, k, v, delta, is_causal=True, q_positions=p)
  # Nor the trigonometry of the query and key tables (`query_table` [1, T_pad = 128, H],
  # `key_table` [1, S, 1, H]): only the phase's, [N, H].
  table_cos = re.compile(r"stablehlo.cosine %[\w#]+ : tensor<1x(128x32|40x1x32)xf32>")
  with plgpu.force_gpu_interpret_mode():
    text = jax.jit(fn).lower(q).as_text()
    assert "stablehlo.reduce" not in text and not table_cos.search(text)
    assert re.search(r"stablehlo.cosine %[\w#]+ : tensor<2x32xf32>", text)
    text = jax.jit(traced).lower(q, jnp.arange(20, 40)).as_text()
    assert "stablehlo.reduce" in text and table_cos.search(text)


def test_large_angle_tables_are_computed_in_the_call(monkeypatch):
  # Above MAX_CONSTANT_TABLE_BYTES the angle tables of concrete positions are computed in the
  # call (the visit tables stay constants), with the same result.
  q, k, v, delta, _ = _problem((1, 2, 1, 32), 20, 40, seed=2)
  def fn(q):  # A new function per trace: jit caches traces by function.
    return attention.pope_attention(q, k, v, delta, is_causal=True, implementation="pallas")
  with plgpu.force_gpu_interpret_mode():
    want = jax.jit(fn)(q)
    monkeypatch.setattr(kernel, "MAX_CONSTANT_TABLE_BYTES", 0)
    large = lambda q: fn(q)
    text = jax.jit(large).lower(q).as_text()
    assert "stablehlo.reduce" not in text
    assert re.search(r"stablehlo.cosine %[\w#]+ : tensor<1x40x1x32xf32>", text)
    np.testing.assert_array_equal(np.asarray(jax.jit(large)(q), np.float32),
                                  np.asarray(want, np.float32))


def test_layers_share_one_constant_table():
  # Calls with equal concrete positions share their angle tables: one key-table constant in
  # a program of three calls.
  q, k, v, delta, _ = _problem((1, 2, 1, 32), 20, 40, seed=2)
  def three_layers(q):
    for _ in range(3):
      q = attention.pope_attention(q, k, v, delta, is_causal=True, implementation="pallas")
    return q
  with plgpu.force_gpu_interpret_mode():
    text = jax.jit(three_layers).lower(q).as_text()
  assert len(re.findall(r"= stablehlo.constant dense<.*> : tensor<1x40x1x64xf32>", text)) == 1


def test_concrete_positions_beyond_float32_range_raise():
  q, k, v, delta, _ = _problem((1, 2, 1, 32), 20, 40, seed=2)
  with plgpu.force_gpu_interpret_mode(), pytest.raises(ValueError, match="k_positions"):
    kernel_attention(q, k, v, delta, is_causal=True, q_positions=np.arange(20),
                          k_positions=2**24 + np.arange(40))


def test_x64_mode_raises_a_clear_error():
  q, k, v, delta, _ = _problem((1, 2, 1, 32), 20, 40, seed=2)
  with jax.enable_x64(True):
    assert not kernel.is_supported(q, k, v)
    with plgpu.force_gpu_interpret_mode(), pytest.raises(NotImplementedError, match="x64"):
      kernel_attention(q, k, v, delta)


def test_kernel_positions_validate():
  # Checked once, by the op (`pope_jax.positions`), before the kernel.
  q, k, v, delta, _ = _problem((1, 2, 1, 32), 20, 40, seed=2)
  run = functools.partial(attention.pope_attention, implementation="pallas")
  with plgpu.force_gpu_interpret_mode():
    with pytest.raises(TypeError, match="q_positions must be integer"):
      run(q, k, v, delta, q_positions=np.arange(20) * 0.5)
    with pytest.raises(ValueError, match="k_positions must have shape"):
      run(q, k, v, delta, k_positions=jnp.arange(21))


@pytest.mark.parametrize("family, value_dim, is_causal",
                         [((1, 2, 2, 128), 64, True), ((1, 4, 1, 32), 96, False)])
@pytest.mark.slow  # V ≠ H also runs compiled on the GPU (tests/gpu) and lowers in CI
def test_value_width_other_than_head_dim(family, value_dim, is_causal):
  # The forward stages the query tile in its own SMEM buffer (not the output tile's).
  q, k, v, delta, _ = _problem(family, 33, 128, seed=11)
  v = jnp.tile(v, (1, 1, 1, 4))[..., :value_dim]
  cot = jax.random.normal(jax.random.key(12), q.shape[:3] + (value_dim,), jnp.float32)
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads("pallas", q, k, v, delta, cot, is_causal=is_causal)
  want = _value_and_grads("xla", q, k, v, delta, cot, is_causal=is_causal)
  assert got[0].shape == q.shape[:3] + (value_dim,)
  _assert_close(got, want)


@pytest.mark.slow
def test_float16_inputs():
  q, k, v, delta, cot = _problem((1, 2, 1, 64), 70, 90, seed=5)
  q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads("pallas", q, k, v, delta, cot, is_causal=True)
  want = _value_and_grads("xla", q, k, v, delta, cot, is_causal=True)
  assert got[0].dtype == jnp.float16
  _assert_close(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.slow
def test_phase_bias_outside_its_range_is_clamped(dtype):
  # δ below -2π, above 0 and at both bounds: the kernel path gives the reference's output and
  # gradient (the clamp's: zero outside, one at the bounds; `encodings.clamp_phase_bias`).
  q, k, v, _, cot = _problem((1, 2, 1, 64), 70, 90, seed=7)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  delta = jnp.linspace(-3 * math.pi, math.pi, 2 * 64, dtype=jnp.float32).reshape(2, 64)
  delta = delta.at[0, :2].set(-2 * math.pi).at[1, :2].set(0.0)
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads("pallas", q, k, v, delta, cot, is_causal=True)
  want = _value_and_grads("xla", q, k, v, delta, cot, is_causal=True)
  _assert_close(got, want)
  outside = np.asarray((delta < -2 * math.pi) | (delta > 0))
  assert outside.sum() > 50 and np.all(np.asarray(got[4])[outside] == 0)
  assert np.all(np.asarray(got[4])[~outside] != 0)


@pytest.mark.slow
def test_small_magnitudes():
  # Raw q and k near -10: softplus ~ 5e-5, below the epilogues' series threshold (μ < 1/64)
  # for every element, so dq and dk come from g(μ)'s Taylor branch.
  q, k, v, delta, cot = _problem((1, 2, 1, 64), 70, 90, seed=11)
  q, k = q - 10, k - 10
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads("pallas", q, k, v, delta, cot, is_causal=True)
  want = _value_and_grads("xla", q, k, v, delta, cot, is_causal=True)
  _assert_close(got, want)
  for name, x, y in (("dq", got[1], want[1]), ("dk", got[2], want[2])):  # ~1e-5: no floor
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.abs(x - y).max() < TOL * np.abs(y).max(), name


@pytest.mark.slow
def test_float16_phase_gradient_small_magnitudes():
  # fp16 raw q, k in [-9, -6]: each angle's gradient dφ ∝ da·a is far below fp16's normal range,
  # so the query map's VJP runs in XLA in float32 for fp16 (`_query_vjp_in_kernel`); stored per
  # element in fp16 (the bf16 path's epilogue), δ's gradient was 13 % off here. Against the
  # float32 reference (dq and dk themselves are fp16, underflowing at this scale: not checked).
  q, k, v, delta, cot = _problem((1, 2, 1, 64), 128, 128, seed=3)
  ks = jax.random.split(jax.random.key(3), 2)
  q, k = (jax.random.uniform(key, x.shape, jnp.float32, -9.0, -6.0) for key, x in zip(ks, (q, k)))
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads("pallas", q.astype(jnp.float16), k.astype(jnp.float16),
                           v.astype(jnp.float16), delta, cot, is_causal=True)
  want = _value_and_grads("xla", q.astype(jnp.float16).astype(jnp.float32),
                          k.astype(jnp.float16).astype(jnp.float32), v.astype(jnp.float32),
                          delta, cot, is_causal=True)
  err = np.abs(np.asarray(got[4]) - np.asarray(want[4])).max()
  assert err < 5e-3 * np.abs(np.asarray(want[4])).max(), err


def test_visit_table_skips_only_invisible_blocks():
  q_pos = jnp.arange(256, dtype=jnp.float32)[None] + 128  # bottom-right aligned, T=256, S=384
  k_pos = jnp.arange(384, dtype=jnp.float32)[None]
  table = np.asarray(_streaming.visit_table(q_pos, k_pos, 64, 128, rows_are_queries=True))
  # CTA 0 holds queries 128..255: wg0 (128..191) sees key blocks 0..1, fully only block 0.
  np.testing.assert_array_equal(table[0, 0], [0, 2, 0, 0, 1, 2, 0, 0, 1, 2])
  np.testing.assert_array_equal(table[0, 1], [0, 3, 0, 0, 2, 3, 0, 0, 2, 3])


def test_unsupported_inputs_raise():
  q = jnp.zeros((1, 8, 2, 48), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head dim"):
    kernel_attention(q, q, q)
  q32 = jnp.zeros((1, 8, 2, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match="dtype"):
    kernel_attention(q32, q32, q32)
  assert not kernel.is_supported(q32, q32, q32)
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  q16 = spec((1, 8, 2, 64))
  assert kernel.is_supported(q16, q16, q16)
  assert not kernel.is_supported(q16, q16, spec((1, 8, 2, 64), jnp.float32))  # mixed dtypes
  assert not kernel.is_supported(q16, q16, spec((1, 8, 2, 192)))              # value dim
  kv2 = spec((2, 8, 2, 64))
  assert not kernel.is_supported(q16, kv2, kv2)                                # batch
  assert not kernel.is_supported(q16, spec((1, 8, 2, 32)), q16)                # key head dim
  q2 = jnp.zeros((2, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="one batch"):
    kernel_attention(q2, q2[:1], q2[:1])
  q64 = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="Hopper"):                   # CPU, no interpreter
    kernel_attention(q64, q64, q64)



@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_cartesian_vjp_matches_reference_map_vjp(head_dim):
  # The dq kernel's epilogue (the query map's VJP from the map's own output, on CPU as plain
  # jnp) against autodiff of the reference map (its hand-written VJP, float32), with raw
  # values from softplus ~ 1e-13 (the series branch) to 30 and positions to 2**20. The kernel
  # sees a in bf16 (about 2^-9 relative more: the last check); the kernel's gradients are
  # checked end to end by the other tests here.
  ks = jax.random.split(jax.random.key(head_dim), 4)
  b, t, n, s = 2, 48, 3, 0.3
  q = jax.random.uniform(ks[0], (b, t, n, head_dim), jnp.float32, -30.0, 30.0)
  q = q.at[0, 0, 0, :4].set(jnp.array([-30.0, -4.5, 0.0, 1e-3]))
  pos = jax.random.randint(ks[1], (b, t), 0, 2**20)
  phase = jax.random.uniform(ks[2], (n, head_dim), jnp.float32, -2 * math.pi, 0.0)
  a, vjp = jax.vjp(lambda q, ph: encodings.pope_cartesian(q, pos, phase=ph) * s, q, phase)
  da = jax.random.normal(ks[3], a.shape, jnp.float32)
  want_dq, want_dphase = vjp(da)
  dq, d_angle = cartesian_vjp(a.reshape(-1, 2 * head_dim), da.reshape(-1, 2 * head_dim), s)
  dq, d_angle = dq.reshape(q.shape), d_angle.reshape(q.shape)
  np.testing.assert_allclose(dq, want_dq, rtol=1e-4, atol=1e-5 * np.abs(want_dq).max())
  np.testing.assert_allclose(d_angle.sum((0, 1)), want_dphase, rtol=1e-4,
                             atol=1e-5 * np.abs(want_dphase).max())
  dq16, d_angle16 = cartesian_vjp(a.astype(jnp.bfloat16).reshape(-1, 2 * head_dim),
                                  da.reshape(-1, 2 * head_dim), s)
  np.testing.assert_allclose(dq16.reshape(q.shape), want_dq, atol=1e-2 * np.abs(want_dq).max())
  np.testing.assert_allclose(d_angle16.reshape(q.shape).sum((0, 1)), want_dphase,
                             atol=1e-2 * np.abs(want_dphase).max())


def test_cartesian_vjp_magnitude_factor():
  # g(μ) = (1 - e^-μ) / μ across the series branch (μ < 1/64) and the exp branch, against
  # float64: dx / x'_c for x' = [s·μ, 0] and dx' = [1, 0].
  s = 0.3
  mu = np.geomspace(1e-8, 20.0, 200).astype(np.float32)
  cart = jnp.stack([jnp.asarray(mu) * s, jnp.zeros_like(mu)], axis=1)
  d_cart = jnp.stack([jnp.ones_like(mu), jnp.zeros_like(mu)], axis=1)
  dx, d_angle = cartesian_vjp(cart, d_cart, s)
  mu64 = np.asarray(cart[:, 0], np.float64) / s
  np.testing.assert_allclose(np.asarray(dx[:, 0], np.float64) / np.asarray(cart[:, 0]),
                             -np.expm1(-mu64) / mu64, rtol=2e-5)
  np.testing.assert_array_equal(d_angle, 0.0)

@pytest.mark.parametrize("head_dim, change", [
    (64, {"dkv_roles": True}), (128, {"dkv_roles": False}),
    (32, {"dkv_roles": True, "overlap_bwd": True, "block_q_dkv": 64}),
    (32, {"dkv_roles": True, "stages": 3})])
@pytest.mark.slow  # the default schedules run in the hypothesis tests
def test_dk_dv_schedules(head_dim, change):
  # The dk/dv schedules other than each head dim's default (which the hypothesis test runs):
  # the warpgroups on a key tile each, or in roles on one (dS handed over per ring slot).
  q, k, v, delta, cot = _problem((1, 2, 1, head_dim), 90, 120, seed=7)
  blocks = dataclasses.replace(default_block_sizes(head_dim), **change)

  got = _kernel_value_and_grads(blocks, q, k, v, delta, cot, is_causal=True)
  _assert_close(got, _value_and_grads("xla", q, k, v, delta, cot, is_causal=True))


@pytest.mark.parametrize("head_dim, is_causal", [(64, True), (32, False)])
@pytest.mark.slow  # several tiles per CTA: the interpreter's longest runs
def test_persistent_launch_over_tiles(head_dim, is_causal):
  # Three query and key tiles per head, two heads: 6 items per kernel. The interpreter runs
  # one item per CTA (`_streaming.num_sms`), so this checks
  # the item numbering and the schedule tables; several items per CTA, the query prefetch and
  # the ring of slots across items run only on the GPU (the tests/gpu/ tests).
  # (At H = 128, non-causal, this shape sometimes never finished in the interpreter on 2 cores,
  # with one tile per CTA too.)
  q, k, v, delta, cot = _problem((1, 2, 1, head_dim), 300, 330, seed=5)
  blocks = default_block_sizes(head_dim)
  plan = kernel._plan(blocks, head_dim, head_dim, q.dtype)  # as pope_attention does
  q_pos = jnp.arange(300) + 30
  kw = dict(is_causal=is_causal, q_positions=q_pos)
  freqs = encodings.pope_frequencies(head_dim)
  positions = kernel._positions(q_pos, jnp.arange(330), freqs, freqs, None, None, batch=1,
                                t_len=300, s_len=330, is_causal=is_causal, plan=plan)
  *_, tables, _ = kernel._prepare(q, k, v, delta, positions, is_causal=is_causal, plan=plan)
  for _, schedule in tables:
    assert np.asarray(schedule)[:, 0].max() == 1

  got = _kernel_value_and_grads(blocks, q, k, v, delta, cot, **kw)
  _assert_close(got, _value_and_grads("xla", q, k, v, delta, cot, **kw))


def test_item_schedule_balances_causal_tiles(monkeypatch):
  # Every item to exactly one CTA, in launch order; at the bench shape (4 x 16 heads x 32 query
  # tiles, causal) the busiest of the H200's 132 CTAs has at most 2 % more steps than the mean.
  monkeypatch.setattr(_streaming, "num_sms", lambda: 132)
  steps = _streaming.causal_steps(32, 128, 4096, 128, 0, causal=True, rows_are_queries=True)
  np.testing.assert_array_equal(steps, np.arange(1, 33))
  keys = _streaming.causal_steps(32, 128, 4096, 128, 0, causal=True, rows_are_queries=False)
  np.testing.assert_array_equal(keys, np.arange(32, 0, -1))
  table = _streaming.launch_schedule(4, 16, 32, steps, longest_last_tile=True)
  counts, items = table[:, 0], table[:, 1:]
  assert table.shape[0] == 132
  got = np.concatenate([row[:n] for row, n in zip(items, counts)])
  assert sorted(got) == list(range(2048))
  assert all(np.all(np.diff(row[:n]) > 0) for row, n in zip(items, counts))
  rank = (items // 16) % 32
  load = np.where(items >= 0, steps[31 - rank] + 1, 0).sum(1)
  assert load.max() <= 1.02 * load.mean(), (load.max(), load.mean())
  monkeypatch.setattr(_streaming, "num_sms", lambda: 4096)  # fewer items than SMs: one each
  np.testing.assert_array_equal(_streaming.launch_schedule(
      4, 16, 32, steps, longest_last_tile=True)[:, 1], np.arange(2048))


@pytest.mark.parametrize("blocks, is_causal", [
    (BlockSizes(block_kv=64, forward_warpgroups=2), True),
    (BlockSizes(block_kv=64, forward_warpgroups=2, stages=3), True),
    (BlockSizes(block_kv=64, forward_warpgroups=2), False),
    (BlockSizes(block_q=128, block_kv=64, forward_warpgroups=2), True),
    (BlockSizes(block_kv=64, forward_warpgroups=2, row_sum_mma=True), True),
    (BlockSizes(block_kv=128, forward_warpgroups=2, row_sum_mma=True), False),
    (BlockSizes(block_kv=64, forward_warpgroups=3), True),
    (BlockSizes(block_kv=64, forward_warpgroups=3), False),
])
@pytest.mark.slow  # the default schedules run in the hypothesis tests
def test_forward_schedules(blocks, is_causal):
  # Several key steps per query tile (block_kv 64): skipped, masked and full ranges, 128-row
  # query tiles; warpgroups with no visible key (T < S, offsets). The interpreter runs without
  # ping-pong, so the second case checks its stage count only; the GPU check covers ping-pong.
  q, k, v, delta, _ = _problem((1, 2, 1, 32), 150, 330, seed=13)
  q_pos = jnp.arange(150, dtype=jnp.int32) * 2
  kw = dict(is_causal=is_causal, q_positions=q_pos, k_positions=jnp.arange(330))
  with plgpu.force_gpu_interpret_mode():
    got = jax.jit(functools.partial(kernel_attention, block_sizes=blocks, **kw))(
        q, k, v, delta)
  want = attention.pope_attention(q, k, v, delta, implementation="xla", **kw)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.abs(got - want).max() < TOL * np.abs(want).max() + ATOL


def _stale_max_steps(q, k, delta, block_q, block_kv, threshold):
  """How the forward's conditional rescale (`BlockSizes.rescale_threshold`) plays out on
  these inputs, simulated from the float32 reference map with causal masking: each row's max
  moves only where a key block's max exceeds it by more than `threshold` (log2 units).

  Returns (stale, skipped, rescaled): the rows' steps whose block max grew but kept the stale
  max; and the steps after a tile's first where no row of the `block_q`-row tile moved its max
  (the interpreter, whose vote ORs over the tile, skips the rescale) or some row did."""
  h = q.shape[-1]
  t_pos, s_pos = positions.default_positions(q.shape[1], k.shape[1])
  a = encodings.pope_cartesian(q.astype(jnp.float32), t_pos,
                               phase=-encodings.clamp_phase_bias(delta))
  b = encodings.pope_cartesian(k.astype(jnp.float32), s_pos)
  s = np.asarray(jnp.einsum("btnd,bsd->bnts", a, b[:, :, 0]) / (math.sqrt(h) * math.log(2)))
  s = np.where(s_pos[None, None, None, :] <= t_pos[None, None, :, None], s, -np.inf)
  s = np.pad(s, ((0, 0), (0, 0), (0, -s.shape[2] % block_q), (0, 0)), constant_values=-np.inf)
  bsz, n, t, s_len = s.shape
  block_max = s.reshape(bsz, n, t // block_q, block_q, s_len // block_kv, block_kv).max(-1)
  m = np.full(block_max.shape[:-1], -np.inf)
  moved, stale = np.zeros(block_max.shape, bool), 0
  for j in range(block_max.shape[-1]):
    moved[..., j] = block_max[..., j] > m + threshold
    stale += int(((block_max[..., j] > m) & ~moved[..., j]).sum())
    m = np.where(moved[..., j], block_max[..., j], m)
  visible = np.isfinite(block_max).any(3)                            # [B, N, tiles, steps]
  later = visible & (np.cumsum(visible, -1) > 1)
  tile_moved = moved.any(3)
  return stale, int((later & ~tile_moved).sum()), int((later & tile_moved).sum())


@pytest.mark.parametrize("threshold, q_scale, changes", [
    (0.0, 4.0, {}),
    (8.0, 1.0, {}),
    (15.0, 1.0, {"row_sum_mma": True}),
    (8.0, 1.0, {"forward_warpgroups": 3}),
])
@pytest.mark.slow  # the default threshold runs in the hypothesis tests
def test_rescale_threshold_forward_and_grads(threshold, q_scale, changes):
  # Keys whose magnitudes grow along the sequence: the rows' running max grows at later key
  # blocks by less and by more than the threshold, so some steps keep the stale max (P up to
  # 2**threshold), some skip the rescale in every row of a tile (the branch the vote skips) and
  # others rescale. The output must match the reference, and the gradients (the backward reads
  # the forward's output and log-sum-exp) those of the classic online softmax (threshold None):
  # at these scores bf16's rounding of the Cartesian a and b moves the gradients of both away
  # from the float32 reference by more than the usual tolerance.
  q, k, v, delta, cot = _problem((1, 2, 1, 32), 200, 320, seed=5)
  k = (k.astype(jnp.float32) * jnp.linspace(0.5, 12.0, 320)[None, :, None, None]
       ).astype(jnp.bfloat16)
  q = q * q_scale
  blocks = BlockSizes(block_kv=64, rescale_threshold=threshold,
                      **{"forward_warpgroups": 2, **changes})
  stale, skipped, rescaled = _stale_max_steps(q, k, delta, blocks.block_q, blocks.block_kv,
                                              threshold)
  if threshold > 0:
    assert stale > 50 and skipped > 0, (stale, skipped)
  assert rescaled > 5, rescaled
  got = _kernel_value_and_grads(blocks, q, k, v, delta, cot, is_causal=True)
  classic = _kernel_value_and_grads(dataclasses.replace(blocks, rescale_threshold=None),
                                    q, k, v, delta, cot, is_causal=True)
  want = attention.pope_attention(q, k, v, delta, implementation="xla", is_causal=True)
  _assert_close(got[:1], (want,))
  _assert_close(got, classic)


def test_block_sizes_validate():
  with pytest.raises(ValueError, match="block_kv"):
    BlockSizes(block_kv=96)
  with pytest.raises(ValueError, match="stages"):
    BlockSizes(stages=1)
  assert default_block_sizes(64).seq_multiple == 128
  assert default_block_sizes(128).seq_multiple == 128
  for bad in (1, 4):
    with pytest.raises(ValueError, match="forward_warpgroups"):
      BlockSizes(forward_warpgroups=bad)
  for bad in (-1.0, 15.5, float("nan"), True):
    with pytest.raises(ValueError, match="rescale_threshold"):
      BlockSizes(rescale_threshold=bad)


def test_forward_plan_fits_in_smem(monkeypatch):
  # Three forward stages where their buffers fit (Hopper's 227 KiB): not at H = 128 when V != H
  # and a is saved (a needs its own SMEM tile then), nor at H = 64 with V = 128, nor with three
  # forward warpgroups at H = 32, V = 128.
  monkeypatch.setattr(_streaming, "smem_limit", lambda: 227 * 1024)
  bf16, h64, h128 = jnp.bfloat16, default_block_sizes(64), default_block_sizes(128)
  h32_two = dataclasses.replace(default_block_sizes(32), forward_warpgroups=2)
  stages = lambda blocks, h, vd, save_a: plan_forward(blocks, h, vd, bf16, save_a).stages
  assert stages(h64, 64, 64, True) == 3
  assert stages(h64, 64, 128, False) == 2
  assert stages(h32_two, 32, 128, True) == 3
  assert stages(default_block_sizes(32), 32, 128, True) == 2
  assert stages(h128, 128, 128, True) == 3
  assert stages(h128, 128, 64, True) == 2
  assert stages(h128, 128, 64, False) == 3
  assert stages(dataclasses.replace(h128, stages=4), 128, 128, False) == 4
  # The query tables where they fit beside those stages (never in place of one).
  tables = lambda blocks, h, vd, save_a: plan_forward(blocks, h, vd, bf16, save_a).tables
  assert tables(default_block_sizes(32), 32, 64, True)
  assert tables(default_block_sizes(32), 32, 128, True)
  assert tables(h64, 64, 128, False)
  assert not tables(h64, 64, 64, True)  # three warpgroups at three stages leave no room
  assert not tables(h64, 64, 128, True)
  assert not tables(h128, 128, 128, False)
  q = jnp.zeros((1, 128, 1, 128), bf16)
  with plgpu.force_gpu_interpret_mode(), pytest.raises(ValueError, match="forward.*stages"):
    kernel_attention(q, q, q, block_sizes=dataclasses.replace(h128, stages=4))


def test_backward_smem_error_names_fields():
  # 128-row key steps at H = 128 overflow the dq kernel's SMEM: a clear error at trace time.
  blocks = dataclasses.replace(default_block_sizes(128), block_kv_dq=128)
  q = jax.ShapeDtypeStruct((1, 128, 1, 128), jnp.bfloat16)
  grad = jax.grad(lambda q: kernel_attention(q, q, q, block_sizes=blocks).sum().astype(
      jnp.float32))
  with plgpu.force_gpu_interpret_mode(), pytest.raises(ValueError, match="dq.*stages"):
    jax.eval_shape(grad, q)


def test_block_size_defaults_and_types():
  # Three forward warpgroups without ping-pong where they fit (H <= 64, where they measured
  # faster), else two with ping-pong; two with the plain schedule at H = 128; the dk/dv
  # warpgroups in roles at H = 128, where one warpgroup's accumulators spill. `BlockSizes()` is
  # H <= 64's.
  assert default_block_sizes(32) == default_block_sizes(64) == BlockSizes()
  assert [default_block_sizes(h).forward_warpgroups for h in (32, 64, 128)] == [None, None, 2]
  assert default_block_sizes(64).ping_pong and not default_block_sizes(128).ping_pong
  bf16 = jnp.bfloat16
  decided = lambda blocks, h, vd: (lambda p: (p.warpgroups, p.ping_pong))(
      plan_forward(blocks, h, vd, bf16, False))
  assert decided(default_block_sizes(64), 64, 64) == (3, False)
  assert decided(default_block_sizes(64), 64, 128) == (2, True)  # a's own SMEM tile: no room
  assert decided(default_block_sizes(32), 32, 128) == (3, False)
  # Where the forward's least depth is deeper (here the backward's stages), three may not fit.
  assert decided(dataclasses.replace(default_block_sizes(32), stages=3), 32, 128) == (2, True)
  assert decided(default_block_sizes(128), 128, 128) == (2, False)
  assert decided(dataclasses.replace(default_block_sizes(64), forward_warpgroups=3,
                                     ping_pong=True), 64, 64) == (3, False)
  assert default_block_sizes(128).dkv_roles and not default_block_sizes(64).dkv_roles
  assert default_block_sizes(128).overlap_bwd and not default_block_sizes(64).overlap_bwd
  assert not any(default_block_sizes(h).bounded_softmax for h in (64, 128))
  assert default_block_sizes(128).row_sum_mma and not default_block_sizes(64).row_sum_mma
  assert default_block_sizes(128).rescale_threshold == 8.0
  assert default_block_sizes(64).rescale_threshold is None
  with pytest.raises(TypeError, match="overlap_bwd"):
    BlockSizes(overlap_bwd=1)
  with pytest.raises(TypeError, match="dkv_roles"):
    BlockSizes(dkv_roles=1)
  with pytest.raises(TypeError, match="stages"):
    BlockSizes(stages=2.5)
  with pytest.raises(TypeError, match="block_q"):
    BlockSizes(block_q=64.0)
  with pytest.raises(TypeError, match="ping_pong"):
    BlockSizes(ping_pong="no")
  with pytest.raises(TypeError, match="ping_pong"):
    BlockSizes(ping_pong=None)
  with pytest.raises(TypeError, match="row_sum_mma"):
    BlockSizes(row_sum_mma=1)
  with pytest.raises(TypeError, match="bounded_softmax"):
    BlockSizes(bounded_softmax=1)
  with pytest.raises(TypeError, match="forward_warpgroups"):
    BlockSizes(forward_warpgroups=3.0)



def test_bounded_tiles_bound_every_score():
  # A flag of 1 promises |scale · a_ts| <= BOUNDED_SCORE_LIMIT for every score of the tile; the
  # bound (Cauchy-Schwarz on the Cartesian vectors) holds for any phase and positions, and large
  # raw queries in one tile unflag that tile only.
  q, k, _, delta, _ = _problem((2, 4, 2, 32), 256, 200, seed=3)
  q = q.at[:, 128:, 1].multiply(10.0)
  scale = 0.5
  flags = np.asarray(kernel.bounded_tiles(q, k, scale, 128))
  assert flags.shape == (2, 4, 2)
  assert flags[:, 1, 1].sum() == 0 and flags[:, :, 0].all() and flags[:, 0].all()
  a = encodings.pope_cartesian(q, jnp.arange(256), phase=-delta)
  b = jnp.repeat(encodings.pope_cartesian(k, jnp.arange(200)), 2, axis=2)
  scores = np.abs(np.asarray(jnp.einsum("btnd,bsnd->bnts", a, b))) * scale
  tile_max = scores.reshape(2, 4, 2, 128, 200).max((3, 4))
  assert np.all(tile_max[flags == 1] <= kernel.BOUNDED_SCORE_LIMIT)
  assert tile_max[flags == 1].max() > 1.0  # a bound that is not vacuous here


def test_bounded_tiles_at_the_limit():
  # q = k = c in every channel, δ = 0: the score of query t and key t (one position) is
  # scale · H · softplus(c)², Cauchy-Schwarz with equality. Just above the limit no tile may be
  # flagged; at 0.99 of the documented bound (softplus <= relu + log 2) every tile is.
  h, c = 32, 1.5
  x = jnp.full((1, 128, 1, h), c, jnp.bfloat16)
  a = encodings.pope_cartesian(x, jnp.arange(128))
  peak = float(jnp.einsum("btnd,btnd->bnt", a, a).max())
  np.testing.assert_allclose(peak, h * float(jax.nn.softplus(c)) ** 2, rtol=1e-5)
  limit = kernel.BOUNDED_SCORE_LIMIT
  assert np.asarray(kernel.bounded_tiles(x, x, 1.01 * limit / peak, 128)).sum() == 0
  documented = h * (c + math.log(2)) ** 2
  assert np.asarray(kernel.bounded_tiles(x, x, 0.99 * limit / documented, 128)).all()


def test_bounded_flags_route_each_tile(monkeypatch):
  # Only the tile of head 1 whose rows 0-127 have scores past 2**128 is flagged (tile 0: rows
  # 0-191 with three forward warpgroups): those rows must overflow in exp2, and nothing else
  # may. A kernel reading another item's
  # flag (rank for tile, or the table transposed) leaves that tile finite.
  q, k, v, delta, _ = _problem((1, 2, 1, 32), 256, 256, seed=21)
  q = q.at[:, :128, 1].multiply(200.0)
  flags = jnp.zeros((1, 2, 2), jnp.int32).at[0, 1, 0].set(1)   # [B, N, tiles]
  monkeypatch.setattr(kernel, "bounded_tiles", lambda *_: flags)
  blocks = dataclasses.replace(default_block_sizes(32), bounded_softmax=True)
  with plgpu.force_gpu_interpret_mode():
    out = np.asarray(jax.jit(functools.partial(kernel_attention, is_causal=True,
                                               block_sizes=blocks))(q, k, v, delta), np.float32)
  finite = np.isfinite(out).all(-1)                                   # [B, T, N]
  assert finite[:, :128, 1].mean() < 0.5
  assert finite[:, 128:].all() and finite[:, :, 0].all()


@pytest.mark.parametrize("head_dim, row_sum_mma", [(32, False), (64, True)])
@pytest.mark.slow  # test_bounded_flags_route_each_tile runs bounded tiles in the fast tier
def test_bounded_softmax_forward_and_grads(head_dim, row_sum_mma):
  # Bounded tiles (exp2 of the scores, no running max) beside unbounded ones (online softmax):
  # large raw queries in the second tile of head 1 (192 rows with three forward warpgroups, the
  # default here, of which the last 64 are padding) unflag that tile.
  q, k, v, delta, cot = _problem((1, 2, 1, head_dim), 256, 256, seed=21)
  q = q.at[:, 192:, 1].multiply(8.0)
  blocks = dataclasses.replace(default_block_sizes(head_dim), bounded_softmax=True,
                               row_sum_mma=row_sum_mma)
  rows = kernel.forward_tile_rows(blocks, head_dim, head_dim, q.dtype)
  assert rows == 192
  flags = np.asarray(kernel.bounded_tiles(q, k, 1 / (math.sqrt(head_dim) * math.log(2)), rows))
  assert flags.shape == (1, 2, 2) and flags[0, 1, 1] == 0 and flags.sum() == 3

  got = _kernel_value_and_grads(blocks, q, k, v, delta, cot, is_causal=True)
  _assert_close(got, _value_and_grads("xla", q, k, v, delta, cot, is_causal=True))


@pytest.mark.slow  # a 512 × 512 check shape in the interpreter
def test_large_magnitudes_error_is_the_bf16_operands():
  # check_h64_large (q, k × 8: softplus up to ~25, scores up to ~200 log2 units). The kernel's
  # output is as far from the float32 reference as float32 attention over the Cartesian q', k'
  # rounded to bf16, the operands the kernel feeds the tensor cores (~12 % of the output's max
  # here, where the XLA path, Cartesian form in float32, is 0.3 % off): the error is that
  # rounding, not precision lost inside the kernel (row max, exp2, tables).
  shape = SHAPES["check_h64_large"]
  q, k, v, delta = random_inputs(shape, seed=1)
  cot = jax.random.normal(jax.random.key(2), q.shape[:3] + (shape.value_dim,), jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)
  with plgpu.force_gpu_interpret_mode():
    got = _value_and_grads("pallas", q, k, v, delta, cot, is_causal=True)
  want = _value_and_grads("xla", f32(q), f32(k), f32(v), delta, cot, is_causal=True)
  t_pos, s_pos = positions.default_positions(shape.q_len, shape.k_len)
  group = shape.num_heads // shape.num_kv_heads
  scale = 1 / (math.sqrt(shape.head_dim) * math.log(2))  # the kernel's, log2 units
  a = encodings.pope_cartesian(f32(q), t_pos, phase=-delta) * scale
  b = jnp.repeat(encodings.pope_cartesian(f32(k), s_pos), group, axis=2)
  scores = jnp.einsum("btnd,bsnd->bnts", f32(a.astype(jnp.bfloat16)),
                      f32(b.astype(jnp.bfloat16)))
  scores = jnp.where(s_pos[None, :] <= t_pos[:, None], scores, -jnp.inf)
  p = jnp.exp2(scores - scores.max(-1, keepdims=True))
  rounded = jnp.einsum("bnts,bsnv->btnv", p / p.sum(-1, keepdims=True),
                       jnp.repeat(f32(v), group, axis=2))
  ref = np.asarray(want[0], np.float64)
  rel = lambda x: np.abs(np.asarray(x, np.float64) - ref).max() / np.abs(ref).max()
  assert rel(rounded) > 0.05, rel(rounded)                 # a hard case for bf16 operands
  assert rel(got[0]) < 1.05 * rel(rounded) + 2e-3, (rel(got[0]), rel(rounded))
  tol = CHECK_TOLERANCES["check_h64_large"]
  for name, x, y in zip(("out", "dq", "dk", "dv", "ddelta"), got, want):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.abs(x - y).max() < tol * np.abs(y).max(), name
