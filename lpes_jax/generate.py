"""Greedy decoding with a KV cache: the one decoder of the Llama model.

Every consumer decodes through these functions: `greedy_generate` (lists of ids),
`lpes_jax.fitness` (LPES fitness, teacher-forced or greedy), `lpes_jax.evaluate` (the
lost-in-the-middle evaluation) and `lpes_jax.baselines` (Attention Buckets).

  * `prefill` / `decode_step`: one model call over the prompt / one new token, last-token logits.
  * `greedy_tokens`: a fixed number of tokens (`lax.scan`), traceable and vmap-able over
    `rope_multipliers`, so a population of candidates decodes in one compiled call.
  * `greedy_decode`: stops once every row has emitted an EOS id (`lax.while_loop`).
  * `greedy_generate`: wraps `greedy_decode` for lists of token ids: left-pads to a length bucket
    (one compilation serves all prompts of similar length) and trims the outputs.
  * `last_logits`: the logits of the last W positions of one forward pass (teacher forcing).

Shape letters: B batch, T prompt length (padded), G max new tokens, S cache length, W window,
V vocabulary, L layers, N query heads.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lpes_jax.config import LlamaConfig
from lpes_jax.llama import KVCache, Llama, init_kv_cache
from pope_jax import encodings

Array = jax.Array


def last_logits(config: LlamaConfig, params: Any, tokens: Array, attention_mask: Array,
                rope_multipliers: Array | None, window: int) -> Array:
  """Logits of the last `window` positions of one forward pass (no cache).

  Args:
    config, params: the model.
    tokens: [B, T] int32 left-padded; attention_mask: [B, T] bool.
    rope_multipliers: None, [], [L] or [L, N] float (traced).
    window: W (static).

  Returns:
    [B, W, V] float32.
  """
  return Llama(config).apply({"params": params}, tokens, attention_mask=attention_mask,
                             rope_multipliers=rope_multipliers, logits_to_keep=window)


def prefill(config: LlamaConfig, params: Any, tokens: Array, attention_mask: Array,
            rope_multipliers: Array | None, cache_len: int) -> tuple[Array, KVCache]:
  """The prompt into a fresh KV cache of `cache_len` slots.

  Returns:
    (last-position logits [B, V] float32, the cache holding the T prompt tokens).
  """
  cache = init_kv_cache(config, tokens.shape[0], cache_len)
  logits, cache = Llama(config).apply(
      {"params": params}, tokens, attention_mask=attention_mask,
      rope_multipliers=rope_multipliers, kv_cache=cache, logits_to_keep=1)
  return logits[:, -1], cache


def decode_step(config: LlamaConfig, params: Any, token: Array, cache: KVCache,
                rope_multipliers: Array | None) -> tuple[Array, KVCache]:
  """One new token [B] int32 through the model, appended to the cache.

  Returns:
    (its logits [B, V] float32, the extended cache).
  """
  logits, cache = Llama(config).apply(
      {"params": params}, token[:, None], attention_mask=jnp.ones((token.shape[0], 1), bool),
      rope_multipliers=rope_multipliers, kv_cache=cache, logits_to_keep=1)
  return logits[:, -1], cache


def _argmax(logits: Array) -> Array:
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def greedy_tokens(config: LlamaConfig, params: Any, tokens: Array, attention_mask: Array,
                  rope_multipliers: Array | None, num_new: int) -> Array:
  """Exactly `num_new` greedy tokens after left-padded prompts (no EOS stop).

  Prefill, then `lax.scan` over single-token steps: traceable, so it vmaps over candidates.

  Args:
    config, params: the model.
    tokens: [B, T] int32 left-padded prompts; attention_mask: [B, T] bool.
    rope_multipliers: None, [], [L] or [L, N] float (traced).
    num_new: G (static), >= 1.

  Returns:
    [B, G] int32.
  """
  logits, cache = prefill(config, params, tokens, attention_mask, rope_multipliers,
                          tokens.shape[1] + num_new)
  first = _argmax(logits)                                                     # [B]

  def step(carry, _):
    tok, cache = carry
    logits, cache = decode_step(config, params, tok, cache, rope_multipliers)
    nxt = _argmax(logits)
    return (nxt, cache), nxt

  _, rest = jax.lax.scan(step, (first, cache), None, length=num_new - 1)
  return jnp.concatenate([first[:, None], rest.T], axis=1)                   # [B, G]


def greedy_decode(
    config: LlamaConfig,
    params: Any,
    tokens: Array,
    attention_mask: Array,
    *,
    max_new_tokens: int,
    eos_ids: Array,
    rope_multipliers: Array | None = None,
    pad_id: int = 0,
    cache_len: int | None = None,
) -> tuple[Array, Array]:
  """Greedy continuation of left-padded prompts until every row has emitted an EOS id.

  Args:
    config: model config (static).
    params: model params.
    tokens: [B, T] int32 left-padded prompts.
    attention_mask: [B, T] bool, False on the left pads.
    max_new_tokens: G (static).
    eos_ids: [E] int32 stop ids (may be empty).
    rope_multipliers: None, [], [L] or [L, N] float (traced).
    pad_id: written after a row's EOS.
    cache_len: S ≥ T + G (default T + G).

  Returns:
    (new_tokens [B, G] int32, padded with pad_id after EOS; lengths [B] int32, tokens up to and
    including the first EOS).

  Raises:
    ValueError: the prompt plus max_new_tokens does not fit the cache; max_new_tokens < 1.
  """
  b, t = tokens.shape
  cache_len = t + max_new_tokens if cache_len is None else cache_len
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if t + max_new_tokens > cache_len:
    raise ValueError(f"prompt of {t} tokens plus max_new_tokens={max_new_tokens} does not fit a "
                     f"KV cache of {cache_len} slots")
  eos_ids = jnp.asarray(eos_ids, jnp.int32).reshape(-1)
  logits, cache = prefill(config, params, tokens, attention_mask, rope_multipliers, cache_len)
  first = _argmax(logits)                                                     # [B]
  out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = jnp.isin(first, eos_ids)
  lengths = jnp.where(done, 1, max_new_tokens).astype(jnp.int32)

  def cond(state):
    i, _, done, _, _, _ = state
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(state):
    i, prev, done, cache, out, lengths = state
    logits, cache = decode_step(config, params, prev, cache, rope_multipliers)
    nxt = _argmax(logits)
    nxt = jnp.where(done, pad_id, nxt)
    out = out.at[:, i].set(nxt)
    hit = ~done & jnp.isin(nxt, eos_ids)
    lengths = jnp.where(hit, i + 1, lengths)
    return i + 1, nxt, done | hit, cache, out, lengths

  state = (jnp.asarray(1, jnp.int32), first, done, cache, out, lengths)
  _, _, _, _, out, lengths = jax.lax.while_loop(cond, body, state)
  return out, lengths


_greedy_decode_jit = jax.jit(greedy_decode,
                             static_argnames=("config", "max_new_tokens", "pad_id", "cache_len"))


def bucket_length(n: int, bucket: int = 64) -> int:
  """Rounds a prompt length up to a multiple of `bucket` (one compilation per bucket)."""
  return max(bucket, int(math.ceil(n / bucket)) * bucket)


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray,
                                                                                    np.ndarray]:
  """([B, length] int32 tokens, [B, length] bool mask), prompts right-aligned."""
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    if len(p):
      tokens[i, length - len(p):] = p
      mask[i, length - len(p):] = True
  return tokens, mask


def greedy_generate(
    config: LlamaConfig,
    params: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    eos_ids: Sequence[int] | None = None,
    rope_multipliers: Array | None = None,
    pad_id: int | None = None,
    bucket: int = 64,
    max_cache_len: int | None = None,
) -> list[list[int]]:
  """Greedy continuations of a batch of token-id prompts (each up to and including its EOS).

  Args:
    config, params: the model.
    prompts: B lists of token ids (already with BOS as the tokenizer decided), each non-empty.
    max_new_tokens: G.
    eos_ids: stop ids (default: config.eos_token_ids).
    rope_multipliers: None, [], [L] or [L, N].
    pad_id: padding id (default: config.pad_token_id or 0); never attended to.
    bucket: prompt lengths are padded up to a multiple of this.
    max_cache_len: optional upper bound on the KV cache (prompt + generation) length.

  Returns:
    B lists of new token ids.

  Raises:
    ValueError: no prompts, an empty prompt, non-finite concrete rope_multipliers, or a
      prompt (plus max_new_tokens) longer than max_cache_len.
  """
  if not prompts:
    raise ValueError("prompts is empty: give at least one prompt")
  encodings.check_finite_multipliers(rope_multipliers, "rope_multipliers")
  if any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  longest = max(len(p) for p in prompts)
  if max_cache_len is not None and longest + max_new_tokens > max_cache_len:
    raise ValueError(f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens} is longer "
                     f"than the KV cache (max_cache_len={max_cache_len})")
  length = bucket_length(longest, bucket)
  if max_cache_len is not None:
    length = min(length, max_cache_len - max_new_tokens)
  pad_id = (config.pad_token_id or 0) if pad_id is None else pad_id
  eos = config.eos_token_ids if eos_ids is None else tuple(eos_ids)
  tokens, mask = left_pad(prompts, length, pad_id)
  out, lengths = _greedy_decode_jit(
      config, params, jnp.asarray(tokens), jnp.asarray(mask), max_new_tokens=max_new_tokens,
      eos_ids=jnp.asarray(eos, jnp.int32), rope_multipliers=rope_multipliers, pad_id=pad_id)
  out, lengths = np.asarray(out), np.asarray(lengths)
  return [out[i, :lengths[i]].tolist() for i in range(len(prompts))]
