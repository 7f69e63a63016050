"""The forward kernel's in-register PoPE Cartesian map of a query tile (PoPE Eq. 7-10).

Shape letters: R rows of the tile, H head dim.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import _streaming as st

# 2π in two parts for the range reduction of pos·θ: the first has 8 significant bits, so
# turns · _TWO_PI_HI is exact for |turns| < 2**16 (pos·θ below ~4e5 rad); above, its rounding
# adds at most half an ulp of the float32 pos·θ.
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 2 * math.pi - _TWO_PI_HI
# The query angles' cos and sin tables of `BlockSizes.query_tables`: float16 holds [-1, 1] to
# 2**-12 (bfloat16 only to 2**-9, the precision of the kernel's bf16 Cartesian queries).
TABLE_DTYPE = jnp.float16



def cartesian_halves(x, pos, freq, phase, magnitude_scale: float, dtype):
  """In-kernel PoPE Cartesian map of one tile (PoPE Eq. 7-10; `encodings.polar_to_cartesian`).

  Args:
    x: [R, H] raw projections (any float dtype, WGMMA layout).
    pos: [R] float32 positions; freq, phase: [H] float32 θ_c and the phase added to pos·θ_c.
    magnitude_scale: factor applied to softplus(x).
    dtype: result dtype.

  Returns:
    (μ cos φ, μ sin φ)·magnitude_scale, each [R, H] in `dtype`, φ = pos·θ + phase, μ =
    softplus(x) (`_streaming.softplus`). As in the reference map, pos·θ is one
    float32 product and the phase is added without rounding it again: pos·θ is reduced to
    about [-π, π] first (Cody-Waite, 2π in two parts; the subtraction is exact below 4e5
    rad), then the phase (|phase| <= 2π) is added and the sum wrapped back by 2π. cos and sin
    run as the hardware approximations on the GPU (absolute error ~1e-6, below bf16's
    rounding).
  """
  rows, h = x.shape
  ang = st.broadcast(pos, (rows, h), 0) * st.broadcast(freq, (rows, h), 1)
  turns = jnp.round(ang * (1 / (2 * math.pi)))
  ang = ang - turns * _TWO_PI_HI - turns * _TWO_PI_LO + st.broadcast(phase, (rows, h), 1)
  ang = jnp.where(ang > math.pi, ang - 2 * math.pi, jnp.where(ang < -math.pi, ang + 2 * math.pi,
                                                              ang))
  mag = st.softplus(x) * magnitude_scale
  return (mag * jnp.cos(ang)).astype(dtype), (mag * jnp.sin(ang)).astype(dtype)


def cartesian_halves_from_tables(x, cos_t, sin_t, cos_p, sin_p, magnitude_scale: float,
                                 dtype):
  """In-kernel PoPE Cartesian map of one tile from the cos and sin of its angles (PoPE Eq.
  7-10; `BlockSizes.query_tables`), by angle addition as `encodings._cos_sin`.

  Args:
    x: [R, H] raw projections (any float dtype, WGMMA layout).
    cos_t, sin_t: [R, H] cos(pos·θ) and sin(pos·θ) of the tile's rows (any float dtype; the
      kernel's tables are float16, `TABLE_DTYPE`).
    cos_p, sin_p: [H] float32 cos and sin of the phase added to pos·θ.
    magnitude_scale: factor applied to softplus(x).
    dtype: result dtype.

  Returns:
    (μ cos φ, μ sin φ)·magnitude_scale, each [R, H] in `dtype`, φ = pos·θ + phase, μ =
    softplus(x) (`_streaming.softplus`): cos φ = cos_t cos_p - sin_t sin_p and sin φ = sin_t
    cos_p + cos_t sin_p. Two transcendentals per element (the softplus) instead of the four
    of `cartesian_halves`, and no range reduction.
  """
  rows, h = x.shape
  cos_t, sin_t = cos_t.astype(jnp.float32), sin_t.astype(jnp.float32)
  cos_p, sin_p = st.broadcast(cos_p, (rows, h), 1), st.broadcast(sin_p, (rows, h), 1)
  mag = st.softplus(x) * magnitude_scale
  return ((mag * (cos_t * cos_p - sin_t * sin_p)).astype(dtype),
          (mag * (sin_t * cos_p + cos_t * sin_p)).astype(dtype))
