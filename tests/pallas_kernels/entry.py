"""The kernel entry point called as `pope_jax.pope_attention(implementation="pallas")` calls it:
positions checked and defaulted by `pope_jax.positions`, θ (times a multiplier) and the clamped δ
from the encodings."""

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
