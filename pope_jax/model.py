"""Decoder-only Transformer (pre-norm RMSNorm blocks) with RoPE, PoPE or no positional encoding.

Pure-functional Flax Linen:

    params = model.init(key, tokens)["params"]
    logits = model.apply({"params": params}, tokens)                            # [B, T, V]
    cache = init_cache(config, batch, max_len)
    logits, cache = model.apply({"params": params}, tokens, attention_mask=mask, cache=cache)

KV cache (`init_cache`, laid out as `lpes_jax.llama`'s): per layer the keys and values
[B, S, K, H] in the compute dtype, with each slot's position and validity. The keys are those
`ModelConfig.kv_cache_keys` names: "mapped" (default) as attention reads them, RoPE-rotated or
PoPE's Cartesian form [μ cos(sθ), μ sin(sθ)] ([B, S, K, 2H]: at GPT-2-124M and 8k tokens
302 MB per row in bf16 against 151 MB raw, beside 151 MB of values), mapped once when written,
so a decoding step reads each cached key once (`attention.decode_attention`); "raw" the
projections, mapped again over the whole cache at each step by `pope_attention` /
`rope_attention` (half PoPE's key memory, and valid for any frequency multiplier passed per
call). Both run the math of the full forward (angles in float32 from int32 positions).

Padding and positions: left padding, `attention_mask` [B, T] (True = token). With a mask or a
cache, positions default to cumsum(mask) − 1 per row (pads get 0), continued after the tokens
already in the cache, so a left-padded row gets the same positions as alone.

Shape letters: B batch, T length, S cache length, D model width, V vocabulary, L layers,
N heads, K kv heads, H head dim, W kept logits.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pope_jax import checks
from pope_jax.config import ModelConfig
from pope_jax.encodings import layer_multipliers
from pope_jax.kv_cache import empty_kv_cache, write_slots
from pope_jax.layers import PositionalAttention
from pope_jax.positions import padded_positions

Array = jax.Array
Cache = dict[str, Any]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> Cache:
  """An empty KV cache of `max_len` slots per row.

  Args:
    config: the model config (L, K, H).
    batch: B.
    max_len: S, the most tokens (prompt, padding and generated) a row will hold.
    dtype: cache dtype (default: the compute dtype).

  Returns:
    dict: "k", "v": tuples of L arrays [B, S, K, H]: values and the keys as
    `ModelConfig.kv_cache_keys` says (mapped: RoPE-rotated, or PoPE's Cartesian form [B, S, K, 2H];
    raw: the projections);
    "positions": [B, S] int32; "valid": [B, S] bool (False for pads and unwritten slots);
    "index": [] int32, the number of slots written.
  """
  cache = empty_kv_cache(config.num_layers, batch, max_len, config.kv_heads, config.head_size,
                         jnp.dtype(dtype or config.dtype))
  if config.pos_encoding == "pope" and config.kv_cache_keys == "mapped":  # Cartesian: 2H wide
    cache["k"] = tuple(jnp.zeros(k.shape[:-1] + (2 * config.head_size,), k.dtype)
                       for k in cache["k"])
  return cache


def initializers(config: ModelConfig) -> tuple[nn.initializers.Initializer, ...]:
  """(embedding, projection, residual output projection) initialisers.

  Flax's defaults when `ModelConfig.init_std` is None; otherwise GPT-2's scheme: N(0, init_std²),
  and N(0, (init_std/sqrt(2L))²) for the projections that write the residual stream.
  """
  if config.init_std is None:
    lecun = nn.linear.default_kernel_init
    return nn.linear.default_embed_init, lecun, lecun
  normal = nn.initializers.normal
  return (normal(config.init_std), normal(config.init_std),
          normal(config.init_std / (2 * config.num_layers) ** 0.5))


class Block(nn.Module):
  """Pre-norm block: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x))."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, *, positions, multiplier, deterministic, key_mask=None, segment_ids=None,
               cache=None):
    """x [B, T, D] -> [B, T, D]; with a layer cache (see `PositionalAttention`), (x, (k, v))."""
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    _, kernel_init, residual_init = initializers(cfg)
    h = nn.RMSNorm(dtype=dtype, name="attn_norm")(x)
    h = PositionalAttention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_size,
        pos_encoding=cfg.pos_encoding, rope_base=cfg.rope_base, pope_base=cfg.pope_base,
        delta_init=cfg.delta_init, rope_layout=cfg.rope_layout, rope_yarn=cfg.rope_yarn,
        attention_implementation=cfg.attention_implementation, dtype=dtype, name="attn",
        kv_cache_keys=cfg.kv_cache_keys,
        kernel_init=kernel_init, out_kernel_init=residual_init,
        dropout_rate=cfg.attention_dropout,
    )(h, positions=positions, multiplier=multiplier, key_mask=key_mask, segment_ids=segment_ids,
      cache=cache, deterministic=deterministic)
    if cache is not None:
      h, kv = h
    x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
    h = nn.RMSNorm(dtype=dtype, name="mlp_norm")(x)
    h = nn.Dense(cfg.mlp_size, use_bias=False, dtype=dtype, name="mlp_in",
                 kernel_init=kernel_init)(h)
    h = nn.Dense(cfg.d_model, use_bias=False, dtype=dtype, name="mlp_out",
                 kernel_init=residual_init)(nn.gelu(h))
    x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
    return x if cache is None else (x, kv)


class Transformer(nn.Module):
  """Token embedding → L pre-norm blocks → RMSNorm → tied or untied head."""
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, *, positions: Array | None = None,
               attention_mask: Array | None = None, segment_ids: Array | None = None,
               rope_multipliers: Array | float | None = None,
               cache: Cache | None = None, logits_to_keep: int | None = None,
               deterministic: bool = True):
    """Next-token logits, optionally reading and extending a KV cache.

    Args:
      tokens: [B, T] int32.
      positions: [T] or [B, T] int; default arange(T), or with a mask or a cache
        `padded_positions(attention_mask, tokens already in the cache)`.
      attention_mask: None or [B, T] bool, False for (left) padding.
      segment_ids: None or [B, T] int, packed documents: a token attends only to the tokens of
        its own segment (causally, by position). Pass each document's positions (restarting at
        0) in `positions`. Not with a cache.
      rope_multipliers: None, [], [L] or [L, N] frequency multipliers (see `layer_multipliers`),
        applied to RoPE or PoPE frequencies; an input, not a parameter, so it can be vmapped.
      cache: None, or a cache from `init_cache`: the T new tokens are written at slots
        index..index+T−1 and attend to everything written before (prefill, chunks, or one token).
      logits_to_keep: W: logits of the last W positions only; None: all T.
      deterministic: disables dropout; pass False with a "dropout" rng to train.

    Returns:
      [B, T, V] ([B, W, V] with logits_to_keep) logits, float32 (or the compute dtype with
      `logits_dtype="compute"`); with a cache, (logits, new cache).

    Raises:
      ValueError: tokens not [B, T]; attention_mask, segment_ids or [B, T]-shaped positions of
        another shape; segment_ids with a cache; bad multiplier shape; more new tokens than the
        cache's free slots (named; checked against the written slots when the cache index is
        concrete, else the cache length); concrete token ids outside [0, V), named with their
        index.
      TypeError: tokens that are not integers (e.g. a string prompt).
    """
    cfg = self.config
    checks.check_token_ids(tokens, cfg.vocab_size, argument="tokens")
    if jnp.ndim(tokens) != 2:
      raise ValueError(f"tokens must be [batch, length], got shape {jnp.shape(tokens)} "
                       "(add a batch axis: tokens[None])")
    b, t = tokens.shape
    if attention_mask is not None and jnp.shape(attention_mask) != (b, t):
      raise ValueError(f"attention_mask must have the tokens' shape {(b, t)}, got "
                       f"{jnp.shape(attention_mask)}")
    if segment_ids is not None and (cache is not None or jnp.shape(segment_ids) != (b, t)):
      raise ValueError(f"segment_ids must be [B, T] = {(b, t)} int, without a cache; got shape "
                       f"{jnp.shape(segment_ids)}" + (" with a cache" if cache is not None else ""))
    key_mask, keys = None, None
    if attention_mask is not None or cache is not None:
      mask = jnp.ones((b, t), bool) if attention_mask is None else jnp.asarray(
          attention_mask).astype(bool)
      if cache is None:
        key_mask = mask
        positions = padded_positions(mask) if positions is None else positions
      else:
        keys, positions = write_slots(cache, mask, positions)
      positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, t))
    embed_init, kernel_init, _ = initializers(cfg)
    # dtype: the tied head (`attend`) multiplies in the compute dtype, like the untied one.
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="embed",
                     embedding_init=embed_init)
    x = embed(tokens)                                                     # [B, T, D]
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    mult = layer_multipliers(rope_multipliers, cfg.num_layers, cfg.num_heads)
    new_k, new_v = [], []
    for i in range(cfg.num_layers):
      layer_cache = None if keys is None else dict(keys, k=cache["k"][i], v=cache["v"][i])
      x = Block(cfg, name=f"block_{i}")(
          x, positions=positions, multiplier=None if mult is None else mult[i],
          deterministic=deterministic, key_mask=key_mask, segment_ids=segment_ids,
          cache=layer_cache)
      if keys is not None:
        x, (k, v) = x
        new_k.append(k)
        new_v.append(v)
    x = nn.RMSNorm(dtype=cfg.dtype, name="final_norm")(x)
    if logits_to_keep is not None:
      x = x[:, -logits_to_keep:]                                          # [B, W, D]
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, name="head",
                        kernel_init=kernel_init)(x)
    logits = logits if cfg.logits_dtype == "compute" else logits.astype(jnp.float32)
    if cache is None:
      return logits
    return logits, dict(keys, k=tuple(new_k), v=tuple(new_v), index=cache["index"] + t)


def num_params(config: ModelConfig) -> int:
  """Number of parameters of `Transformer(config)` (abstract init: nothing is allocated)."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens)
  return int(sum(x.size for x in jax.tree.leaves(shapes)))
