"""Greedy decoding of the Llama model with a KV cache, on the one loop `pope_jax.generation.decode`.

Every consumer decodes through these functions: `greedy_generate` (lists of ids),
`lpes_jax.fitness` (LPES fitness, teacher-forced or greedy), `lpes_jax.evaluate` (the
lost-in-the-middle evaluation) and `lpes_jax.baselines` (Attention Buckets).

  * `prefill` / `decode_step`: one model call over the prompt / one new token, last-token logits.
  * `llama_step`: the model as the loop's `Step` (what `prefill` and `decode_step` call).
  * `greedy_tokens`: a fixed number of tokens (`lax.scan`), traceable and vmap-able over
    `rope_multipliers`, so a population of candidates decodes in one compiled call.
  * `greedy_decode`: stops once every row has emitted an EOS id (`lax.while_loop`).
  * `greedy_generate`: `greedy_decode` for lists of token ids (`pope_jax.generation.generate_ids`:
    checks the ids, left-pads to a length bucket, trims the outputs).
  * `last_logits`: the logits of the last W positions of one forward pass (teacher forcing).

Shape letters: B batch, T prompt length (padded), G max new tokens, S cache length, W window,
V vocabulary, L layers, N query heads.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from lpes_jax.config import LlamaConfig
from lpes_jax.llama import AttentionFn, KVCache, Llama, init_kv_cache
from pope_jax import encodings, generation


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


def llama_step(config: LlamaConfig, params: Any, rope_multipliers: Array | None, *,
               attention: AttentionFn | None = None) -> generation.Step:
  """The model as a `pope_jax.generation.Step`: (tokens [B, T], mask [B, T], cache) ->
  (last-position logits [B, V] float32, the cache extended by the T tokens). `attention`: the
  model's optional attention variant (`lpes_jax.llama.AttentionFn`, e.g. MoICE)."""
  model = Llama(config)

  def step(tokens, mask, cache):
    logits, cache = model.apply({"params": params}, tokens, attention_mask=mask,
                                rope_multipliers=rope_multipliers, kv_cache=cache,
                                logits_to_keep=1, attention=attention)
    return logits[:, -1], cache

  return step


def prefill(config: LlamaConfig, params: Any, tokens: Array, attention_mask: Array,
            rope_multipliers: Array | None, cache_len: int) -> tuple[Array, KVCache]:
  """The prompt into a fresh KV cache of `cache_len` slots.

  Returns:
    (last-position logits [B, V] float32, the cache holding the T prompt tokens).
  """
  cache = init_kv_cache(config, tokens.shape[0], cache_len)
  return llama_step(config, params, rope_multipliers)(tokens, attention_mask, cache)


def decode_step(config: LlamaConfig, params: Any, token: Array, cache: KVCache,
                rope_multipliers: Array | None) -> tuple[Array, KVCache]:
  """One new token [B] int32 through the model, appended to the cache.

  Returns:
    (its logits [B, V] float32, the extended cache).
  """
  return llama_step(config, params, rope_multipliers)(
      token[:, None], jnp.ones((token.shape[0], 1), bool), cache)


def greedy_tokens(config: LlamaConfig, params: Any, tokens: Array, attention_mask: Array,
                  rope_multipliers: Array | None, num_new: int, *,
                  attention: AttentionFn | None = None) -> Array:
  """Exactly `num_new` greedy tokens after left-padded prompts (no EOS stop).

  Prefill, then `lax.scan` over single-token steps: traceable, so it vmaps over candidates.

  Args:
    config, params: the model.
    tokens: [B, T] int32 left-padded prompts; attention_mask: [B, T] bool.
    rope_multipliers: None, [], [L] or [L, N] float (traced).
    num_new: G (static), >= 1.
    attention: None, or the model's attention variant (e.g. `lpes_jax.moice.moice_attention`).

  Returns:
    [B, G] int32.
  """
  cache = init_kv_cache(config, tokens.shape[0], tokens.shape[1] + num_new)
  step = llama_step(config, params, rope_multipliers, attention=attention)
  out, _ = generation.decode(step, cache, tokens,
                             attention_mask, max_new_tokens=num_new)
  return out


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
  cache_len = generation.cache_length(tokens.shape[1], max_new_tokens, cache_len)
  cache = init_kv_cache(config, tokens.shape[0], cache_len)
  return generation.decode(llama_step(config, params, rope_multipliers), cache, tokens,
                           attention_mask, max_new_tokens=max_new_tokens, stop_ids=eos_ids,
                           pad_id=pad_id)


_greedy_decode_jit = jax.jit(greedy_decode,
                             static_argnames=("config", "max_new_tokens", "pad_id", "cache_len"))


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
    TypeError: text or non-integer ids. ValueError: no prompts, an empty prompt, an id outside
      [0, vocab_size), non-finite concrete rope_multipliers, or a prompt (plus max_new_tokens)
      longer than max_cache_len.
  """
  encodings.check_finite_multipliers(rope_multipliers, "rope_multipliers")
  pad_id = (config.pad_token_id or 0) if pad_id is None else pad_id
  eos = config.eos_token_ids if eos_ids is None else tuple(eos_ids)
  run = lambda tokens, mask: _greedy_decode_jit(
      config, params, tokens, mask, max_new_tokens=max_new_tokens,
      eos_ids=jnp.asarray(eos, jnp.int32), rope_multipliers=rope_multipliers, pad_id=pad_id)
  return generation.generate_ids(run, prompts, vocab_size=config.vocab_size,
                                 max_new_tokens=max_new_tokens, pad_id=pad_id, bucket=bucket,
                                 max_cache_len=max_cache_len)
