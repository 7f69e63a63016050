"""Flax Linen attention layer with a RoPE / PoPE / no-position switch, for use in any model.

Shape letters: B batch, T length, D model width, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pope_jax import attention, encodings, kv_cache, positions as positions_lib
from pope_jax.dtypes import as_jnp_dtype, canonical_dtype

Array = jax.Array


class PositionalAttention(nn.Module):
  """Multi-head (GQA) causal self-attention with RoPE, PoPE or no positional encoding.

  Attributes:
    num_heads, num_kv_heads, head_dim: N, K, H.
    pos_encoding: "rope", "pope" or "none".
    rope_base, pope_base: frequency bases.
    delta_init: PoPE δ init, "uniform" (U(-2π, 0)) or "zeros". δ is a [N, H] float32 parameter
      named "delta", one per layer (PoPE §3), clamped to [-2π, 0] in the forward.
    rope_layout: "half" or "interleaved".
    rope_yarn: None or a `config.YarnConfig`: RoPE uses YaRN frequencies and the logits are
      scaled by attention_factor² (q and k each by the factor, once).
    attention_implementation: None (best available) or one of `attention.IMPLEMENTATIONS`,
      passed to `pope_attention` / `rope_attention` / `decode_attention` as it is: a named
      implementation that cannot run a call raises NotImplementedError saying why.
      pos_encoding "none" always runs the reference.
    kv_cache_keys: "raw" (projections) or "mapped" (RoPE-rotated or PoPE-Cartesian keys, mapped
      once when written; calls with a cache read them through `attention.decode_attention`):
      what a cache's "k" holds (`pope_jax.config.ModelConfig.kv_cache_keys`).
    dtype: compute dtype as JAX users write it (`jnp.bfloat16`, `np.dtype("float32")`, "bf16",
      ...; `pope_jax.dtypes.canonical_dtype`).
    kernel_init, out_kernel_init: initialisers of the q/k/v and output projections (default:
      Flax's LeCun normal).
    dropout_rate: dropout on the attention probabilities when not `deterministic` (a "dropout"
      rng); it runs in the XLA reference attention only.
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  pos_encoding: str = "pope"
  rope_base: float = 10000.0
  pope_base: float = 10000.0
  delta_init: str = "uniform"
  rope_layout: str = "half"
  rope_yarn: object | None = None
  attention_implementation: str | None = None
  kv_cache_keys: str = "raw"
  dtype: Any = jnp.float32
  kernel_init: nn.initializers.Initializer = nn.linear.default_kernel_init
  out_kernel_init: nn.initializers.Initializer = nn.linear.default_kernel_init
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x: Array, *, positions: Array | None = None,
               multiplier: Array | None = None, key_mask: Array | None = None,
               segment_ids: Array | None = None, cache: dict[str, Array] | None = None,
               deterministic: bool = True):
    """Causal self-attention, optionally over a KV cache.

    Args:
      x: [B, T, D].
      positions: [T] or [B, T] int (default arange(T)); [B, T] with a cache.
      multiplier: None, scalar or [N] frequency multiplier for RoPE/PoPE (PI, LPES).
      key_mask: None or [B, T] bool, False for (left) padding tokens (no cache).
      segment_ids: None or [B, T] int: packed documents, a token sees only its own segment's
        tokens (no cache).
      cache: None, or this layer's view of a KV cache (`pope_jax.model.init_cache`): "k", "v"
        [B, S, K, H] of the tokens so far (keys raw or mapped, `kv_cache_keys`); "positions"
        [B, S] int32 and "valid" [B, S] bool, already holding the T new tokens; "index" []
        int32, their first slot.
      deterministic: no attention dropout (pass False with a "dropout" rng to train).

    Returns:
      [B, T, D] in `dtype`; with a cache, (that, (k, v)): the cache's keys and values with the T
      new ones written at index..index+T-1.
    """
    n, kh, h = self.num_heads, self.num_kv_heads, self.head_dim
    attention.check_implementation(self.attention_implementation,
                                   "PositionalAttention.attention_implementation")
    if segment_ids is not None and cache is not None:
      raise ValueError("segment_ids (packed documents) cannot be combined with a KV cache")
    dtype = as_jnp_dtype(canonical_dtype(self.dtype, argument="PositionalAttention.dtype"))
    dense = lambda heads, name: nn.DenseGeneral(
        (heads, h), use_bias=False, dtype=dtype, name=name, kernel_init=self.kernel_init)
    q, k, v = dense(n, "query")(x), dense(kh, "key")(x), dense(kh, "value")(x)  # [B, T, N|K, H]
    if cache is not None and self.kv_cache_keys == "mapped" and self.pos_encoding != "none":
      q, k, scale = self._map(q, k, positions, multiplier)
    # Default positions stay None so the attention ops can use a fused kernel's own causal mask.
    k_positions = positions
    if cache is not None:
      k = kv_cache.write_layer(cache["k"], k, cache["index"])
      v = kv_cache.write_layer(cache["v"], v, cache["index"])
      k_positions, key_mask = cache["positions"], cache["valid"]        # [B, S]
    common = dict(is_causal=True, q_positions=positions, k_positions=k_positions,
                  multiplier=multiplier)
    if key_mask is not None:
      common["key_mask"] = key_mask
    if segment_ids is not None:
      common.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    dropout = {}
    if not deterministic and self.dropout_rate > 0.0:
      dropout = {"dropout_rate": self.dropout_rate, "dropout_rng": self.make_rng("dropout")}
    ka, va = k.astype(dtype), v.astype(dtype)
    if cache is not None and self.kv_cache_keys == "mapped" and self.pos_encoding != "none":
      out = attention.decode_attention(
          q.astype(dtype), ka, va, scale=scale, key_mask=key_mask, q_positions=positions,
          k_positions=k_positions, implementation=self.attention_implementation)
    elif self.pos_encoding == "pope":
      delta = self._delta()
      out = attention.pope_attention(q, ka, va, delta, base=self.pope_base,
                                     implementation=self.attention_implementation, **common,
                                     **dropout)
    elif self.pos_encoding == "rope":
      out = attention.rope_attention(
          q, ka, va, base=self.rope_base, layout=self.rope_layout, **self._rope_args(), **common,
          **dropout, implementation=self.attention_implementation)
    elif self.pos_encoding == "none":
      q_pos = jnp.arange(x.shape[1], dtype=jnp.int32) if positions is None else positions
      k_pos = q_pos if k_positions is None else k_positions
      mask = positions_lib.attention_mask(jnp.asarray(q_pos), jnp.asarray(k_pos),
                                          is_causal=True, k_valid=key_mask,
                                          q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
      out = attention.dot_product_attention_reference(
          q, ka, va, scale=h ** -0.5, mask=mask, **dropout).astype(dtype)
    else:
      raise ValueError(f"pos_encoding must be 'rope', 'pope' or 'none', got {self.pos_encoding!r}")
    out = nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, dtype=dtype,
                          name="out", kernel_init=self.out_kernel_init)(out)
    return out if cache is None else (out, (k, v))

  def _delta(self) -> Array:
    """PoPE's phase bias δ [N, H] float32 (the "delta" parameter)."""
    return self.param("delta", lambda key, shape: encodings.init_phase_bias(
        key, shape, self.delta_init), (self.num_heads, self.head_dim))

  def _rope_args(self) -> dict:
    """RoPE's frequencies and logit scale under YaRN ({} without)."""
    yarn, h = self.rope_yarn, self.head_dim
    if yarn is None:
      return {}
    return {"frequencies": encodings.yarn_frequencies(
                h, self.rope_base, yarn.factor, yarn.original_max_position,
                beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow),
            "scale": encodings.yarn_attention_factor(
                yarn.factor, yarn.attention_factor) ** 2 / math.sqrt(h)}

  def _map(self, q, k, positions, multiplier):
    """(q, k mapped as the attention ops map them, the logit scale): PoPE's Cartesian form
    (`attention.pope_map`) or RoPE's rotation (`attention.rope_map`) at `positions` [B, T]."""
    n = self.num_heads
    if self.pos_encoding == "pope":
      kw = dict(base=self.pope_base, multiplier=multiplier)
      return (attention.pope_map(q, positions, delta=self._delta(), **kw),
              attention.pope_map(k, positions, num_heads=n, **kw), self.head_dim ** -0.5)
    rope = self._rope_args()
    scale = rope.pop("scale", self.head_dim ** -0.5)
    kw = dict(base=self.rope_base, multiplier=multiplier, layout=self.rope_layout, **rope)
    return (attention.rope_map(q, positions, **kw), attention.rope_map(k, positions, num_heads=n,
                                                                      **kw), scale)
