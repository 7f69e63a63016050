"""Llama-family decoder (llama, mistral, qwen2) in pure-functional Flax Linen, with a KV cache.

    model = Llama(config)
    logits = model.apply({"params": params}, tokens, attention_mask=mask,
                         rope_multipliers=m)                          # [B, T, V] float32
    cache = init_kv_cache(config, batch, max_len)
    logits, cache = model.apply({"params": params}, tokens, attention_mask=mask, kv_cache=cache)

Matches Hugging Face transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM`: pre-norm RMSNorm
(weight · normalise(x in float32) cast back), SwiGLU MLP down(silu(gate(x)) · up(x)), grouped-query
attention with half-split ("rotate_half") RoPE on the checkpoint's frequencies, optional q/k/v (and
o) biases, tied or untied LM head. Parameter names follow Hugging Face (`embed_tokens`,
`layers_i/self_attn/q_proj`, ...; Dense kernels are the transposed HF weights).

Attention variants (MoICE, `lpes_jax.moice`): `attention` is an optional callable that replaces
each layer's RoPE attention call; see `AttentionFn`. Without it the model is unchanged.

LPES: `rope_multipliers` ([], [L] or [L, N]; 1/s interpolates positions by s) is an array input,
not a parameter or a static field, so one compiled function serves every candidate and `jax.vmap`
over multipliers works. Per-head multipliers apply to query heads, so the query heads of one GQA
group must share a value (`pope_jax.encodings.kv_head_multiplier`: checked, with non-finite values,
for concrete multipliers; under `jit` or `vmap` it is the caller's contract, as the keys take
each group's first entry).

Padding and positions: left padding, `attention_mask` [B, T] (1 = token). Positions default to
cumsum(mask) − 1 per row (pads get position 0), continued after the tokens already in the cache.
A key is visible to a query iff it is a real token and its position is ≤ the query's.

Shape letters: B batch, T new tokens, S cache length, D model width, N query heads, K kv heads,
H head dim, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lpes_jax.config import LlamaConfig
from lpes_jax.rope_scaling import scaled_rope_frequencies
from pope_jax import checks, encodings, kv_cache as kv_cache_lib, rope_attention
from pope_jax.kv_cache import empty_kv_cache
from pope_jax.positions import check_int32_range, padded_positions

Array = jax.Array
KVCache = dict[str, Any]
AttentionFn = Callable[..., tuple[Array, dict[str, Array]]]
"""An attention variant: `fn(layer, q, k, v, *, q_positions, attend) -> (out, sown)`.

layer: the layer index (a Python int); q [B, T, N, H] (un-rotated); k, v [B, S, K, H] (the whole
cache, un-rotated keys); q_positions [B, T] int32; `attend(q, k, v, frequencies=None)` is the
layer's own `rope_attention` call (positions, masks, multipliers and implementation bound;
`frequencies` [H/2] float32 replaces the checkpoint's). Returns out [B, T, N, H] in q's dtype and
a dict of arrays sown into the "intermediates" collection of that layer's `self_attn`.
"""


def init_kv_cache(config: LlamaConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
  """An empty KV cache for `max_len` tokens per row.

  Args:
    config: the model config (L, K, H).
    batch: B.
    max_len: S, the most tokens (prompt + generated) a row will hold.
    dtype: cache dtype (default: the model dtype).

  Returns:
    dict: "k", "v": tuples of L arrays [B, S, K, H] (raw keys, before RoPE: `rope_attention`
    rotates them in each call); "positions": [B, S] int32; "valid": [B, S] bool (False for pads
    and unwritten slots); "index": [] int32, the number of slots written.
  """
  return empty_kv_cache(config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim,
                        jnp.dtype(dtype or config.dtype))


class RMSNorm(nn.Module):
  """weight · (x / sqrt(mean(x²) + eps)), normalised in float32 and cast back (HF LlamaRMSNorm)."""
  eps: float
  dtype: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return weight * xf.astype(x.dtype)


class Attention(nn.Module):
  """GQA self-attention with half-split RoPE on the checkpoint's frequencies
  (`pope_jax.rope_attention`)."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, *, positions, multiplier, keys, attention=None):
    """x [B, T, D]; positions [B, T]; multiplier None or [N]; keys: dict of the key side;
    attention: None or an `AttentionFn` with the layer index bound.

    `keys` holds "k", "v" ([B, S, K, H] cache of raw keys, or None), "positions" [B, S],
    "valid" [B, S], "index" (slot of the first new token) and "plain" (no cache, padding or
    explicit positions: default positions, which "cudnn" runs with its own causal mask).
    Returns (out [B, T, D], (k_all, v_all)), k_all un-rotated.
    """
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    b, t, _ = x.shape
    n, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dense = lambda f, bias, name: nn.Dense(f, use_bias=bias, dtype=dtype, param_dtype=dtype,
                                           name=name)
    q = dense(n * h, cfg.qkv_bias, "q_proj")(x).reshape(b, t, n, h)
    k = dense(kh * h, cfg.qkv_bias, "k_proj")(x).reshape(b, t, kh, h)
    v = dense(kh * h, cfg.qkv_bias, "v_proj")(x).reshape(b, t, kh, h)
    if keys["k"] is not None:
      k = kv_cache_lib.write_layer(keys["k"], k, keys["index"])
      v = kv_cache_lib.write_layer(keys["v"], v, keys["index"])
    at = {} if keys["plain"] else dict(q_positions=positions, k_positions=keys["positions"],
                                       key_mask=keys["valid"])
    attend = functools.partial(
        rope_attention, is_causal=True, multiplier=multiplier,
        frequencies=jnp.asarray(scaled_rope_frequencies(h, cfg.rope_theta, cfg.rope_scaling)),
        local_window=cfg.sliding_window, implementation=cfg.attention_implementation, **at)
    k_all, v_all = k.astype(dtype), v.astype(dtype)
    if attention is None:
      out = attend(q, k_all, v_all)                                            # [B, T, N, H]
    else:
      out, sown = attention(q, k_all, v_all, q_positions=positions, attend=attend)
      for name, value in sown.items():
        self.sow("intermediates", name, value)
    out = dense(cfg.hidden_size, cfg.o_bias, "o_proj")(out.reshape(b, t, n * h))
    return out, (k, v)


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) · up(x))."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    dense = lambda f, name: nn.Dense(f, use_bias=False, dtype=dtype, param_dtype=dtype, name=name)
    h = nn.silu(dense(cfg.intermediate_size, "gate_proj")(x)) * dense(cfg.intermediate_size,
                                                                      "up_proj")(x)
    return dense(cfg.hidden_size, "down_proj")(h)


class DecoderLayer(nn.Module):
  """x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x))."""
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, *, positions, multiplier, keys, attention=None):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    h, kv = Attention(cfg, name="self_attn")(
        RMSNorm(cfg.rms_norm_eps, dtype, name="input_layernorm")(x), positions=positions,
        multiplier=multiplier, keys=keys, attention=attention)
    x = x + h
    x = x + MLP(cfg, name="mlp")(RMSNorm(cfg.rms_norm_eps, dtype,
                                         name="post_attention_layernorm")(x))
    return x, kv


class Llama(nn.Module):
  """Token embedding → L decoder layers → RMSNorm → tied or untied LM head."""
  config: LlamaConfig

  @nn.compact
  def __call__(
      self,
      tokens: Array,
      *,
      positions: Array | None = None,
      attention_mask: Array | None = None,
      rope_multipliers: Array | float | None = None,
      kv_cache: KVCache | None = None,
      logits_to_keep: int | None = None,
      attention: AttentionFn | None = None,
  ):
    """Next-token logits, optionally reading and extending a KV cache.

    Args:
      tokens: [B, T] int32 ids in [0, V). Concrete ids (an eager call) are checked; under `jit`
        (traced ids) they are not, and the embedding lookup (Flax `nn.Embed`: `jnp.take` in its
        default "fill" mode) reads an id in [-V, 0) as id + V (−1 is the last token) and gives
        an all-NaN embedding, hence NaN logits, for an id >= V or < −V.
      positions: [B, T] int32; default `padded_positions(attention_mask, tokens in cache)`.
      attention_mask: [B, T] bool/int, 0 for (left) padding; default all ones.
      rope_multipliers: None, [], [L] or [L, N] float frequency multipliers (traced; vmap-able).
      kv_cache: None, or a cache from `init_kv_cache` (the T new tokens are written at slots
        index..index+T−1 and may attend to everything written before).
      logits_to_keep: compute logits for the last W = logits_to_keep positions only ([B, W, V];
        Hugging Face's argument of that name); None: all T positions.
      attention: None (RoPE attention), or an `AttentionFn` called in every layer instead
        (e.g. `lpes_jax.moice.moice_attention`); it may close over traced arrays.

    Returns:
      logits [B, T, V] ([B, W, V] with logits_to_keep) float32 without a cache; (logits,
      new_cache) with one. Each layer's input and the final normed hidden state are sown into the
      "intermediates" collection as "hidden_states" (apply with `mutable=["intermediates"]`).

    Raises:
      ValueError: tokens not 2-D; attention_mask or positions not of the tokens' shape; bad
        multiplier shape; T larger than the cache's free slots (checked when the cache index
        is concrete; under jit only against the cache length). For concrete values only: a
        token id outside [0, V), multipliers not finite and > 0, positions outside int32.
      TypeError: tokens that are not integers (e.g. a string prompt).
    """
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    checks.check_token_ids(tokens, cfg.vocab_size, argument="tokens")
    if jnp.ndim(tokens) != 2:
      raise ValueError(f"tokens must be [batch, length], got shape {jnp.shape(tokens)} "
                       "(add a batch axis: tokens[None])")
    b, t = tokens.shape
    for name, value in (("attention_mask", attention_mask), ("positions", positions)):
      if value is not None and jnp.shape(value) != (b, t):
        raise ValueError(f"{name} must have the tokens' shape {(b, t)}, got {jnp.shape(value)}")
    if positions is not None:
      check_int32_range(positions, "positions")
    plain = kv_cache is None and attention_mask is None and positions is None
    if attention_mask is None:
      attention_mask = jnp.ones((b, t), bool)
    attention_mask = jnp.asarray(attention_mask).astype(bool)
    if kv_cache is None:
      if positions is None:
        positions = padded_positions(attention_mask)
      keys = {"k": None, "v": None, "positions": positions, "valid": attention_mask,
              "index": 0, "plain": plain}
    else:
      keys, positions = kv_cache_lib.write_slots(kv_cache, attention_mask, positions)
      keys["plain"] = False
    positions = jnp.asarray(positions, jnp.int32)
    mult = encodings.layer_multipliers(rope_multipliers, cfg.num_layers, cfg.num_heads)

    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                     name="embed_tokens")
    x = embed(tokens)                                                         # [B, T, D]
    new_k, new_v = [], []
    for i in range(cfg.num_layers):
      self.sow("intermediates", "hidden_states", x)
      layer_keys = dict(keys, k=None if kv_cache is None else kv_cache["k"][i],
                        v=None if kv_cache is None else kv_cache["v"][i])
      x, (k, v) = DecoderLayer(cfg, name=f"layers_{i}")(
          x, positions=positions, multiplier=None if mult is None else mult[i], keys=layer_keys,
          attention=None if attention is None else functools.partial(attention, i))
      new_k.append(k)
      new_v.append(v)
    x = RMSNorm(cfg.rms_norm_eps, dtype, name="norm")(x)
    self.sow("intermediates", "hidden_states", x)
    if logits_to_keep is not None:
      x = x[:, -logits_to_keep:]                                              # [B, W, D]
    if cfg.tie_word_embeddings:
      logits = embed.attend(x)
    else:
      logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                        name="lm_head")(x)
    logits = logits.astype(jnp.float32)
    if kv_cache is None:
      return logits
    new_cache = {"k": tuple(new_k), "v": tuple(new_v), "positions": keys["positions"],
                 "valid": keys["valid"], "index": kv_cache["index"] + t}
    return logits, new_cache


def init_params(config: LlamaConfig, key: Array, *, scale: float = 0.02) -> Any:
  """Random parameters of the right shapes (N(0, scale²) weights, unit norms, zero biases).

  Args:
    config: model config; params are created in `config.dtype` directly on the default device.
    key: PRNG key.

  Returns:
    A params pytree as `Llama(config).init(...)["params"]` would give.
  """
  model = Llama(config)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes["params"])
  keys = jax.random.split(key, len(leaves))

  def make(path, leaf, k):
    name = jax.tree_util.keystr(path)
    if "layernorm" in name or name.endswith("['norm']['weight']"):
      return jnp.ones(leaf.shape, leaf.dtype)
    if "bias" in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    return (scale * jax.random.normal(k, leaf.shape, leaf.dtype)).astype(leaf.dtype)

  # Leaf by leaf: one small compiled RNG per distinct shape (a single jit over all leaves compiles
  # for minutes at 7B scale).
  made = [make(p, l, k) for (p, l), k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(treedef, made)


def num_params(params: Any) -> int:
  """Total number of parameters."""
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
