"""Decoder-only Transformer (pre-norm RMSNorm blocks) with RoPE, PoPE or no positional encoding.

Pure-functional Flax Linen: `params = model.init(key, tokens)["params"]`,
`logits = model.apply({"params": params}, tokens)`.

Shape letters: B batch, T length, D model width, V vocabulary, L layers, N heads.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from pope_jax.config import ModelConfig
from pope_jax.encodings import layer_multipliers
from pope_jax.layers import PositionalAttention

Array = jax.Array


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
  def __call__(self, x, *, positions, multiplier, deterministic):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    _, kernel_init, residual_init = initializers(cfg)
    h = nn.RMSNorm(dtype=dtype, name="attn_norm")(x)
    h = PositionalAttention(
        num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_size,
        pos_encoding=cfg.pos_encoding, rope_base=cfg.rope_base, pope_base=cfg.pope_base,
        delta_init=cfg.delta_init, rope_layout=cfg.rope_layout, rope_yarn=cfg.rope_yarn,
        attention_implementation=cfg.attention_implementation, dtype=dtype, name="attn",
        kernel_init=kernel_init, out_kernel_init=residual_init,
    )(h, positions=positions, multiplier=multiplier)
    x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
    h = nn.RMSNorm(dtype=dtype, name="mlp_norm")(x)
    h = nn.Dense(cfg.mlp_size, use_bias=False, dtype=dtype, name="mlp_in",
                 kernel_init=kernel_init)(h)
    h = nn.Dense(cfg.d_model, use_bias=False, dtype=dtype, name="mlp_out",
                 kernel_init=residual_init)(nn.gelu(h))
    return x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)


class Transformer(nn.Module):
  """Token embedding → L pre-norm blocks → RMSNorm → tied or untied head."""
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, *, positions: Array | None = None,
               rope_multipliers: Array | float | None = None,
               deterministic: bool = True) -> Array:
    """Next-token logits.

    Args:
      tokens: [B, T] int32.
      positions: [T] or [B, T] int (default arange(T)).
      rope_multipliers: None, [], [L] or [L, N] frequency multipliers (see `layer_multipliers`),
        applied to RoPE or PoPE frequencies; an input, not a parameter, so it can be vmapped.
      deterministic: disables dropout; pass False with a "dropout" rng to train.

    Returns:
      [B, T, V] logits, float32 (or the compute dtype with `logits_dtype="compute"`).
    """
    cfg = self.config
    embed_init, kernel_init, _ = initializers(cfg)
    # dtype: the tied head (`attend`) multiplies in the compute dtype, like the untied one.
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="embed",
                     embedding_init=embed_init)
    x = embed(tokens)                                                     # [B, T, D]
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    mult = layer_multipliers(rope_multipliers, cfg.num_layers, cfg.num_heads)
    for i in range(cfg.num_layers):
      x = Block(cfg, name=f"block_{i}")(
          x, positions=positions, multiplier=None if mult is None else mult[i],
          deterministic=deterministic)
    x = nn.RMSNorm(dtype=cfg.dtype, name="final_norm")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, name="head",
                        kernel_init=kernel_init)(x)
    return logits if cfg.logits_dtype == "compute" else logits.astype(jnp.float32)


def num_params(config: ModelConfig) -> int:
  """Number of parameters of `Transformer(config)` (abstract init: nothing is allocated)."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens)
  return int(sum(x.size for x in jax.tree.leaves(shapes)))
