"""Attention with PoPE or RoPE, shaped like `jax.nn.dot_product_attention`.

Public API: `pope_attention`, `rope_attention`, and the reference `dot_product_attention_reference`.
Both ops take one vocabulary, `implementation=`:
  "xla"     the reference (float32 math, materialised scores); runs everything.
  "pallas"  PoPE only: the fused Mosaic GPU kernel in `pallas_kernels` (Hopper), imported lazily
            so a CPU-only install imports fine.
  "cudnn"   RoPE only: rotate q and k, then cuDNN flash attention through
            `jax.nn.dot_product_attention` (NVIDIA GPUs sm80+, plain causal inputs).
  None      the first of ORDER = ("pallas", "cudnn", "xla") that supports the inputs on this
            platform (`_why_not`, the same check a named implementation runs).
A named implementation that cannot run the inputs raises NotImplementedError saying why; an
unknown name raises ValueError; there is no silent fallback.

Shape letters: B batch, T query length, S key length, N query heads, K kv heads (N % K == 0),
H q/k head dim, V value head dim.

Positions, their defaults and masks are those of `pope_jax.positions` (causal by absolute
position, queries bottom-right aligned by default), checked once per call. A query row with no
visible key returns zeros (never NaN) and has finite gradients.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from pope_jax import checks, encodings, positions

Array = jax.Array


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


def _pope_xla(q, k, v, delta, *, base, is_causal, q_positions, k_positions, scale, multiplier,
              key_mask, dropout_rate=0.0, dropout_rng=None):
  mask = positions.attention_mask(q_positions, k_positions, is_causal=is_causal,
                                  k_valid=key_mask)
  # δ enters the query phase with opposite sign: cos(sθ - (tθ - δ)) = cos((s - t)θ + δ), the same
  # score as the paper's key-side bias, and it lets every query head of a GQA group keep its own δ.
  q_bias = None if delta is None else -encodings.clamp_phase_bias(delta)
  qc = encodings.pope_cartesian(q, q_positions, base=base, phase=q_bias, multiplier=multiplier)
  kmult = encodings.kv_head_multiplier(multiplier, q.shape[2], k.shape[2])
  kc = encodings.pope_cartesian(k, k_positions, base=base, multiplier=kmult)
  return dot_product_attention_reference(qc, kc, v, scale=scale, mask=mask,
                                         dropout_rate=dropout_rate, dropout_rng=dropout_rng)


def _check_delta(delta: Array, q: Array) -> Array:
  delta = jnp.asarray(delta)
  if delta.shape != q.shape[2:]:
    raise ValueError(
        f"delta must have shape [num_heads, head_dim] = {tuple(q.shape[2:])}, got {delta.shape}")
  if jnp.issubdtype(delta.dtype, jnp.complexfloating):
    raise TypeError(f"delta must be real (phase in radians), got {delta.dtype}")
  checks.check_finite(delta, "delta")
  return delta.astype(jnp.float32)


def _pope_pallas(q, k, v, delta, *, base, is_causal, q_positions, k_positions, scale, multiplier,
                 key_mask):
  del multiplier, key_mask  # None: `_pope_why_not` refuses them.
  from pallas_kernels import pope_attention as kernel  # Lazy: GPU-only dependency chain.
  with jax.ensure_compile_time_eval():  # concrete θ: the kernel's tables stay trace-time constants
    freqs = encodings.pope_frequencies(q.shape[-1], base)
  return kernel.pope_attention(
      q, k, v, None if delta is None else encodings.clamp_phase_bias(delta), frequencies=freqs,
      is_causal=is_causal, q_positions=q_positions, k_positions=k_positions, scale=scale,
      cartesian_map=encodings.polar_to_cartesian)


# The order in which implementation=None tries the implementations (first that runs wins).
ORDER = ("pallas", "cudnn", "xla")


def _gpu_capability() -> tuple[str, int]:
  """(platform, compute-capability major) of the default device; major 0 off NVIDIA GPUs."""
  device = jax.devices()[0]
  try:
    major = int(str(getattr(device, "compute_capability", "0")).split(".")[0])
  except ValueError:
    major = 0
  return device.platform, major


def _pope_why_not(implementation, q, k, v, *, multiplier, key_mask, dropout_rate=0.0,
                  **_) -> str | None:
  """Why PoPE `implementation` cannot run these inputs here, or None if it can."""
  if implementation != "xla" and dropout_rate > 0.0:
    return _DROPOUT_XLA_ONLY
  if implementation == "cudnn":
    return "cuDNN has no PoPE score; use implementation='pallas' (Hopper GPUs) or 'xla'"
  if implementation == "pallas":
    if multiplier is not None or key_mask is not None:
      return "the pallas kernel takes neither a frequency multiplier nor a key_mask yet"
    from pallas_kernels import pope_attention as kernel  # Lazy: GPU-only dependency chain.
    return kernel.unsupported_reason(q, k, v) or kernel.platform_reason()
  return None


def _rope_why_not(implementation, q, k, v, *, plain, local_window, dropout_rate=0.0,
                  **_) -> str | None:
  """Why RoPE `implementation` cannot run these inputs here, or None if it can."""
  if implementation != "xla" and dropout_rate > 0.0:
    return _DROPOUT_XLA_ONLY
  if implementation == "pallas":
    return "there is no RoPE kernel in pallas_kernels; use implementation='cudnn' or 'xla'"
  if implementation == "cudnn":
    platform, major = _gpu_capability()
    if platform != "gpu" or major < 8:
      return f"cuDNN flash attention needs an NVIDIA GPU of sm80 or newer, not {platform!r}"
    if not (plain and local_window is None and _cudnn_supports(q, k, v)):
      return ("cuDNN needs default positions, T == S, no key_mask or local_window and one "
              "bf16/fp16 dtype for query, key and value with V == H <= 128 (H % 8 == 0); got "
              f"query {q.dtype} {q.shape}, key {k.dtype} {k.shape}, value {v.dtype} {v.shape}")
  return None


def _choose(op: str, implementation, why_not, *args, **kw) -> str:
  """The implementation to run: the named one if it can (else NotImplementedError with the
  reason), or with None the first of ORDER that can."""
  if implementation is None:
    return next(name for name in ORDER if why_not(name, *args, **kw) is None)
  if implementation not in ORDER:
    raise ValueError(f"{op} implementation must be one of {ORDER} or None, got "
                     f"{implementation!r}")
  reason = why_not(implementation, *args, **kw)
  if reason is not None:
    raise NotImplementedError(f"{op} implementation={implementation!r}: {reason}")
  return implementation


POPE_IMPLEMENTATIONS: dict[str, Callable[..., Array]] = {"xla": _pope_xla, "pallas": _pope_pallas}


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
    is_causal: causal mask by absolute position (`pope_jax.positions`).
    q_positions, k_positions: [T] / [S] or [B, T] / [B, S] int; defaults in `pope_jax.positions`.
      For implementation="pallas", concrete positions (the defaults, numpy arrays, int lists,
      jax arrays closed over by the caller's jit) give the kernel's position tables at trace
      time; traced ones (jit arguments, `jnp.arange` inside jit) add small XLA ops per call.
    scale: logit scale; default 1/sqrt(H) of the original head dim (not 2H).
    multiplier: None, scalar or [N] frequency multiplier (per-layer scaling, PI); under GQA the
      query heads of a group must share one value (see `encodings.kv_head_multiplier`).
    key_mask: None or [B, S] bool, False for padding keys (left-padded batches).
    implementation: None, "xla" or "pallas" (see the module docstring; "cudnn" raises).
    dropout_rate, dropout_rng: dropout on the attention probabilities (training; see
      `dot_product_attention_reference`); xla only, None then picks it.

  Returns:
    [B, T, N, V] in the query's dtype.

  Raises:
    ValueError: mismatched shapes or positions, unknown implementation; concrete δ not finite,
    multipliers not finite and > 0, or int64 positions outside int32 (traced values are not
    checked). NotImplementedError: a named implementation that cannot run these inputs (never a
    silent fallback).
  """
  _check_qkv(query, key, value)
  _check_multiplier(multiplier, query)
  delta = None if delta is None else _check_delta(delta, query)
  _check_dropout(dropout_rate, dropout_rng)
  implementation = _choose("pope_attention", implementation, _pope_why_not, query, key, value,
                           multiplier=multiplier, key_mask=key_mask, dropout_rate=dropout_rate)
  dropout = ({} if dropout_rate == 0.0 else
             {"dropout_rate": dropout_rate, "dropout_rng": dropout_rng})
  q_pos, k_pos, key_mask = positions.resolve(
      query.shape[0], query.shape[1], key.shape[1], q_positions, k_positions, key_mask,
      keep_numpy=implementation == "pallas")
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  out = POPE_IMPLEMENTATIONS[implementation](
      query, key, value, delta, base=base, is_causal=is_causal, q_positions=q_pos,
      k_positions=k_pos, scale=scale, multiplier=multiplier, key_mask=key_mask, **dropout)
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
    local_window: int | None = None,
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
) -> Array:
  """RoPE attention (RoFormer Eq. 16): rotate q and k by position·θ, then softmax attention.

  Serves the Llama family: per-row positions, left-padding key_mask, pre-computed (scaled)
  frequencies, per-head multipliers, GQA, T < S (KV cache) and a sliding window.

  Args:
    query: [B, T, N, H]; key: [B, S, K, H] un-rotated; value: [B, S, K, V]; H even, N % K == 0.
    base, multiplier, layout, frequencies: see `encodings.apply_rope`.
    is_causal, q_positions, k_positions, scale, key_mask: as in `pope_attention` (scale default
      1/sqrt(H)).
    local_window: None, or W: query t sees only keys with q_pos[t] - k_pos[s] < W (Mistral /
      Qwen2 `sliding_window`; `pope_jax.positions.attention_mask`).
    implementation: None, "xla" or "cudnn" (see the module docstring; "pallas" raises). "cudnn"
      runs default positions with T == S, no key_mask or local_window, one bf16/fp16 dtype and
      V == H <= 128, on NVIDIA GPUs sm80+ (cuDNN's own top-left causal mask is exact there).
    dropout_rate, dropout_rng: dropout on the attention probabilities (training; see
      `dot_product_attention_reference`); xla only, None then picks it.

  Returns:
    [B, T, N, V] in the query's dtype.

  Raises:
    ValueError: mismatched shapes, odd head dim, bad local_window or unknown implementation;
    concrete multipliers not finite and > 0, or int64 positions outside int32.
    NotImplementedError: a named implementation that cannot run these inputs, saying why.
  """
  _check_qkv(query, key, value)
  _check_multiplier(multiplier, query)
  positions.check_local_window(local_window)
  _check_dropout(dropout_rate, dropout_rng)
  plain = (q_positions is None and k_positions is None and key_mask is None
           and query.shape[1] == key.shape[1])
  implementation = _choose("rope_attention", implementation, _rope_why_not, query, key, value,
                           plain=plain, local_window=local_window, dropout_rate=dropout_rate)
  q_pos, k_pos, key_mask = positions.resolve(
      query.shape[0], query.shape[1], key.shape[1], q_positions, k_positions, key_mask)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  rope = dict(base=base, layout=layout, frequencies=frequencies)
  qr = encodings.apply_rope(query, q_pos, multiplier=multiplier, **rope)
  kmult = encodings.kv_head_multiplier(multiplier, query.shape[2], key.shape[2])
  kr = encodings.apply_rope(key, k_pos, multiplier=kmult, **rope)
  if implementation == "cudnn":
    return jax.nn.dot_product_attention(qr, kr, value, scale=scale, is_causal=is_causal,
                                        implementation=CUDNN_BACKEND)
  mask = positions.attention_mask(q_pos, k_pos, is_causal=is_causal, k_valid=key_mask,
                                  local_window=local_window)
  return dot_product_attention_reference(qr, kr, value, scale=scale, mask=mask,
                                         dropout_rate=dropout_rate, dropout_rng=dropout_rng
                                         ).astype(query.dtype)


# `jax.nn.dot_product_attention` backend of implementation="cudnn" (tests swap in "xla" on CPU).
CUDNN_BACKEND = "cudnn"


def _cudnn_supports(q: Array, k: Array, v: Array) -> bool:
  """Whether cuDNN flash attention takes these operands (one bf16/fp16 dtype, V == H <= 128)."""
  return (q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and v.dtype == q.dtype
          and q.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128)
