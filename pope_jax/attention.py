"""Attention with PoPE or RoPE, shaped like `jax.nn.dot_product_attention`.

Public API: `pope_attention`, `rope_attention`, and the reference `dot_product_attention_reference`.
Each op dispatches on `implementation=`: "xla" is the reference (float32 math, materialised
scores); "pallas" (PoPE only) is the fused Mosaic GPU kernel in `pallas_kernels`, imported lazily
so a CPU-only install imports fine; "cudnn" (RoPE only) rotates q and k and calls cuDNN flash
attention through `jax.nn.dot_product_attention`. `implementation=None` picks the fastest correct
path for the platform.

Shape letters: B batch, T query length, S key length, N query heads, K kv heads (N % K == 0),
H q/k head dim, V value head dim.

Causal masking is by absolute position: key s is visible to query t iff k_pos[s] <= q_pos[t].
Positions default to arange(S) for keys and S - T + arange(T) for queries, so with T < S the
queries are the last T positions (bottom-right aligned, as KV-cache decoding needs); with T > S
queries default to arange(T). A query row
with no visible key returns zeros (never NaN) and has finite gradients.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pope_jax import encodings

Array = jax.Array


def default_positions(q_len: int, k_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Default (q_positions [T], k_positions [S]) int32: queries are the last T of S positions.

  numpy arrays, so they stay concrete under `jax.jit`: the fused kernel then derives its
  position tables at trace time (`pallas_kernels.pope_attention`), not in every call. (Unlike
  jax arrays they have no `.at`; `jnp.asarray` makes them jax arrays.)"""
  k_pos = np.arange(k_len, dtype=np.int32)
  return k_pos[k_len - q_len:] if q_len <= k_len else np.arange(q_len, dtype=np.int32), k_pos


def as_positions(positions, *, keep_numpy: bool = False) -> Array | np.ndarray:
  """Positions as an array: jax arrays (traced or not) as they are; numpy arrays and sequences
  of ints as numpy with `keep_numpy` (concrete under jit, so the fused kernel derives its
  position tables at trace time), else as jax arrays (computed inside the caller's jit, so XLA
  paths do not fold e.g. a [T, S] causal mask into the program as a constant)."""
  if not isinstance(positions, (jax.Array, np.ndarray)):
    try:
      positions = np.asarray(positions)
    except jax.errors.TracerArrayConversionError:  # a sequence holding traced values
      return jnp.asarray(positions)
  if isinstance(positions, np.ndarray) and not keep_numpy:
    return jnp.asarray(positions)
  return positions


def check_positions(q_positions, k_positions, batch: int, q_len: int, k_len: int) -> None:
  """Raises ValueError unless q_positions is [T] or [B, T] and k_positions [S] or [B, S], and
  TypeError unless both hold integers (arrays of any kind)."""
  for name, pos, length in (("q_positions", q_positions, q_len),
                            ("k_positions", k_positions, k_len)):
    if pos.ndim not in (1, 2) or pos.shape[-1] != length or (pos.ndim == 2
                                                              and pos.shape[0] != batch):
      raise ValueError(f"{name} must have shape [{length}] or [{batch}, {length}], got "
                       f"{pos.shape}")
    if not jnp.issubdtype(pos.dtype, jnp.integer):
      raise TypeError(f"{name} must be integer positions, got {pos.dtype}")


def attention_mask(
    q_positions: Array, k_positions: Array, *, is_causal: bool, k_valid: Array | None = None
) -> Array | None:
  """Boolean mask [B|1, T, S]: True where query t may attend to key s.

  Args:
    q_positions: [T] or [B, T] int.
    k_positions: [S] or [B, S] int.
    is_causal: mask keys whose position exceeds the query's.
    k_valid: optional [B, S] bool, False for padding keys.
  """
  mask = None
  if is_causal:
    qp = q_positions if q_positions.ndim == 2 else q_positions[None]
    kp = k_positions if k_positions.ndim == 2 else k_positions[None]
    mask = kp[:, None, :] <= qp[:, :, None]
  if k_valid is not None:
    valid = k_valid[:, None, :]
    mask = valid if mask is None else mask & valid
  return mask


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
    q: Array, k: Array, v: Array, *, scale: float, mask: Array | None = None
) -> Array:
  """Softmax attention with materialised scores, float32 inside (the reference for every kernel).

  Args:
    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, V]; N % K == 0 (GQA).
    scale: logit scale.
    mask: None or bool broadcastable to [B, T, S] (True = visible).

  Returns:
    [B, T, N, V] float32. Rows with no visible key are zero.
  """
  _check_qkv(q, k, v)
  b, t, n, _ = q.shape
  kh = k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, q.shape[-1])
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale
  if mask is None:
    probs = jax.nn.softmax(logits, axis=-1)
  else:
    m = jnp.broadcast_to(mask, (b, t, k.shape[1]))[:, None, None]
    probs = jax.nn.softmax(jnp.where(m, logits, -1e30), axis=-1) * m
  out = jnp.einsum("bkgts,bskv->btkgv", probs, v.astype(jnp.float32))
  return out.reshape(b, t, n, v.shape[-1])


def _check_multiplier(multiplier, query: Array) -> None:
  """A multiplier is None, a scalar or one value per query head; concrete values are finite."""
  if multiplier is not None and jnp.ndim(multiplier) and jnp.shape(multiplier) != query.shape[2:3]:
    raise ValueError(f"multiplier must be a scalar or have shape [num_heads] = "
                     f"[{query.shape[2]}] (the query's heads), got {jnp.shape(multiplier)}")
  encodings.check_finite_multipliers(multiplier, "multiplier")


def _positions(q: Array, k: Array, q_positions, k_positions, key_mask, *,
               keep_numpy: bool = False) -> tuple[Array | np.ndarray, Array | np.ndarray]:
  """Positions (defaults filled in, `as_positions`) after checking their and key_mask's shapes
  and dtypes."""
  dq, dk = default_positions(q.shape[1], k.shape[1])
  q_pos = as_positions(dq if q_positions is None else q_positions, keep_numpy=keep_numpy)
  k_pos = as_positions(dk if k_positions is None else k_positions, keep_numpy=keep_numpy)
  b = q.shape[0]
  check_positions(q_pos, k_pos, b, q.shape[1], k.shape[1])
  if key_mask is not None:
    key_mask = jnp.asarray(key_mask)
    if key_mask.shape != (b, k.shape[1]) or key_mask.dtype != jnp.bool_:
      raise ValueError(f"key_mask must be bool [{b}, {k.shape[1]}], got {key_mask.dtype} "
                       f"{key_mask.shape}")
  return q_pos, k_pos


def _pope_xla(q, k, v, delta, *, base, is_causal, q_positions, k_positions, scale, multiplier,
              key_mask):
  mask = attention_mask(q_positions, k_positions, is_causal=is_causal, k_valid=key_mask)
  # δ enters the query phase with opposite sign: cos(sθ - (tθ - δ)) = cos((s - t)θ + δ), the same
  # score as the paper's key-side bias, and it lets every query head of a GQA group keep its own δ.
  q_bias = None if delta is None else -encodings.clamp_phase_bias(_check_delta(delta, q))
  qc = encodings.pope_cartesian(q, q_positions, base=base, phase=q_bias, multiplier=multiplier)
  kmult = encodings.kv_head_multiplier(multiplier, q.shape[2], k.shape[2])
  kc = encodings.pope_cartesian(k, k_positions, base=base, multiplier=kmult)
  return dot_product_attention_reference(qc, kc, v, scale=scale, mask=mask)


def _check_delta(delta: Array, q: Array) -> Array:
  delta = jnp.asarray(delta)
  if delta.shape != q.shape[2:]:
    raise ValueError(
        f"delta must have shape [num_heads, head_dim] = {tuple(q.shape[2:])}, got {delta.shape}")
  if jnp.issubdtype(delta.dtype, jnp.complexfloating):
    raise TypeError(f"delta must be real (phase in radians), got {delta.dtype}")
  return delta.astype(jnp.float32)


def _pope_pallas(q, k, v, delta, *, base, is_causal, q_positions, k_positions, scale, multiplier,
                 key_mask):
  from pallas_kernels import pope_attention as kernel  # Lazy: GPU-only dependency chain.
  if multiplier is not None or key_mask is not None:
    raise NotImplementedError(
        "implementation='pallas' takes neither a frequency multiplier nor a key_mask yet")
  return kernel.pope_attention(
      q, k, v, delta, base=base, is_causal=is_causal, q_positions=q_positions,
      k_positions=k_positions, scale=scale)


POPE_IMPLEMENTATIONS: dict[str, Callable[..., Array]] = {"xla": _pope_xla, "pallas": _pope_pallas}


def _pick_pope_implementation(q: Array, k: Array, v: Array, multiplier, key_mask) -> str:
  """The fused kernel on Hopper GPUs (sm90) for the inputs it supports; else XLA."""
  device = jax.devices()[0]
  if (multiplier is None and key_mask is None and device.platform == "gpu"
      and str(getattr(device, "compute_capability", "")).startswith("9.")):
    from pallas_kernels import pope_attention as kernel  # Lazy: GPU-only dependency chain.
    if kernel.is_supported(q, k, v):
      return "pallas"
  return "xla"


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
    implementation: str | None = None,
) -> Array:
  """PoPE attention: a_ts = Σ_c softplus(q_tc) softplus(k_sc) cos((s - t)θ_c + δ_c) (PoPE Eq. 5/6).

  Args:
    query: [B, T, N, H] raw query projections (before softplus).
    key: [B, S, K, H] raw key projections; N % K == 0 (GQA).
    value: [B, S, K, V].
    delta: None (no phase bias) or [N, H] float phase bias δ, clamped to [-2π, 0]; one row per
      query head, also under GQA.
    base: frequency base, θ_c = base^(-(c-1)/H).
    is_causal: causal mask by absolute position (see module docstring).
    q_positions, k_positions: [T] / [S] or [B, T] / [B, S] int; see module docstring for defaults.
      For implementation="pallas", concrete positions (the defaults, numpy arrays, int lists,
      jax arrays closed over by the caller's jit) give the kernel's position tables at trace
      time; traced ones (jit arguments, `jnp.arange` inside jit) add small XLA ops per call.
    scale: logit scale; default 1/sqrt(H) of the original head dim (not 2H).
    multiplier: None, scalar or [N] frequency multiplier (per-layer scaling, PI); under GQA the
      query heads of a group must share one value (see `encodings.kv_head_multiplier`).
    key_mask: None or [B, S] bool, False for padding keys (left-padded batches).
    implementation: None (best available), "xla" (reference) or "pallas" (fused GPU kernel).

  Returns:
    [B, T, N, V] in the query's dtype.

  Raises:
    ValueError: mismatched shapes or positions. NotImplementedError: a named implementation that
    cannot run these inputs (never a silent fallback).
  """
  _check_qkv(query, key, value)
  _check_multiplier(multiplier, query)
  delta = None if delta is None else jnp.asarray(delta)
  if implementation is None:
    implementation = _pick_pope_implementation(query, key, value, multiplier, key_mask)
  if implementation not in POPE_IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be one of {sorted(POPE_IMPLEMENTATIONS)} or None, got "
        f"{implementation!r}")
  q_pos, k_pos = _positions(query, key, q_positions, k_positions, key_mask,
                            keep_numpy=implementation == "pallas")
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  out = POPE_IMPLEMENTATIONS[implementation](
      query, key, value, delta, base=base, is_causal=is_causal, q_positions=q_pos,
      k_positions=k_pos, scale=scale, multiplier=multiplier, key_mask=key_mask)
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
    implementation: str | None = None,
) -> Array:
  """RoPE attention (RoFormer Eq. 16): rotate q and k by position·θ, then softmax attention.

  Args:
    query: [B, T, N, H]; key: [B, S, K, H]; value: [B, S, K, V]; H even, N % K == 0.
    base, multiplier, layout, frequencies: see `encodings.apply_rope`.
    is_causal, q_positions, k_positions, scale, key_mask: as in `pope_attention` (scale default
      1/sqrt(H)).
    implementation: None (best available: "cudnn" on NVIDIA GPUs (sm80+) for one bf16/fp16
      dtype with default positions, T == S, no key_mask, V == H <= 128; else "xla"), "xla"
      (reference, float32, materialised scores) or "cudnn" (rotate, then cuDNN flash attention
      through `jax.nn.dot_product_attention`; NotImplementedError for inputs it cannot run
      exactly; jax raises RuntimeError where no cuDNN is present).

  Returns:
    [B, T, N, V] in the query's dtype.

  Raises:
    ValueError: mismatched shapes, odd head dim or unknown implementation.
    NotImplementedError: implementation="cudnn" with positions, a key_mask, T != S, or dtypes and
      head dims cuDNN does not take.
  """
  _check_qkv(query, key, value)
  # cuDNN's fused kernel applies its own (top-left) causal mask: exact for default positions with
  # T == S and no key mask; every other case needs the general, position-based mask.
  plain = (q_positions is None and k_positions is None and key_mask is None
           and query.shape[1] == key.shape[1])
  if implementation is None:
    implementation = ("cudnn" if plain and _on_cudnn_gpu() and _cudnn_supports(query, key, value)
                      else "xla")
  if implementation not in ("xla", "cudnn"):
    raise ValueError(f"rope_attention implementation must be None, 'xla' or 'cudnn', got "
                     f"{implementation!r}")
  if implementation == "cudnn" and not (plain and _cudnn_supports(query, key, value)):
    raise NotImplementedError(
        "rope_attention implementation='cudnn' needs default positions, T == S, no key_mask and "
        "one bf16/fp16 dtype for query, key and value with V == H <= 128 (H % 8 == 0); got "
        f"query {query.dtype} {query.shape}, key {key.dtype} {key.shape}, value {value.dtype} "
        f"{value.shape}; use implementation='xla'")
  _check_multiplier(multiplier, query)
  q_pos, k_pos = _positions(query, key, q_positions, k_positions, key_mask)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  rope = dict(base=base, layout=layout, frequencies=frequencies)
  qr = encodings.apply_rope(query, q_pos, multiplier=multiplier, **rope)
  kmult = encodings.kv_head_multiplier(multiplier, query.shape[2], key.shape[2])
  kr = encodings.apply_rope(key, k_pos, multiplier=kmult, **rope)
  if implementation == "cudnn":
    return jax.nn.dot_product_attention(qr, kr, value, scale=scale, is_causal=is_causal,
                                        implementation=CUDNN_BACKEND)
  mask = attention_mask(q_pos, k_pos, is_causal=is_causal, k_valid=key_mask)
  return dot_product_attention_reference(qr, kr, value, scale=scale, mask=mask
                                         ).astype(query.dtype)


# `jax.nn.dot_product_attention` backend of implementation="cudnn" (tests swap in "xla" on CPU).
CUDNN_BACKEND = "cudnn"


def _cudnn_supports(q: Array, k: Array, v: Array) -> bool:
  """Whether cuDNN flash attention takes these operands (one bf16/fp16 dtype, V == H <= 128)."""
  return (q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and v.dtype == q.dtype
          and q.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128)


def _on_cudnn_gpu() -> bool:
  """Whether the default device is an NVIDIA GPU of compute capability >= 8.0 (cuDNN flash)."""
  device = jax.devices()[0]
  try:
    major = int(str(getattr(device, "compute_capability", "0")).split(".")[0])
  except ValueError:
    major = 0
  return device.platform == "gpu" and major >= 8
