"""Batched greedy decoding with a KV cache, and a command-line interface.

`greedy_decode` is the pure function (jit- and vmap-able over `rope_multipliers`): one prefill
over the left-padded prompts, then one token per step under `lax.while_loop` until every row has
emitted an EOS id or `max_new_tokens` are out. `greedy_generate` wraps it for lists of token ids:
left-pads to a length bucket (so one compilation serves all prompts of similar length) and trims
the outputs.

    python -m lpes_jax.generate --model PATH --prompt "The capital of France is"
        [--max-new-tokens 32] [--rope-multipliers 1.0,0.9,...|FILE.json] [--chat] [--dtype ...]

Shape letters: B batch, T prompt length (padded), G max new tokens, S cache length, L layers,
N query heads.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lpes_jax.config import LlamaConfig
from lpes_jax.llama import Llama, init_kv_cache
from pope_jax import encodings

Array = jax.Array


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
  """Greedy continuation of left-padded prompts (prefill, then one token per step).

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
  model = Llama(config)
  eos_ids = jnp.asarray(eos_ids, jnp.int32).reshape(-1)
  apply = functools.partial(model.apply, {"params": params}, rope_multipliers=rope_multipliers,
                            last_token_only=True)
  cache = init_kv_cache(config, b, cache_len)
  logits, cache = apply(tokens, attention_mask=attention_mask, kv_cache=cache)
  first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)                # [B]
  out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = jnp.isin(first, eos_ids)
  lengths = jnp.where(done, 1, max_new_tokens).astype(jnp.int32)

  def cond(state):
    i, _, done, _, _, _ = state
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(state):
    i, prev, done, cache, out, lengths = state
    logits, cache = apply(prev[:, None], attention_mask=jnp.ones((b, 1), bool), kv_cache=cache)
    nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
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


def parse_multipliers(spec: str | None) -> np.ndarray | None:
  """"0.5" → [], "1,0.9,0.8" → [L], or a .json file holding a number, [L] or [L, N]."""
  if spec is None:
    return None
  try:
    if spec.endswith(".json"):
      with open(spec) as fh:
        return np.asarray(json.load(fh), np.float32)
    values = [float(v) for v in spec.split(",")]
  except (OSError, ValueError, TypeError) as e:
    raise ValueError(f"--rope-multipliers {spec!r}: expected a number, a comma-separated list or "
                     f"a .json file of numbers ({e})") from None
  return np.asarray(values[0] if len(values) == 1 else values, np.float32)


def main(argv: Sequence[str] | None = None) -> None:
  from lpes_jax import load_pretrained, load_tokenizer

  parser = argparse.ArgumentParser(description="Greedy generation with a Llama-family model.")
  parser.add_argument("--model", required=True, help="Hugging Face folder or .gguf file")
  parser.add_argument("--prompt", required=True, action="append",
                      help="prompt text (repeat for a batch)")
  parser.add_argument("--max-new-tokens", type=int, default=32)
  parser.add_argument("--rope-multipliers", default=None,
                      help="scalar, comma-separated per-layer list, or a .json file ([L] or [L, N])")
  parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  args = parser.parse_args(argv)
  multipliers = parse_multipliers(args.rope_multipliers)  # Bad input fails before the slow load.
  _, params, config = load_pretrained(args.model, dtype=args.dtype)
  tok = load_tokenizer(args.model)
  prompts = [tok.encode_chat([{"role": "user", "content": p}]) if args.chat else tok.encode(p)
             for p in args.prompt]
  eos = tuple(dict.fromkeys(config.eos_token_ids + tok.eos_ids))
  outs = greedy_generate(config, params, prompts, max_new_tokens=args.max_new_tokens, eos_ids=eos,
                         rope_multipliers=multipliers)
  for i, out in enumerate(outs):
    header = f"[{i}] " if len(outs) > 1 else ""
    sys.stdout.write(header + tok.decode(out) + "\n")


if __name__ == "__main__":
  main()
