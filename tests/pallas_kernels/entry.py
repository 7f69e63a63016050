"""The kernel entry point called as `pope_jax.pope_attention(implementation="pallas")` calls it:
positions checked and defaulted by `pope_jax.positions`, θ (times a multiplier) and the clamped δ
from the encodings."""

import math

import jax
import jax.numpy as jnp

from pallas_kernels import pope_attention as kernel
from pope_jax import encodings, positions


def kernel_attention(q, k, v, delta=None, *, base=10000.0, q_positions=None, k_positions=None,
                     multiplier=None, **kw):
  """`pallas_kernels.pope_attention.pope_attention` with the op's defaults; `multiplier` None, a
  scalar or [N] (`encodings.scale_frequencies`); kw as the kernel's."""
  q_pos, k_pos, _ = positions.resolve(q.shape[0], q.shape[1], k.shape[1], q_positions,
                                      k_positions, None, keep_numpy=True)
  with jax.ensure_compile_time_eval():
    freqs = encodings.scale_frequencies(encodings.pope_frequencies(q.shape[-1], base), multiplier)
  delta = None if delta is None else encodings.clamp_phase_bias(
      jnp.asarray(delta).astype(jnp.float32))
  return kernel.pope_attention(q, k, v, delta, frequencies=freqs, q_positions=q_pos,
                               k_positions=k_pos, cartesian_map=encodings.polar_to_cartesian,
                               **kw)


def problem(family, t_len, s_len, seed):
  """Random bf16 q, k, v, float32 δ in [-2π, 0] and a float32 output cotangent for family
  (B, N, K, H) at T = t_len, S = s_len."""
  b, n, kh, h = family
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (b, t_len, n, h), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s_len, kh, h), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s_len, kh, h), jnp.float32).astype(jnp.bfloat16)
  delta = jax.random.uniform(ks[3], (n, h), jnp.float32, -2 * math.pi, 0.0)
  cot = jax.random.normal(ks[4], (b, t_len, n, h), jnp.float32)
  return q, k, v, delta, cot
