"""The PoPE attention paths that `experiments.bench_attention` times (a helper, no CLI).

Each path is fn(q, k, v, delta) -> out with q [B, T, N, H], k [B, S, K, H], v [B, S, K, V],
δ [N, H] float32 and out [B, T, N, V] in the query dtype, causal: the XLA reference, the
Cartesian expansion + cuDNN or tokamax (one-pass `encodings.pope_cartesian`, or the plain
concatenated form), our fused kernel and plain RoPE attention on cuDNN for scale.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import pope_attention as kernel
from pallas_kernels.pope_attention_config import BlockSizes, default_block_sizes
from pope_jax import attention, encodings, positions

PEAK_TFLOPS = 790.0  # bf16 dense matmul peak measured on the H200 (8192³ matmul, random data)
SPEC_PEAK_TFLOPS = 989.4  # H200 SXM datasheet bf16 dense peak: the usual MFU denominator


def _concat_cartesian(x, positions, base, phase=None):
  """The plain expansion: softplus, then [μ cos φ, μ sin φ] joined by a concatenation (XLA
  writes μ in float32 before the concatenation; `encodings.pope_cartesian` is one pass)."""
  ang = encodings.angles(positions, encodings.pope_frequencies(x.shape[-1], base))
  ang = ang if phase is None else ang + phase
  mag = encodings.pope_magnitudes(x)
  return jnp.concatenate([mag * jnp.cos(ang), mag * jnp.sin(ang)], axis=-1)


def _expand(q, k, delta, base=10000.0, cartesian=encodings.pope_cartesian):
  """Cartesian PoPE q', k' (δ on the query side, as the reference), 2H wide, input dtype."""
  t_len, s_len = q.shape[1], k.shape[1]
  q_pos, k_pos = positions.default_positions(t_len, s_len)
  qe = cartesian(q, q_pos, base=base, phase=-encodings.clamp_phase_bias(delta))
  ke = cartesian(k, k_pos, base=base)
  return qe.astype(q.dtype), ke.astype(k.dtype)


def pope_cudnn(q, k, v, delta, cartesian=encodings.pope_cartesian):
  h = q.shape[-1]
  qe, ke = _expand(q, k, delta, cartesian=cartesian)
  vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 2 * h - v.shape[-1])))
  out = jax.nn.dot_product_attention(qe, ke, vp, scale=1 / math.sqrt(h), is_causal=True,
                                     implementation="cudnn")
  return out[..., :v.shape[-1]]


def pope_library_cudnn(q, k, v, delta):
  """`pope_attention(implementation="cudnn")`: the library's expansion + cuDNN path."""
  return attention.pope_attention(q, k, v, delta, is_causal=True, implementation="cudnn")


def pope_tokamax(q, k, v, delta, cartesian=encodings.pope_cartesian):
  import tokamax  # Only on machines where it is installed.
  qe, ke = _expand(q, k, delta, cartesian=cartesian)
  return tokamax.dot_product_attention(qe, ke, v, scale=1 / math.sqrt(q.shape[-1]),
                                       is_causal=True, implementation="mosaic")


TOKAMAX = "expand + tokamax mosaic"
TOKAMAX_AUTOTUNED = "expand + tokamax (autotuned)"
BASELINES = {  # name: (function, needs tokamax); every row's /best is to the fastest of these.
    "expand + cuDNN": (pope_library_cudnn, False),
    TOKAMAX: (pope_tokamax, True),
    "concat expand + cuDNN": (functools.partial(pope_cudnn, cartesian=_concat_cartesian), False),
    "concat expand + tokamax": (functools.partial(pope_tokamax, cartesian=_concat_cartesian),
                                True),
}


def pope_xla(q, k, v, delta):
  return attention.pope_attention(q, k, v, delta, is_causal=True, implementation="xla")


def kernel_call(q, k, v, delta, *, q_positions=None, k_positions=None, **kw):
  """The kernel entry point as `attention.pope_attention(implementation="pallas")` calls it
  (positions defaulted, θ, the clamped δ), with the kernel's own keywords (`block_sizes`)."""
  q_pos, k_pos, _ = positions.resolve(q.shape[0], q.shape[1], k.shape[1], q_positions,
                                      k_positions, None, keep_numpy=True)
  with jax.ensure_compile_time_eval():
    freqs = encodings.pope_frequencies(q.shape[-1])
  return kernel.pope_attention(
      q, k, v, encodings.clamp_phase_bias(delta.astype(jnp.float32)), frequencies=freqs,
      q_positions=q_pos, k_positions=k_pos, cartesian_map=encodings.polar_to_cartesian, **kw)


def pope_pallas(q, k, v, delta, blocks: BlockSizes | None = None,
                traced_positions: bool = False):
  """Our kernel; `traced_positions` passes the default positions as arrays traced with the call
  (as `jnp.arange` under jit gives), so the kernels' position tables run in every call instead
  of at trace time."""
  if traced_positions:  # jnp.asarray inside jit traces them
    q_pos, k_pos = map(jnp.asarray, positions.default_positions(q.shape[1], k.shape[1]))
    return kernel_call(q, k, v, delta, is_causal=True, block_sizes=blocks,
                       q_positions=q_pos, k_positions=k_pos)
  if blocks is None:
    return attention.pope_attention(q, k, v, delta, is_causal=True, implementation="pallas")
  return kernel_call(q, k, v, delta, is_causal=True, block_sizes=blocks)


def rope_cudnn(q, k, v, delta):
  del delta
  t_len, s_len = q.shape[1], k.shape[1]
  q_pos, k_pos = positions.default_positions(t_len, s_len)
  qr = encodings.apply_rope(q, q_pos)
  kr = encodings.apply_rope(k, k_pos)
  return jax.nn.dot_product_attention(qr, kr, v, is_causal=True, implementation="cudnn")


OURS = "fused PoPE (ours)"
BOUNDED = "fused PoPE (bounded_softmax)"
ROPE = "RoPE cuDNN (scale)"


def fused_paths(head_dim: int) -> dict:
  """Our kernel with its default blocks and with `bounded_softmax`, by table row name."""
  bounded = dataclasses.replace(default_block_sizes(head_dim), bounded_softmax=True)
  return {OURS: pope_pallas, BOUNDED: functools.partial(pope_pallas, blocks=bounded)}


@functools.cache  # One jitted gradient per function: a second call reuses its compilation.
def fwd_bwd(fn):
  """jit(grad) of fn's float32 output sum with respect to q, k, v and δ."""
  def loss(q, k, v, delta):
    return fn(q, k, v, delta).astype(jnp.float32).sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def tile_scale(t_len: int, rows: int, factor: float = 5.0) -> jax.Array:
  """[1, T, 1, 1] bf16: `factor` on every other block of `rows` query rows (the forward's query
  tile, `pope_attention.forward_tile_rows`), else 1. At N(0, 1) inputs the unscaled tiles'
  magnitude bound holds and the scaled ones' fails, so `bounded_softmax` gets bounded and
  online-softmax items in one CTA."""
  scale = jnp.where(jnp.arange(t_len) // rows % 2 == 1, factor, 1.0)
  return scale.astype(jnp.bfloat16)[None, :, None, None]
