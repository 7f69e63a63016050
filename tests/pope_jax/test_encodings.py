"""RoPE/PoPE encodings: hand-computed cases, frequency definitions, bad input."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pope_jax import encodings


def test_rope_frequencies_match_roformer():
  np.testing.assert_allclose(encodings.rope_frequencies(8, 10000.0),
                             [1.0, 10000 ** -0.25, 10000 ** -0.5, 10000 ** -0.75], rtol=1e-6)


def test_pope_frequencies_are_d_frequencies():
  f = encodings.pope_frequencies(4, 10000.0)
  np.testing.assert_allclose(f, [1.0, 10.0 ** -1, 10.0 ** -2, 10.0 ** -3], rtol=1e-6)


def test_rope_half_split_matches_hf_rotate_half_by_hand():
  x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
  out = np.asarray(encodings.apply_rope(x, jnp.array([1]), base=10000.0, layout="half"))[0, 0, 0]
  c0, s0, c1, s1 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
  # HF: x * cos + rotate_half(x) * sin, rotate_half([a, b]) = [-b, a]; pairs (0, 2), (1, 3).
  expected = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1]
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_rope_interleaved_by_hand():
  x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
  out = np.asarray(encodings.apply_rope(x, jnp.array([1]), layout="interleaved"))[0, 0, 0]
  c0, s0, c1, s1 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
  np.testing.assert_allclose(out, [1 * c0 - 2 * s0, 2 * c0 + 1 * s0, 3 * c1 - 4 * s1,
                                   4 * c1 + 3 * s1], rtol=1e-6)


def test_rope_multiplier_is_position_interpolation():
  x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
  pos = jnp.arange(5) * 2
  a = encodings.apply_rope(x, pos, multiplier=0.5)
  b = encodings.apply_rope(x, pos // 2)
  np.testing.assert_allclose(a, b, atol=1e-6)
  per_head = encodings.apply_rope(x, pos, multiplier=jnp.array([0.5, 1.0]))
  np.testing.assert_allclose(per_head[:, :, 0], b[:, :, 0], atol=1e-6)
  np.testing.assert_allclose(per_head[:, :, 1], encodings.apply_rope(x, pos)[:, :, 1], atol=1e-6)


def test_rope_angles_in_float32_for_bf16_inputs():
  x = jnp.ones((1, 1, 1, 2), jnp.bfloat16)
  out = encodings.apply_rope(x, jnp.array([10_000]))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32)[0, 0, 0],
                             [math.cos(1e4) - math.sin(1e4), math.cos(1e4) + math.sin(1e4)],
                             atol=1e-2)


def test_phase_bias_init_and_clamp():
  d = encodings.init_phase_bias(jax.random.key(0), (4, 8), "uniform")
  assert d.dtype == jnp.float32 and float(d.min()) >= -2 * math.pi and float(d.max()) <= 0
  assert not np.any(encodings.init_phase_bias(jax.random.key(0), (4, 8), "zeros"))
  np.testing.assert_allclose(encodings.clamp_phase_bias(jnp.array([-10.0, -1.0, 3.0])),
                             [-2 * math.pi, -1.0, 0.0], rtol=1e-6)
  # Full gradient inside the closed range (bounds included, where zeros-init δ starts), none
  # outside it.
  points = jnp.array([0.0, -2 * math.pi, -1.0, 0.5, -7.0], jnp.float32)
  grad = jax.grad(lambda d: encodings.clamp_phase_bias(d).sum())(points)
  np.testing.assert_array_equal(grad, [1.0, 1.0, 1.0, 0.0, 0.0])


@pytest.mark.parametrize("call, match", [
    (lambda: encodings.rope_frequencies(7), "even"),
    (lambda: encodings.apply_rope(jnp.ones((1, 2, 1, 4)), jnp.arange(2), layout="zigzag"),
     "layout"),
    (lambda: encodings.init_phase_bias(jax.random.key(0), (2, 2), "normal"), "delta_init"),
    (lambda: encodings.scale_frequencies(jnp.ones(2), jnp.ones((2, 2))), "multiplier"),
    (lambda: encodings.apply_rope(jnp.ones((1, 2, 3, 4)), jnp.arange(2),
                                  multiplier=jnp.ones(2)), "heads"),
])
def test_bad_input_is_named(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def _plain_cartesian(x, positions, *, base, phase=None, multiplier=None):
  """PoPE Eq. 7-10 written directly, differentiated by autodiff (the reference for the VJP)."""
  freqs = encodings.scale_frequencies(encodings.pope_frequencies(x.shape[-1], base), multiplier)
  ang = encodings.angles(positions, freqs)
  if phase is not None:
    ang = ang + phase
  mag = jax.nn.softplus(x.astype(jnp.float32))
  return jnp.concatenate([mag * jnp.cos(ang), mag * jnp.sin(ang)], axis=-1)


def _cartesian_float64(x, positions, base, phase, multiplier):
  """PoPE Eq. 7-10 in float64 from the float32 frequencies; also returns the largest |angle|."""
  freqs = np.asarray(encodings.scale_frequencies(encodings.pope_frequencies(x.shape[-1], base),
                                                 multiplier), np.float64)
  pos = np.asarray(positions, np.float64)
  pos = pos[None] if pos.ndim == 1 else pos
  ang = pos[:, :, None, None] * (freqs if freqs.ndim == 2 else freqs[None])[None, None]
  if phase is not None:
    ang = ang + np.asarray(phase, np.float64)
  mag = np.logaddexp(0.0, np.asarray(x, np.float64))
  return np.concatenate([mag * np.cos(ang), mag * np.sin(ang)], axis=-1), np.abs(ang).max()


@pytest.mark.parametrize("batch_positions", [False, True])
@pytest.mark.parametrize("with_phase", [False, True])
@pytest.mark.parametrize("multiplier", [None, 0.5, "per_head"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cartesian_gradient_matches_autodiff_of_the_plain_formula(batch_positions, with_phase,
                                                                  multiplier, dtype):
  b, t, n, h = 2, 7, 3, 8
  keys = jax.random.split(jax.random.key(0), 5)
  x = (2 * jax.random.normal(keys[0], (b, t, n, h))).astype(dtype)
  positions = (jax.random.randint(keys[1], (b, t), 0, 3000) if batch_positions
               else jnp.arange(100, 100 + t))
  phase = jax.random.uniform(keys[2], (n, h), minval=-6.0, maxval=0.0) if with_phase else None
  if multiplier == "per_head":
    multiplier = jax.random.uniform(keys[3], (n,), minval=0.25, maxval=2.0)
  cot = jax.random.normal(keys[4], (b, t, n, 2 * h))

  def loss(fn, x, phase, multiplier):
    return (fn(x, positions, base=500.0, phase=phase, multiplier=multiplier) * cot).sum()

  ours, plain = encodings.pope_cartesian, _plain_cartesian
  got = np.asarray(ours(x, positions, base=500.0, phase=phase, multiplier=multiplier))
  want, max_angle = _cartesian_float64(x, positions, 500.0, phase, multiplier)
  # Float32 angles carry rounding of half an ulp of the largest angle (~1e-4 rad at 3000 rad).
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=2 * 2.0**-24 * max_angle * np.abs(want).max() + 1e-6)
  argnums = (0,) + ((1,) if with_phase else ()) + ((2,) if multiplier is not None else ())
  got = jax.grad(functools.partial(loss, ours), argnums)(x, phase, multiplier)
  want = jax.grad(functools.partial(loss, plain), argnums)(x, phase, multiplier)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


def test_polar_to_cartesian_names_a_rank_mismatch():
  with pytest.raises(ValueError, match="rank"):
    encodings.polar_to_cartesian(jnp.ones((1, 2, 3, 4)), jnp.ones((2, 3, 4)))


def test_cartesian_gradient_when_x_broadcasts_against_batched_positions():
  x = jax.random.normal(jax.random.key(0), (1, 5, 3, 4))
  positions = jnp.stack([jnp.arange(5), jnp.arange(5) + 7])             # [2, T]
  loss = lambda fn, x: (fn(x, positions, base=100.0, phase=None, multiplier=None) ** 2).sum()
  got = jax.grad(functools.partial(loss, encodings.pope_cartesian))(x)
  want = jax.grad(functools.partial(loss, _plain_cartesian))(x)
  assert got.shape == x.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [encodings.apply_rope, encodings.pope_cartesian])
@pytest.mark.parametrize("positions", [np.arange(4), np.zeros((3, 5), np.int32)])
def test_positions_of_the_wrong_shape_are_named(fn, positions):
  x = jnp.ones((2, 5, 3, 8))
  with pytest.raises(ValueError, match=r"positions must have shape \[T\] = \[5\] or \[B, T\]"):
    fn(x, positions)
