"""The forward kernel's in-register PoPE Cartesian map of a query tile (PoPE Eq. 7-10).

Shape letters: R rows of the tile, H head dim.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import _streaming as st

# 2π in two parts (Cody-Waite): turns · _TWO_PI_HI is exact for |turns| < 2**16.
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 2 * math.pi - _TWO_PI_HI
# The query tables' dtype (`ForwardPlan.tables`): float16 holds [-1, 1] to 2**-12 (bf16: 2**-9).
TABLE_DTYPE = jnp.float16



def cartesian_halves(x, pos, freq, phase, magnitude_scale: float, dtype):
  """(μ cos φ, μ sin φ)·magnitude_scale, each [R, H] in `dtype` (PoPE Eq. 7-10), μ =
  softplus(x) of x [R, H], φ = pos·θ + phase from pos [R], freq θ and phase [H] float32: pos·θ
  one float32 product as in the reference, reduced to [-π, π] before the phase is added."""
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
  """`cartesian_halves` from cos_t, sin_t [R, H] of pos·θ and cos_p, sin_p [H] float32 of the
  phase, by angle addition (`ForwardPlan.tables`): two transcendentals, not four."""
  rows, h = x.shape
  cos_t, sin_t = cos_t.astype(jnp.float32), sin_t.astype(jnp.float32)
  cos_p, sin_p = st.broadcast(cos_p, (rows, h), 1), st.broadcast(sin_p, (rows, h), 1)
  mag = st.softplus(x) * magnitude_scale
  return ((mag * (cos_t * cos_p - sin_t * sin_p)).astype(dtype),
          (mag * (sin_t * cos_p + cos_t * sin_p)).astype(dtype))
