"""Positions and masks of every attention path: defaults, checks, and the boolean mask.

Causal masking is by absolute position: key s is visible to query t iff k_pos[s] <= q_pos[t];
with a `local_window` W also q_pos[t] - k_pos[s] < W (the last W positions, Mistral / Qwen2
`sliding_window`); with segment ids also q_segment_ids[t] == kv_segment_ids[s] (packed
documents). Positions default to arange(S) for keys and S - T + arange(T) for queries:
bottom-right aligned, as FlashAttention and PyTorch align causal masks. With T < S the queries
are the last T positions (as KV-cache decoding needs); with T > S the first T - S queries sit at
negative positions and, causally, see no key (their rows are zero).

Shape letters: B batch, T query length, S key length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pope_jax import checks

Array = jax.Array


def default_positions(q_len: int, k_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Default (q_positions [T], k_positions [S]) int32: S - T + arange(T) and arange(S), the
  queries bottom-right aligned (for T > S the first T - S are negative).

  numpy arrays, so they stay concrete under `jax.jit`: the fused kernel then derives its
  position tables at trace time, not in every call. (Unlike jax arrays they have no `.at`;
  `jnp.asarray` makes them jax arrays.)"""
  return (np.arange(q_len, dtype=np.int32) + (k_len - q_len),
          np.arange(k_len, dtype=np.int32))


def check_int32_range(positions, name: str = "positions") -> None:
  """Raises ValueError naming `name` if concrete integer positions lie outside int32.

  Positions are int32 inside every attention path; a wider integer array (int64, uint32) with a
  value outside [-2**31, 2**31) would wrap silently when converted. Negative positions are
  allowed (they are ordinary relative offsets). Traced positions are not checked (they are int32
  already unless x64 is on)."""
  if isinstance(positions, jax.core.Tracer):
    return
  dtype = positions.dtype if isinstance(positions, (jax.Array, np.ndarray)) else None
  if dtype is not None and (not np.issubdtype(dtype, np.integer)
                            or np.can_cast(dtype, np.int32)):
    return  # Fits by its dtype; float positions are refused by `check_positions`.
  values = checks.concrete(positions)
  if values is None or values.dtype == object or not np.issubdtype(values.dtype, np.integer):
    return
  info = np.iinfo(np.int32)
  outside = (values < info.min) | (values > info.max)
  if np.any(outside):
    index = tuple(int(i) for i in np.argwhere(outside)[0])
    raise ValueError(f"{name} must lie inside int32 [{info.min}, {info.max}], got "
                     f"{int(values[index])} at index {index}")


def as_positions(positions, *, keep_numpy: bool = False, name: str = "positions"
                 ) -> Array | np.ndarray:
  """Positions as an array: jax arrays (traced or not) as they are; numpy arrays and sequences
  of ints as numpy with `keep_numpy` (concrete under jit, so the fused kernel derives its
  position tables at trace time), else as jax arrays (computed inside the caller's jit, so XLA
  paths do not fold e.g. a [T, S] causal mask into the program as a constant).

  Raises:
    ValueError: concrete positions outside int32 (`check_int32_range`), naming `name`.
  """
  check_int32_range(positions, name)
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


def check_key_mask(key_mask, batch: int, k_len: int) -> Array | None:
  """key_mask as a jax array. Raises ValueError unless it is None or bool [B, S]."""
  if key_mask is None:
    return None
  key_mask = jnp.asarray(key_mask)
  if key_mask.shape != (batch, k_len) or key_mask.dtype != jnp.bool_:
    raise ValueError(f"key_mask must be bool [{batch}, {k_len}], got {key_mask.dtype} "
                     f"{key_mask.shape}")
  return key_mask


def check_local_window(local_window) -> None:
  """Raises ValueError unless local_window is None or a positive int."""
  if local_window is not None and (not isinstance(local_window, (int, np.integer))
                                   or local_window <= 0):
    raise ValueError(f"local_window must be a positive int or None, got {local_window!r}")


def resolve(batch: int, q_len: int, k_len: int, q_positions, k_positions, key_mask, *,
            keep_numpy: bool = False):
  """Positions with their defaults filled in (`as_positions`) and the key mask, checked once.

  Args:
    batch, q_len, k_len: B, T, S.
    q_positions, k_positions: None, [T] / [S] or [B, T] / [B, S] integer positions.
    key_mask: None or [B, S] bool.
    keep_numpy: keep concrete positions as numpy (for the fused kernel's trace-time tables).

  Returns:
    (q_positions, k_positions, key_mask).

  Raises:
    ValueError: positions or key_mask of the wrong shape, concrete positions outside int32.
    TypeError: non-integer positions.
  """
  dq, dk = default_positions(q_len, k_len)
  q_pos = as_positions(dq if q_positions is None else q_positions, keep_numpy=keep_numpy,
                       name="q_positions")
  k_pos = as_positions(dk if k_positions is None else k_positions, keep_numpy=keep_numpy,
                       name="k_positions")
  check_positions(q_pos, k_pos, batch, q_len, k_len)
  return q_pos, k_pos, check_key_mask(key_mask, batch, k_len)


def check_segment_ids(q_segment_ids, kv_segment_ids, batch: int, q_len: int, k_len: int
                      ) -> tuple[Array | None, Array | None]:
  """Segment ids as jax arrays, or (None, None).

  Raises:
    ValueError: only one of the two given, or not [B, T] / [B, S].
    TypeError: non-integer ids.
  """
  if q_segment_ids is None and kv_segment_ids is None:
    return None, None
  if q_segment_ids is None or kv_segment_ids is None:
    raise ValueError("q_segment_ids and kv_segment_ids go together: pass both (the same array "
                     "for self-attention without a cache) or neither")
  ids = []
  for name, seg, length in (("q_segment_ids", q_segment_ids, q_len),
                            ("kv_segment_ids", kv_segment_ids, k_len)):
    seg = jnp.asarray(seg)
    if seg.shape != (batch, length):
      raise ValueError(f"{name} must have shape [{batch}, {length}], got {seg.shape}")
    if not jnp.issubdtype(seg.dtype, jnp.integer):
      raise TypeError(f"{name} must be integer segment ids, got {seg.dtype}")
    ids.append(seg)
  return ids[0], ids[1]


def attention_mask(
    q_positions: Array, k_positions: Array, *, is_causal: bool, k_valid: Array | None = None,
    local_window: int | None = None, q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
) -> Array | None:
  """Boolean mask: True where query t may attend to key s, or None (all visible).

  Args:
    q_positions: [T] or [B, T] int.
    k_positions: [S] or [B, S] int.
    is_causal: mask keys whose position exceeds the query's.
    k_valid: optional [B, S] bool, False for padding keys.
    local_window: None, or W: mask keys W or more positions before the query.
    q_segment_ids, kv_segment_ids: None, or [B, T] and [B, S] int: a query sees only the keys
      of its own segment (packed documents).

  Returns:
    None or bool broadcastable to [B, T, S]: [B|1, T, S] with `is_causal`, `local_window` or
    segment ids, [B, 1, S] with `k_valid` alone.
  """
  qp = q_positions if q_positions.ndim == 2 else q_positions[None]
  kp = k_positions if k_positions.ndim == 2 else k_positions[None]
  mask = None
  if is_causal:
    mask = kp[:, None, :] <= qp[:, :, None]
  if local_window is not None:
    near = qp[:, :, None] - kp[:, None, :] < local_window
    mask = near if mask is None else mask & near
  if q_segment_ids is not None:
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    mask = same if mask is None else mask & same
  if k_valid is not None:
    valid = k_valid[:, None, :]
    mask = valid if mask is None else mask & valid
  return mask


def padded_positions(attention_mask: Array, offset: Array | int = 0) -> Array:
  """Per-row positions cumsum(mask) − 1 + offset, pads clipped to the row's offset.

  Args:
    attention_mask: [B, T] bool/int, 1 for tokens (left padding).
    offset: [] or [B] int, tokens already seen per row.

  Returns:
    [B, T] int32.
  """
  m = jnp.asarray(attention_mask).astype(jnp.int32)
  pos = jnp.cumsum(m, axis=-1) - 1
  return (jnp.maximum(pos, 0) + jnp.asarray(offset, jnp.int32).reshape(-1, 1)).astype(jnp.int32)
