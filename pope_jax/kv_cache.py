"""The KV cache both models share (`pope_jax.Transformer`, `lpes_jax.Llama`): layout and writes.

Per layer the raw key and value projections [B, S, K, H] (before RoPE / PoPE), with each slot's
position and validity. A call with T new tokens writes them at slots index..index+T-1
(`write_slots` once per call for positions and validity, `write_layer` per layer for k and v);
unwritten slots are masked, whatever they hold.

Shape letters: B batch, T new tokens, S cache length, K kv heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pope_jax.positions import padded_positions

Array = jax.Array


def empty_kv_cache(num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                   dtype) -> dict:
  """An empty cache of `max_len` slots per row.

  Returns:
    dict: "k", "v": tuples of L arrays [B, S, K, H] of zeros in `dtype`; "positions": [B, S]
    int32; "valid": [B, S] bool, all False; "index": [] int32, the number of slots written.
  """
  shape = (batch, max_len, kv_heads, head_dim)
  return {
      "k": tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
      "v": tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
      "positions": jnp.zeros((batch, max_len), jnp.int32),
      "valid": jnp.zeros((batch, max_len), bool),
      "index": jnp.zeros((), jnp.int32),
  }


def write_slots(cache: dict, mask: Array, positions: Array | None) -> tuple[dict, Array]:
  """Positions and validity of T new tokens written at slots index..index+T-1.

  Args:
    cache: a cache from `empty_kv_cache` (or returned by a model).
    mask: [B, T] bool, False for (left) padding.
    positions: None, or [T] / [B, T] int positions of the new tokens; default
      `padded_positions(mask, valid slots so far)`, continuing each row after its tokens.

  Returns:
    ({"positions": [B, S] int32, "valid": [B, S] bool, "index": [] int32, the first new slot},
    the new tokens' positions [B, T] int32).

  Raises:
    ValueError: the T tokens do not fit the free slots (checked against the written slots when
      the index is concrete, else against the cache length).
  """
  t = mask.shape[1]
  max_len, index = cache["positions"].shape[1], cache["index"]
  try:
    free = max_len - int(index)        # Concrete index (eager calls): check the free slots.
  except (TypeError, jax.errors.ConcretizationTypeError):
    free = max_len                     # Traced index: only the cache length is static.
  if t > free:
    raise ValueError(f"{t} new tokens do not fit the KV cache: {free} of its {max_len} slots "
                     f"are free (the cache length limits prompt plus generated tokens)")
  if positions is None:
    positions = padded_positions(mask, jnp.sum(cache["valid"], axis=-1))
  positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), mask.shape)
  keys = {
      "positions": jax.lax.dynamic_update_slice(cache["positions"], positions, (0, index)),
      "valid": jax.lax.dynamic_update_slice(cache["valid"], mask, (0, index)),
      "index": index,
  }
  return keys, positions


def write_layer(cached: Array, new: Array, index: Array) -> Array:
  """One layer's cached keys or values [B, S, K, H] with `new` [B, T, K, H] written at slots
  index..index+T-1, in the cache's dtype."""
  return jax.lax.dynamic_update_slice(cached, new.astype(cached.dtype), (0, index, 0, 0))
