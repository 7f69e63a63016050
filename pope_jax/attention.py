"""Attention with PoPE or RoPE, shaped like `jax.nn.dot_product_attention`.

Public API: `pope_attention`, `rope_attention`, and the reference `dot_product_attention_reference`.
Both ops take one vocabulary, `implementation=` one of IMPLEMENTATIONS or None, checked by
`check_implementation` (as every config holding a name is):
  "xla"     the reference (float32 math, materialised scores); runs everything.
  "cudnn"   map q and k (RoPE: rotate them; PoPE: their 2H-wide Cartesian form, float32 angles,
            cast back to the input dtype), then cuDNN flash attention through
            `jax.nn.dot_product_attention`, forward and backward, on NVIDIA GPUs sm80+. Positions
            and multipliers act in the map, so only the mask reaches cuDNN: its own causal mask
            (and sliding window) where positions are the defaults with T == S and there is no
            key_mask or segment ids, else the boolean mask of `pope_jax.positions`.
  "pallas"  the Mosaic GPU kernels in `pallas_kernels` (Hopper), imported lazily so a CPU-only
            install imports fine: PoPE's fused kernel (it takes `block_sizes`); and for decoding
            (T <= 16 new queries against S > T keys, `_is_decode`) the split-K decoding kernel
            on the mapped q and k, for PoPE and RoPE.
  None      the first of ORDER = ("pallas", "cudnn", "xla") that runs the inputs on this
            platform (`_pope_why_not` / `_rope_why_not`, the same check a named implementation
            runs).
A named implementation that cannot run the inputs raises NotImplementedError saying why; an
unknown name raises ValueError; there is no silent fallback.

cuDNN's constraints, as `jax.nn.dot_product_attention` and
`jax._src.cudnn.fused_attention_stablehlo` (jax 0.11) check them: query, key and value of one
dtype, bf16 or fp16; value of the key's shape (V == H: here v, or q and k, are zero-padded to one
width, a multiple of 8, and the output sliced back); that width at most 128 before Hopper and 256
from sm90; sm103 needs cuDNN 9.11+. A boolean mask becomes an additive bias [B|1, 1, T, S] (full
T and S), and a backward with a bias needs even T and S (here the backward pads a query row and a
key that nothing sees). Its causal mask is top-left aligned, so it serves only T == S. A fully
masked row is not zero there: such rows are zeroed here. Masked keys must hold finite values
(unwritten `pope_jax.kv_cache` slots are zeros): unlike the reference, cuDNN gives them weight 0.

Shape letters: B batch, T query length, S key length, N query heads, K kv heads (N % K == 0),
H q/k head dim, V value head dim.

`decode_attention` is the plain softmax attention of already-mapped queries and keys over a KV
cache (a cache that holds rotated or Cartesian keys), with the same vocabulary.

Positions, their defaults and masks are those of `pope_jax.positions` (causal by absolute
position, queries bottom-right aligned by default, also for T > S, as FlashAttention), checked
once per call. A query row with no visible key returns zeros (never NaN) and has finite
gradients.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from pope_jax import checks, encodings, positions

Array = jax.Array

# The implementation vocabulary of every op and config (None: the best available, by ORDER).
IMPLEMENTATIONS = ("xla", "cudnn", "pallas")
# The order in which implementation=None tries the implementations (first that runs wins).
ORDER = ("pallas", "cudnn", "xla")


def check_implementation(implementation, argument: str = "implementation") -> None:
  """Raises ValueError naming `argument` unless `implementation` is None or in IMPLEMENTATIONS.

  Only the name is checked; whether it runs given inputs is the op's to decide, per call."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{argument} must be one of {IMPLEMENTATIONS} or None, got "
                     f"{implementation!r}")
def _check_qkv(q: Array, k: Array, v: Array) -> None:
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"query, key, value must be [B, T, N, H], [B, S, K, H], [B, S, K, V]; got shapes "
        f"{q.shape}, {k.shape}, {v.shape}")
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"key {k.shape} and value {v.shape} must agree on [B, S, K]")
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"query batch {q.shape[0]} != key batch {k.shape[0]}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"query head dim {q.shape[-1]} != key head dim {k.shape[-1]}")
  for name, x in (("query", q), ("key", k), ("value", v)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a real floating-point array, got {x.dtype}")


def dot_product_attention_reference(
    q: Array, k: Array, v: Array, *, scale: float, mask: Array | None = None,
    dropout_rate: float = 0.0, dropout_rng: Array | None = None
) -> Array:
  """Softmax attention with materialised scores, float32 inside (the reference for every kernel).

  Args:
    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, V]; N % K == 0 (GQA).
    scale: logit scale.
    mask: None or bool broadcastable to [B, T, S] (True = visible).
    dropout_rate: p, dropout on the attention probabilities: each is zeroed with probability p,
      the rest scaled by 1/(1 - p) (Vaswani et al. 2017, §5.4 applied to the weights, as in
      BERT and GPT-2). 0 = none.
    dropout_rng: a `jax.random` key, required when dropout_rate > 0.

  Returns:
    [B, T, N, V] float32. Rows with no visible key are zero. A key that no query sees (e.g. an
    unwritten KV-cache slot) never affects the output, whatever its key and value hold (NaN,
    inf): scores are replaced, not offset, and such values are zeroed (0 · NaN would be NaN). A
    key hidden from some queries only adds 0 · value to them, as in plain softmax attention.
  """
  _check_qkv(q, k, v)
  b, t, n, _ = q.shape
  kh = k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, q.shape[-1])
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale
  vf = v.astype(jnp.float32)
  if mask is None:
    probs = jax.nn.softmax(logits, axis=-1)
  else:
    mask = jnp.broadcast_to(mask, (b, t, k.shape[1]))
    m = mask[:, None, None]
    probs = jax.nn.softmax(jnp.where(m, logits, -1e30), axis=-1) * m
    vf = jnp.where(jnp.any(mask, axis=1)[:, :, None, None], vf, 0.0)       # [B, S, K, V]
  if dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("bkgts,bskv->btkgv", probs, vf)
  return out.reshape(b, t, n, v.shape[-1])


def _check_dropout(dropout_rate: float, dropout_rng: Array | None) -> None:
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  if dropout_rate > 0.0 and dropout_rng is None:
    raise ValueError("dropout_rate > 0 needs a dropout_rng key")


_DROPOUT_XLA_ONLY = "attention dropout runs only in the xla reference (dropout_rate > 0)"


def _check_multiplier(multiplier, query: Array) -> None:
  """A multiplier is None, a scalar or one value per query head; concrete values are finite."""
  if multiplier is not None and jnp.ndim(multiplier) and jnp.shape(multiplier) != query.shape[2:3]:
    raise ValueError(f"multiplier must be a scalar or have shape [num_heads] = "
                     f"[{query.shape[2]}] (the query's heads), got {jnp.shape(multiplier)}")
  encodings.check_finite_multipliers(multiplier, "multiplier")


def _check_delta(delta: Array, q: Array) -> Array:
  delta = jnp.asarray(delta)
  if delta.shape != q.shape[2:]:
    raise ValueError(
        f"delta must have shape [num_heads, head_dim] = {tuple(q.shape[2:])}, got {delta.shape}")
  if jnp.issubdtype(delta.dtype, jnp.complexfloating):
    raise TypeError(f"delta must be real (phase in radians), got {delta.dtype}")
  checks.check_finite(delta, "delta")
  return delta.astype(jnp.float32)


class _Masking(NamedTuple):
  """Which keys each query sees, resolved once per call (`pope_jax.positions`).

  `default`: default positions, T == S, no key_mask and no segment ids, where the mask is
  cuDNN's (and a kernel's) own causal mask."""
  is_causal: bool
  q_positions: Array
  k_positions: Array
  key_mask: Array | None
  q_segment_ids: Array | None
  kv_segment_ids: Array | None
  local_window: int | None
  default: bool

  def dense(self) -> Array | None:
    """The boolean mask (`positions.attention_mask`), or None when every key is visible."""
    return positions.attention_mask(
        jnp.asarray(self.q_positions), jnp.asarray(self.k_positions), is_causal=self.is_causal,
        k_valid=self.key_mask, local_window=self.local_window,
        q_segment_ids=self.q_segment_ids, kv_segment_ids=self.kv_segment_ids)


def _masking(query, key, *, is_causal, q_positions, k_positions, key_mask, q_segment_ids,
             kv_segment_ids, local_window=None, keep_numpy=False) -> _Masking:
  """The call's `_Masking`, checked (shapes, dtypes, int32 range) before any work."""
  b, t, s = query.shape[0], query.shape[1], key.shape[1]
  default = (q_positions is None and k_positions is None and key_mask is None
             and q_segment_ids is None and kv_segment_ids is None and t == s)
  q_pos, k_pos, key_mask = positions.resolve(b, t, s, q_positions, k_positions, key_mask,
                                             keep_numpy=keep_numpy)
  q_seg, kv_seg = positions.check_segment_ids(q_segment_ids, kv_segment_ids, b, t, s)
  return _Masking(is_causal, q_pos, k_pos, key_mask, q_seg, kv_seg, local_window, default)


def pope_map(x: Array, x_positions: Array, *, base: float = 10000.0, delta: Array | None = None,
             multiplier: Array | float | None = None, num_heads: int | None = None) -> Array:
  """Queries or keys [B, T, N|K, H] in PoPE's Cartesian form [B, T, N|K, 2H] float32 (PoPE Eq.
  7-10), as every PoPE path maps them: a query (num_heads None) takes the phase -δ of its head
  (δ [N, H], clamped); a key of a GQA group takes the multiplier of its group's first query head
  (num_heads N, `encodings.kv_head_multiplier`)."""
  if num_heads is None:
    # δ enters the query phase with opposite sign: cos(sθ - (tθ - δ)) = cos((s - t)θ + δ), the
    # paper's key-side bias, and every query head of a GQA group keeps its own δ.
    phase = None if delta is None else -encodings.clamp_phase_bias(delta)
    return encodings.pope_cartesian(x, x_positions, base=base, phase=phase, multiplier=multiplier)
  kmult = encodings.kv_head_multiplier(multiplier, num_heads, x.shape[2])
  return encodings.pope_cartesian(x, x_positions, base=base, multiplier=kmult)


def rope_map(x: Array, x_positions: Array, *, base: float = 10000.0,
             multiplier: Array | float | None = None, layout: encodings.RopeLayout = "half",
             frequencies: Array | None = None, num_heads: int | None = None) -> Array:
  """Queries or keys [B, T, N|K, H] rotated by position·θ (RoFormer Eq. 16), in x's dtype; keys
  (num_heads N) take their GQA group's multiplier (`encodings.kv_head_multiplier`)."""
  if num_heads is not None:
    multiplier = encodings.kv_head_multiplier(multiplier, num_heads, x.shape[2])
  return encodings.apply_rope(x, x_positions, base=base, multiplier=multiplier, layout=layout,
                              frequencies=frequencies)


def _pope_cartesian_qk(q, k, delta, *, base, masking: _Masking, multiplier):
  """(q' [B, T, N, 2H], k' [B, S, K, 2H]) float32, PoPE's Cartesian maps (`pope_map`)."""
  return (pope_map(q, masking.q_positions, base=base, delta=delta, multiplier=multiplier),
          pope_map(k, masking.k_positions, base=base, multiplier=multiplier,
                   num_heads=q.shape[2]))


def _pope_xla(q, k, v, delta, *, base, masking, scale, multiplier, block_sizes,
              dropout_rate=0.0, dropout_rng=None):
  del block_sizes  # None (`_check_block_sizes`).
  qc, kc = _pope_cartesian_qk(q, k, delta, base=base, masking=masking, multiplier=multiplier)
  return dot_product_attention_reference(qc, kc, v, scale=scale, mask=masking.dense(),
                                         dropout_rate=dropout_rate, dropout_rng=dropout_rng)


def _pope_cudnn(q, k, v, delta, *, base, masking, scale, multiplier, block_sizes):
  del block_sizes  # None (`_check_block_sizes`).
  qc, kc = _pope_cartesian_qk(q, k, delta, base=base, masking=masking, multiplier=multiplier)
  return _cudnn_attention(qc.astype(q.dtype), kc.astype(q.dtype), v, masking=masking,
                          scale=scale)


def _pope_pallas(q, k, v, delta, *, base, masking, scale, multiplier, block_sizes):
  if _is_decode(q, k):
    qc, kc = _pope_cartesian_qk(q, k, delta, base=base, masking=masking, multiplier=multiplier)
    return _decode_pallas(qc.astype(q.dtype), kc.astype(k.dtype), v, scale=scale,
                          masking=masking)
  from pallas_kernels import pope_attention as kernel  # Lazy: GPU-only dependency chain.
  with jax.ensure_compile_time_eval():  # concrete θ: the kernel's tables stay trace-time constants
    freqs = encodings.scale_frequencies(encodings.pope_frequencies(q.shape[-1], base),
                                        multiplier)           # [H], or [N, H] per query head
  return kernel.pope_attention(
      q, k, v, None if delta is None else encodings.clamp_phase_bias(delta), frequencies=freqs,
      is_causal=masking.is_causal, q_positions=masking.q_positions,
      k_positions=masking.k_positions, key_mask=masking.key_mask,
      q_segment_ids=masking.q_segment_ids, kv_segment_ids=masking.kv_segment_ids, scale=scale,
      block_sizes=block_sizes, cartesian_map=encodings.polar_to_cartesian)


# `jax.nn.dot_product_attention` backend of implementation="cudnn" (tests swap in "xla" on CPU).
CUDNN_BACKEND = "cudnn"


def _cudnn_width(qk_width: int, value_width: int) -> int:
  """The one head width cuDNN sees: max(q/k, value) rounded up to a multiple of 8."""
  return -(-max(qk_width, value_width) // 8) * 8


def _pad_width(x: Array, width: int) -> Array:
  return x if x.shape[-1] == width else jnp.pad(
      x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _cudnn_attention(q, k, v, *, masking: _Masking, scale: float) -> Array:
  """Softmax attention of mapped q [B, T, N, W], k [B, S, K, W] and v [B, S, K, V] through
  `jax.nn.dot_product_attention(implementation=CUDNN_BACKEND)`, masked as `masking` says.

  Returns [B, T, N, V] in q's dtype, zero rows where no key is visible."""
  t, s, vd = q.shape[1], k.shape[1], v.shape[-1]
  width = _cudnn_width(q.shape[-1], vd)
  q, k, v = (_pad_width(x, width) for x in (q, k, v))  # zeros change no score, no output column
  if masking.default and (masking.is_causal or masking.local_window is None):
    # Default positions with T == S: cuDNN's top-left causal mask and window are exact.
    window = None if masking.local_window is None else (masking.local_window - 1, 0)
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=masking.is_causal,
                                       local_window_size=window, implementation=CUDNN_BACKEND)
  elif (mask := masking.dense()) is None:
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=CUDNN_BACKEND)
  else:
    mask = jnp.broadcast_to(mask, (mask.shape[0], t, s))                      # [B|1, T, S]
    out = _cudnn_masked(q, k, v, mask[:, None], scale)
    out = jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], out, 0)
  return out[..., :vd]


def _cudnn_call(q, k, v, mask, scale):
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale,
                                      implementation=CUDNN_BACKEND)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cudnn_masked(q, k, v, mask, scale):
  """cuDNN attention with a boolean mask [B|1, 1, T, S]; differentiable at any T and S."""
  return _cudnn_call(q, k, v, mask, scale)


def _cudnn_even(q, k, v, mask, scale):
  """`_cudnn_call` at even T and S (cuDNN's backward with a bias needs them): a query row and a
  key that nothing sees are padded on where T or S is odd, the row sliced off."""
  pt, ps = q.shape[1] % 2, k.shape[1] % 2
  if pt or ps:
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))
    q, k, v = pad(q, pt), pad(k, ps), pad(v, ps)
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pt), (0, ps)))
  return _cudnn_call(q, k, v, mask, scale)[:, :q.shape[1] - pt]


def _cudnn_masked_fwd(q, k, v, mask, scale):
  out, vjp = jax.vjp(lambda q, k, v: _cudnn_even(q, k, v, mask, scale), q, k, v)
  return out, vjp


def _cudnn_masked_bwd(scale, vjp, d_out):
  del scale
  return (*vjp(d_out), None)


_cudnn_masked.defvjp(_cudnn_masked_fwd, _cudnn_masked_bwd)


def _gpu_capability() -> tuple[str, int]:
  """(platform, compute-capability major) of the default device; major 0 off NVIDIA GPUs."""
  device = jax.devices()[0]
  try:
    major = int(str(getattr(device, "compute_capability", "0")).split(".")[0])
  except ValueError:
    major = 0
  return device.platform, major


def _cudnn_why_not(q, k, v, *, qk_width: int) -> str | None:
  """Why cuDNN flash attention cannot run mapped q, k (`qk_width` wide) with v here, or None."""
  platform, major = _gpu_capability()
  if platform != "gpu" or major < 8:
    return f"cuDNN flash attention needs an NVIDIA GPU of sm80 or newer, not {platform!r}"
  dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if not (jnp.dtype(q.dtype) in dtypes and k.dtype == q.dtype and v.dtype == q.dtype):
    return (f"cuDNN flash attention takes one bf16/fp16 dtype for query, key and value; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}")
  width, limit = _cudnn_width(qk_width, v.shape[-1]), 256 if major >= 9 else 128
  if width > limit:
    return (f"cuDNN flash attention takes head widths up to {limit} on sm{major}x (256 from "
            f"sm90); here q/k are {qk_width} and value {v.shape[-1]} wide")
  return None


def _is_decode(q: Array, k: Array) -> bool:
  """Whether a call is decoding: T <= 16 new queries against S > T keys (`pallas_kernels.
  decode_attention`)."""
  return q.shape[1] <= 16 and q.shape[1] < k.shape[1]


def _decode_why_not(implementation, q, k, v) -> str | None:
  """Why `implementation` cannot run plain attention of mapped q, k over a cache, or None."""
  if implementation == "cudnn":
    return _cudnn_why_not(q, k, v, qk_width=q.shape[-1])
  if implementation == "pallas":
    from pallas_kernels import decode_attention as kernel  # Lazy: GPU-only dependency chain.
    return kernel.unsupported_reason(q, k, v) or kernel.platform_reason()
  return None


def _decode_pallas(q, k, v, *, scale, masking: _Masking) -> Array:
  """The split-K decoding kernel on mapped q, k with the call's key_mask and, when causal, its
  positions (segment ids and windows are refused by the why_nots)."""
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  key_mask = jnp.ones((b, s), bool) if masking.key_mask is None else masking.key_mask
  q_pos = k_pos = None
  if masking.is_causal:
    q_pos = jnp.broadcast_to(jnp.asarray(masking.q_positions, jnp.int32), (b, t))
    k_pos = jnp.broadcast_to(jnp.asarray(masking.k_positions, jnp.int32), (b, s))
  return _decode_kernel(q, k, v, key_mask, q_pos, k_pos, scale)


def _decode_reference(q, k, v, key_mask, q_pos, k_pos, scale):
  mask = (key_mask[:, None, :] if q_pos is None else positions.attention_mask(
      q_pos, k_pos, is_causal=True, k_valid=key_mask))
  return dot_product_attention_reference(q, k, v, scale=scale, mask=mask).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _decode_kernel(q, k, v, key_mask, q_pos, k_pos, scale):
  """`pallas_kernels.decode_attention`, forward only; its VJP is the reference's ([B, N, T, S]
  scores, small at T <= 16), so a decoding call can still be differentiated."""
  from pallas_kernels import decode_attention as kernel  # Lazy: GPU-only dependency chain.
  return kernel.decode_attention(q, k, v, scale=scale, key_mask=key_mask, q_positions=q_pos,
                                 k_positions=k_pos)


def _decode_kernel_fwd(q, k, v, key_mask, q_pos, k_pos, scale):
  return _decode_kernel(q, k, v, key_mask, q_pos, k_pos, scale), (q, k, v, key_mask, q_pos, k_pos)


def _decode_kernel_bwd(scale, res, d_out):
  q, k, v, key_mask, q_pos, k_pos = res
  _, vjp = jax.vjp(lambda q, k, v: _decode_reference(q, k, v, key_mask, q_pos, k_pos, scale),
                   q, k, v)
  return (*vjp(d_out), None, None, None)


_decode_kernel.defvjp(_decode_kernel_fwd, _decode_kernel_bwd)


def _mapped_shape(x: Array, width: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape[:-1] + (width,), x.dtype)


def _pope_why_not(implementation, q, k, v, *, segment_ids, dropout_rate=0.0) -> str | None:
  """Why PoPE `implementation` cannot run these inputs here, or None if it can."""
  if implementation != "xla" and dropout_rate > 0.0:
    return _DROPOUT_XLA_ONLY
  if implementation == "cudnn":
    return _cudnn_why_not(q, k, v, qk_width=2 * q.shape[-1])
  if implementation == "pallas" and _is_decode(q, k):
    if segment_ids:
      return "the pallas decoding kernel takes no segment ids; use implementation='cudnn' or 'xla'"
    h2 = 2 * q.shape[-1]
    return _decode_why_not("pallas", _mapped_shape(q, h2), _mapped_shape(k, h2), v)
  if implementation == "pallas":
    from pallas_kernels import pope_attention as kernel  # Lazy: GPU-only dependency chain.
    return kernel.unsupported_reason(q, k, v) or kernel.platform_reason()
  return None


def _rope_why_not(implementation, q, k, v, *, local_window, segment_ids,
                  dropout_rate=0.0) -> str | None:
  """Why RoPE `implementation` cannot run these inputs here, or None if it can."""
  if implementation != "xla" and dropout_rate > 0.0:
    return _DROPOUT_XLA_ONLY
  if implementation == "pallas":
    if not _is_decode(q, k) or local_window is not None or segment_ids:
      return ("the pallas RoPE path is the decoding kernel (T <= 16 queries, S > T keys, no "
              "local_window or segment ids); use implementation='cudnn' or 'xla'")
    return _decode_why_not("pallas", q, k, v)
  if implementation == "cudnn":
    return _cudnn_why_not(q, k, v, qk_width=q.shape[-1])
  return None


def _choose(op: str, implementation, why_not, *args, **kw) -> str:
  """The implementation to run: the named one if it can (else NotImplementedError with the
  reason), or with None the first of ORDER that can."""
  check_implementation(implementation, f"{op} implementation")
  if implementation is None:
    return next(name for name in ORDER if why_not(name, *args, **kw) is None)
  reason = why_not(implementation, *args, **kw)
  if reason is not None:
    raise NotImplementedError(f"{op} implementation={implementation!r}: {reason}")
  return implementation


def _check_block_sizes(block_sizes, implementation) -> None:
  """Raises ValueError unless block_sizes is None, or a `BlockSizes` with "pallas" named."""
  if block_sizes is None:
    return
  if implementation != "pallas":
    raise ValueError(f"block_sizes configures implementation='pallas' only; got "
                     f"implementation={implementation!r}")
  from pallas_kernels.pope_attention_config import BlockSizes  # imports only jax
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a pallas_kernels.pope_attention_config.BlockSizes, "
                     f"got {type(block_sizes).__name__}")


POPE_IMPLEMENTATIONS: dict[str, Callable[..., Array]] = {
    "xla": _pope_xla, "cudnn": _pope_cudnn, "pallas": _pope_pallas}


def pope_attention(
    query: Array,
    key: Array,
    value: Array,
    delta: Array | None = None,
    *,
    base: float = 10000.0,
    is_causal: bool = False,
    q_positions: Array | None = None,
    k_positions: Array | None = None,
    scale: float | None = None,
    multiplier: Array | float | None = None,
    key_mask: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    implementation: str | None = None,
    block_sizes=None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
) -> Array:
  """PoPE attention: a_ts = Σ_c softplus(q_tc) softplus(k_sc) cos((s - t)θ_c + δ_c) (PoPE Eq. 5/6).

  Args:
    query: [B, T, N, H] raw query projections (before softplus).
    key: [B, S, K, H] raw key projections; N % K == 0 (GQA).
    value: [B, S, K, V].
    delta: None (no phase bias) or [N, H] float phase bias δ, clamped to [-2π, 0]; one row per
      query head, also under GQA.
    base: frequency base, θ_c = base^(-(c-1)/H).
    is_causal: causal mask by absolute position (`pope_jax.positions`): key s visible to query t
      iff k_pos[s] <= q_pos[t]. With the default positions the queries are bottom-right aligned
      (S - T + arange(T)), as in FlashAttention: for T > S the first T - S rows see no key and
      are zero.
    q_positions, k_positions: [T] / [S] or [B, T] / [B, S] int; defaults in `pope_jax.positions`.
      For implementation="pallas", concrete positions (the defaults, numpy arrays, int lists,
      jax arrays closed over by the caller's jit) give the kernel's position tables at trace
      time; traced ones (jit arguments, `jnp.arange` inside jit) add small XLA ops per call.
    scale: logit scale; default 1/sqrt(H) of the original head dim (not 2H).
    multiplier: None, scalar or [N] frequency multiplier (per-layer scaling, PI); under GQA the
      query heads of a group must share one value (see `encodings.kv_head_multiplier`).
    key_mask: None or [B, S] bool, False for padding keys (left-padded batches).
    q_segment_ids, kv_segment_ids: None, or both, [B, T] and [B, S] int (packed documents; the
      same array twice for self-attention): query t sees key s only if their ids are equal (and,
      with is_causal, k_pos[s] <= q_pos[t]).
    implementation: None or one of IMPLEMENTATIONS (see the module docstring).
    block_sizes: None (the tuned defaults) or a `pallas_kernels.pope_attention_config.BlockSizes`,
      with implementation="pallas" only.
    dropout_rate, dropout_rng: dropout on the attention probabilities (training; see
      `dot_product_attention_reference`); xla only, None then picks it.

  Returns:
    [B, T, N, V] in the query's dtype.

  Raises:
    ValueError: mismatched shapes, positions or segment ids, unknown implementation, block_sizes
    without implementation="pallas"; concrete δ not finite, multipliers not finite and > 0, or
    int64 positions outside int32 (traced values are not checked). NotImplementedError: a named
    implementation that cannot run these inputs (never a silent fallback).
  """
  _check_qkv(query, key, value)
  _check_multiplier(multiplier, query)
  delta = None if delta is None else _check_delta(delta, query)
  _check_block_sizes(block_sizes, implementation)
  _check_dropout(dropout_rate, dropout_rng)
  implementation = _choose("pope_attention", implementation, _pope_why_not, query, key, value,
                           segment_ids=q_segment_ids is not None or kv_segment_ids is not None,
                           dropout_rate=dropout_rate)
  masking = _masking(query, key, is_causal=is_causal, q_positions=q_positions,
                     k_positions=k_positions, key_mask=key_mask, q_segment_ids=q_segment_ids,
                     kv_segment_ids=kv_segment_ids, keep_numpy=implementation == "pallas")
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  dropout = {} if dropout_rate == 0.0 else {"dropout_rate": dropout_rate,
                                            "dropout_rng": dropout_rng}
  out = POPE_IMPLEMENTATIONS[implementation](
      query, key, value, delta, base=base, masking=masking, scale=scale, multiplier=multiplier,
      block_sizes=block_sizes, **dropout)
  return out.astype(query.dtype)


def rope_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    base: float = 10000.0,
    is_causal: bool = False,
    q_positions: Array | None = None,
    k_positions: Array | None = None,
    scale: float | None = None,
    multiplier: Array | float | None = None,
    layout: encodings.RopeLayout = "half",
    frequencies: Array | None = None,
    key_mask: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    local_window: int | None = None,
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
) -> Array:
  """RoPE attention (RoFormer Eq. 16): rotate q and k by position·θ, then softmax attention.

  Serves the Llama family: per-row positions, left-padding key_mask, pre-computed (scaled)
  frequencies, per-head multipliers, GQA, T < S (KV cache), packed documents and a sliding
  window.

  Args:
    query: [B, T, N, H]; key: [B, S, K, H] un-rotated; value: [B, S, K, V]; H even, N % K == 0.
    base, multiplier, layout, frequencies: see `encodings.apply_rope`.
    is_causal, q_positions, k_positions, scale, key_mask, q_segment_ids, kv_segment_ids: as in
      `pope_attention` (scale default 1/sqrt(H); default positions bottom-right aligned, also
      for T > S).
    local_window: None, or W: query t sees only keys with q_pos[t] - k_pos[s] < W (Mistral /
      Qwen2 `sliding_window`; `pope_jax.positions.attention_mask`).
    implementation: None or one of IMPLEMENTATIONS (see the module docstring). "cudnn" rotates
      first, so positions and multipliers never reach cuDNN; any mask does. "pallas" runs
      decoding (T <= 16, S > T, no local_window or segment ids) on Hopper.
    dropout_rate, dropout_rng: dropout on the attention probabilities (training; see
      `dot_product_attention_reference`); xla only, None then picks it.

  Returns:
    [B, T, N, V] in the query's dtype.

  Raises:
    ValueError: mismatched shapes, positions or segment ids, odd head dim, bad local_window or
    unknown implementation; concrete multipliers not finite and > 0, or int64 positions outside
    int32. NotImplementedError: a named implementation that cannot run these inputs, saying why.
  """
  _check_qkv(query, key, value)
  _check_multiplier(multiplier, query)
  positions.check_local_window(local_window)
  _check_dropout(dropout_rate, dropout_rng)
  implementation = _choose("rope_attention", implementation, _rope_why_not, query, key, value,
                           local_window=local_window,
                           segment_ids=q_segment_ids is not None or kv_segment_ids is not None,
                           dropout_rate=dropout_rate)
  masking = _masking(query, key, is_causal=is_causal, q_positions=q_positions,
                     k_positions=k_positions, key_mask=key_mask, q_segment_ids=q_segment_ids,
                     kv_segment_ids=kv_segment_ids, local_window=local_window)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  rope = dict(base=base, layout=layout, frequencies=frequencies, multiplier=multiplier)
  qr = rope_map(query, masking.q_positions, **rope)
  kr = rope_map(key, masking.k_positions, num_heads=query.shape[2], **rope)
  if implementation == "pallas":
    out = _decode_pallas(qr, kr, value, scale=scale, masking=masking)
  elif implementation == "cudnn":
    out = _cudnn_attention(qr, kr, value, masking=masking, scale=scale)
  else:
    out = dot_product_attention_reference(qr, kr, value, scale=scale, mask=masking.dense(),
                                          dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  return out.astype(query.dtype)


def decode_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float,
    key_mask: Array,
    q_positions: Array | None = None,
    k_positions: Array | None = None,
    implementation: str | None = None,
) -> Array:
  """Softmax attention of T new mapped queries over a KV cache of mapped keys (decoding).

  The cache holds the keys already mapped (rotated by RoPE, or PoPE's Cartesian form, `rope_map`
  / `pope_map`), so the step reads each cached key once.

  Args:
    query: [B, T, N, H] mapped queries; key: [B, S, K, H] mapped keys; value: [B, S, K, V].
    scale: the logit scale.
    key_mask: [B, S] bool, True for the cache's valid slots.
    q_positions, k_positions: both None (every valid slot visible), or [B, T] and [B, S] int:
      query t sees slot s iff k_pos[s] <= q_pos[t] (causal by position).
    implementation: None or one of IMPLEMENTATIONS: "pallas" the split-K kernel
      `pallas_kernels.decode_attention` (Hopper, T <= 16, bf16/fp16), "cudnn" cuDNN flash
      attention with the mask as a bias, "xla" `dot_product_attention_reference`.

  Returns:
    [B, T, N, V] in the query's dtype; zero rows where no key is visible.

  Raises:
    ValueError: mismatched shapes, unknown implementation. NotImplementedError: a named
    implementation that cannot run these inputs, saying why.
  """
  _check_qkv(query, key, value)
  if (q_positions is None) != (k_positions is None):
    raise ValueError("decode_attention takes both q_positions and k_positions, or neither")
  implementation = _choose("decode_attention", implementation, _decode_why_not, query, key,
                           value)
  masking = _masking(query, key, is_causal=q_positions is not None, q_positions=q_positions,
                     k_positions=k_positions, key_mask=key_mask, q_segment_ids=None,
                     kv_segment_ids=None)
  if implementation == "pallas":
    out = _decode_pallas(query, key, value, scale=scale, masking=masking)
  elif implementation == "cudnn":
    out = _cudnn_attention(query, key, value, masking=masking, scale=scale)
  else:
    out = dot_product_attention_reference(query, key, value, scale=scale, mask=masking.dense())
  return out.astype(query.dtype)
