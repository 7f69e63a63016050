"""The one generation loop: prefill, then one token per step from a KV cache, greedy or sampled.

Any model that can be written as a `Step` decodes here: the PoPE/RoPE `pope_jax.Transformer`
(`transformer_step`, `generate`) and the Llama models (`lpes_jax.generate` builds its greedy
decoder on `decode`).

    step(tokens [B, T] int32, mask [B, T] bool, cache) -> (last-token logits [B, V] f32, cache)

  * `decode`: prefill, then `max_new_tokens` - 1 single-token steps; with `stop_ids` it stops
    once every row has emitted one (`lax.while_loop`), without them it runs a fixed count
    (`lax.scan`: traceable, vmap-able over e.g. frequency multipliers).
  * `sample`: greedy argmax, or temperature, top-k (Fan et al. 2018) and top-p (nucleus,
    Holtzman et al. 2020) sampling from an explicit `jax.random` key.
  * `generate_ids`: lists of token ids in, lists out: checks the ids, left-pads to a length
    bucket (one compilation serves prompts of similar length) and trims after the stop id.
  * `generate`: `generate_ids` for a `pope_jax.Transformer`.

Each step's attention over the cache is `pope_jax.attention`'s: on Hopper, steps of T <= 16
tokens run the split-K decoding kernel (`pallas_kernels.decode_attention`) with the default
implementation; `ModelConfig.attention_implementation="xla"` keeps the reference. What the cache
holds as keys, mapped (RoPE-rotated or PoPE-Cartesian) or raw, is `ModelConfig.kv_cache_keys`.

Shape letters: B batch, T prompt length (left-padded), G new tokens, S cache length,
V vocabulary, L layers, N query heads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pope_jax import encodings
from pope_jax.config import ModelConfig
from pope_jax.model import Transformer, init_cache

Array = jax.Array
Step = Callable[[Array, Array, Any], tuple[Array, Any]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """How the next token is chosen from its logits (static: hashable, one compilation each).

  Attributes:
    temperature: 0 for greedy argmax (no key needed); > 0 divides the logits before sampling.
    top_k: None, or keep the k most likely tokens.
    top_p: None, or keep the smallest set of most likely tokens whose probability sums to at
      least p, in (0, 1] (after temperature and top-k).
  """
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
    if self.top_k is not None and (not isinstance(self.top_k, (int, np.integer))
                                   or isinstance(self.top_k, bool) or self.top_k < 1):
      raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
    if self.top_p is not None and not (isinstance(self.top_p, (int, float))
                                       and 0 < self.top_p <= 1):
      raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


GREEDY = Sampling()


def top_k_logits(logits: Array, k: int) -> Array:
  """logits [..., V] with all but the k largest per row set to -inf (ties at the k-th kept)."""
  k = min(k, logits.shape[-1])
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_logits(logits: Array, p: float) -> Array:
  """logits [..., V] outside the nucleus set to -inf: the most likely tokens, in order, until
  their probabilities sum to at least p (the first token is always kept; ties with the last
  kept token are kept too)."""
  desc = jnp.sort(logits, axis=-1)[..., ::-1]
  probs = jax.nn.softmax(desc.astype(jnp.float32), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs                  # mass of the more likely tokens
  kept = jnp.sum(before < p, axis=-1, keepdims=True)           # >= 1
  threshold = jnp.take_along_axis(desc, kept - 1, axis=-1)
  return jnp.where(logits < threshold, -jnp.inf, logits)


def sample(logits: Array, key: Array | None, sampling: Sampling = GREEDY) -> Array:
  """Next tokens [B] int32 from logits [B, V]: argmax when greedy, else a draw from
  softmax(top_p(top_k(logits / temperature)))."""
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k is not None:
    logits = top_k_logits(logits, sampling.top_k)
  if sampling.top_p is not None:
    logits = top_p_logits(logits, sampling.top_p)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def decode(
    step: Step,
    cache: Any,
    tokens: Array,
    mask: Array,
    *,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    key: Array | None = None,
    stop_ids: Array | Sequence[int] | None = None,
    pad_id: int = 0,
    on_token: Callable[[Array], None] | None = None,
) -> tuple[Array, Array]:
  """Continues left-padded prompts: one prefill call, then single-token steps.

  Args:
    step: the model (see the module docstring); called on the prompt, then on [B, 1] tokens.
    cache: an empty KV cache with room for T + G tokens.
    tokens: [B, T] int32 left-padded prompts; mask: [B, T] bool, False on the pads.
    max_new_tokens: G (static), >= 1.
    sampling: greedy by default.
    key: `jax.random` key, required unless greedy; token i draws with fold_in(key, i).
    stop_ids: None: exactly G tokens per row (`lax.scan`). Otherwise [E] int ids (may be empty):
      a row stops after its first stop id and is padded with pad_id; the loop ends when every row
      has stopped (`lax.while_loop`).
    pad_id: written after a row's stop id (and fed to the model for stopped rows).
    on_token: None, or called (through `jax.debug.callback`) with the index of each new token,
      e.g. to advance a progress bar.

  Returns:
    (new tokens [B, G] int32; lengths [B] int32, tokens up to and including the first stop id).

  Raises:
    ValueError: max_new_tokens < 1, or no key for sampling.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if not sampling.greedy and key is None:
    raise ValueError(f"sampling with temperature={sampling.temperature} needs a jax.random key")
  b = tokens.shape[0]
  draw = lambda logits, i: sample(logits, None if key is None else jax.random.fold_in(key, i),
                                  sampling)
  tick = (lambda i: None) if on_token is None else (lambda i: jax.debug.callback(on_token, i))
  ones = jnp.ones((b, 1), bool)
  logits, cache = step(tokens, mask, cache)                                   # prefill
  first = draw(logits, 0)                                                     # [B]
  tick(0)

  if stop_ids is None:
    def scan_step(carry, i):
      tok, cache = carry
      logits, cache = step(tok[:, None], ones, cache)
      nxt = draw(logits, i)
      tick(i)
      return (nxt, cache), nxt

    _, rest = jax.lax.scan(scan_step, (first, cache), jnp.arange(1, max_new_tokens))
    out = jnp.concatenate([first[:, None], rest.T], axis=1)                   # [B, G]
    return out, jnp.full((b,), max_new_tokens, jnp.int32)

  stop_ids = jnp.asarray(stop_ids, jnp.int32).reshape(-1)
  out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = jnp.isin(first, stop_ids)
  lengths = jnp.where(done, 1, max_new_tokens).astype(jnp.int32)

  def cond(state):
    i, _, done, _, _, _ = state
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(state):
    i, prev, done, cache, out, lengths = state
    logits, cache = step(prev[:, None], ones, cache)
    nxt = jnp.where(done, pad_id, draw(logits, i))
    tick(i)
    out = out.at[:, i].set(nxt)
    hit = ~done & jnp.isin(nxt, stop_ids)
    lengths = jnp.where(hit, i + 1, lengths)
    return i + 1, nxt, done | hit, cache, out, lengths

  state = (jnp.asarray(1, jnp.int32), first, done, cache, out, lengths)
  _, _, _, _, out, lengths = jax.lax.while_loop(cond, body, state)
  return out, lengths


# Default cache lengths are a multiple of this: the split-K decoding kernel's key tile
# (`pallas_kernels.decode_attention`), so it reads the cache in place rather than a padded copy.
CACHE_BLOCK = 128


def cache_length(prompt_len: int, max_new_tokens: int, cache_len: int | None = None) -> int:
  """The KV cache length S for T prompt and G new tokens: cache_len, default T + G rounded up
  to a multiple of CACHE_BLOCK.

  Raises:
    ValueError: max_new_tokens < 1, or T + G > cache_len (naming the limit).
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if cache_len is None:
    cache_len = -(-(prompt_len + max_new_tokens) // CACHE_BLOCK) * CACHE_BLOCK
  if prompt_len + max_new_tokens > cache_len:
    raise ValueError(f"prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} does "
                     f"not fit a KV cache of {cache_len} slots")
  return cache_len


def check_token_ids(tokens, vocab_size: int, mask=None) -> None:
  """Refuses token ids that are not integers or not in [0, vocab_size) (concrete arrays only).

  Args:
    tokens: [B, T] ids (a traced array is not checked).
    vocab_size: V.
    mask: None or [B, T] bool; only positions where it is True are checked (pads are free).

  Raises:
    TypeError: non-integer ids (e.g. text, floats). ValueError: an id outside [0, V), named
    with its [row, position].
  """
  if isinstance(tokens, jax.core.Tracer):
    return
  ids = np.atleast_2d(np.asarray(tokens))
  if not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
    raise TypeError(f"prompt tokens must be integer token ids, got {ids.dtype} (encode text "
                    "with the model's tokenizer first)")
  bad = (ids < 0) | (ids >= vocab_size)
  if mask is not None and not isinstance(mask, jax.core.Tracer):
    bad &= np.asarray(mask, bool)
  if bad.any():
    row, pos = (int(i) for i in np.argwhere(bad)[0])
    raise ValueError(_bad_id(int(ids[row, pos]), row, pos, vocab_size))


def _bad_id(token: int, row: int, pos: int, vocab_size: int) -> str:
  return (f"token id {token} at [row, position] [{row}, {pos}] is outside the vocabulary "
          f"[0, {vocab_size})")


def _as_prompts(prompts) -> list[list[int]]:
  """Prompts as lists of Python ints; TypeError for text or non-integer ids."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray,
                                                                   jax.Array)):
    raise TypeError(f"prompts must be a batch of lists of token ids (e.g. [[1, 2, 3]]), got "
                    f"{type(prompts).__name__}; encode text with the model's tokenizer first")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, (str, bytes)):
      raise TypeError(f"prompt {i} is text ({type(p).__name__}); give token ids (encode text "
                      "with the model's tokenizer first)")
    ids = np.asarray(p)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
      raise TypeError(f"prompt {i} must be a flat list of int token ids, got {ids.dtype} "
                      f"shape {ids.shape}")
    out.append(ids.astype(np.int64).tolist())
  return out


def bucket_length(n: int, bucket: int = 64) -> int:
  """Rounds a prompt length up to a multiple of `bucket` (one compilation per bucket)."""
  return max(bucket, int(math.ceil(n / bucket)) * bucket)


def left_pad(prompts: Sequence[Sequence[int]], length: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """([B, length] int32 tokens, [B, length] bool mask), prompts right-aligned."""
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    if len(p):
      tokens[i, length - len(p):] = p
      mask[i, length - len(p):] = True
  return tokens, mask


def generate_ids(
    run: Callable[[Array, Array], tuple[Array, Array]],
    prompts: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    max_new_tokens: int,
    pad_id: int,
    bucket: int = 64,
    max_cache_len: int | None = None,
) -> list[list[int]]:
  """Lists of token ids through a `decode` call on left-padded arrays, and back.

  Args:
    run: (tokens [B, T] int32, mask [B, T] bool) -> `decode`'s (new tokens, lengths).
    prompts: B lists of token ids, each non-empty.
    vocab_size: V, for the id check.
    max_new_tokens: G.
    pad_id: left-padding id; never attended to.
    bucket: prompt lengths are padded up to a multiple of this.
    max_cache_len: optional upper bound on prompt + generated tokens (the KV cache length).

  Returns:
    B lists of new token ids (up to and including a stop id).

  Raises:
    TypeError: text or non-integer ids. ValueError: no prompts, an empty prompt, an id outside
    [0, V), max_new_tokens < 1, or a prompt plus max_new_tokens longer than max_cache_len.
  """
  prompts = _as_prompts(prompts)
  if not prompts:
    raise ValueError("prompts is empty: give at least one prompt")
  if any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  for row, p in enumerate(prompts):
    bad = [j for j, t in enumerate(p) if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(_bad_id(p[bad[0]], row, bad[0], vocab_size))
  longest = max(len(p) for p in prompts)
  if max_cache_len is not None and longest + max_new_tokens > max_cache_len:
    raise ValueError(f"prompt of {longest} tokens plus max_new_tokens={max_new_tokens} is longer "
                     f"than the KV cache (max_cache_len={max_cache_len})")
  length = bucket_length(longest, bucket)
  if max_cache_len is not None:
    length = min(length, max_cache_len - max_new_tokens)
  tokens, mask = left_pad(prompts, length, pad_id)
  out, lengths = run(jnp.asarray(tokens), jnp.asarray(mask))
  out, lengths = np.asarray(out), np.asarray(lengths)
  return [out[i, :lengths[i]].tolist() for i in range(len(prompts))]


def transformer_step(config: ModelConfig, params: Any,
                     rope_multipliers: Array | None = None) -> Step:
  """A `pope_jax.Transformer` as a `Step`: last-position logits [B, V] float32 and the cache."""
  model = Transformer(config)

  def step(tokens, mask, cache):
    logits, cache = model.apply({"params": params}, tokens, attention_mask=mask, cache=cache,
                                rope_multipliers=rope_multipliers, logits_to_keep=1)
    return logits[:, -1].astype(jnp.float32), cache

  return step


def transformer_decode(
    config: ModelConfig,
    params: Any,
    tokens: Array,
    mask: Array,
    *,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    key: Array | None = None,
    stop_ids: Array | None = None,
    rope_multipliers: Array | None = None,
    pad_id: int = 0,
    cache_len: int | None = None,
    on_token: Callable[[Array], None] | None = None,
) -> tuple[Array, Array]:
  """`decode` for a `pope_jax.Transformer` on left-padded arrays (compiled once per config,
  shapes and sampling).

  Args:
    config, params: the model.
    tokens: [B, T] int32 left-padded prompts; mask: [B, T] bool.
    cache_len: S >= T + G (default T + G rounded up to a multiple of CACHE_BLOCK).
    Others: as in `decode`; rope_multipliers None, [], [L] or [L, N] float (traced).

  Returns:
    (new tokens [B, G] int32, lengths [B] int32).

  Raises:
    ValueError: the prompt plus max_new_tokens does not fit cache_len; a concrete prompt id
      outside [0, V). TypeError: non-integer concrete prompt ids.
  """
  check_token_ids(tokens, config.vocab_size, mask)
  return _transformer_decode_jit(
      config, params, tokens, mask, max_new_tokens=max_new_tokens, sampling=sampling, key=key,
      stop_ids=stop_ids, rope_multipliers=rope_multipliers, pad_id=pad_id, cache_len=cache_len,
      on_token=on_token)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "sampling", "pad_id",
                                             "cache_len", "on_token"))
def _transformer_decode_jit(config, params, tokens, mask, *, max_new_tokens, sampling, key,
                            stop_ids, rope_multipliers, pad_id, cache_len, on_token):
  cache_len = cache_length(tokens.shape[1], max_new_tokens, cache_len)
  cache = init_cache(config, tokens.shape[0], cache_len)
  return decode(transformer_step(config, params, rope_multipliers), cache, tokens, mask,
                max_new_tokens=max_new_tokens, sampling=sampling, key=key, stop_ids=stop_ids,
                pad_id=pad_id, on_token=on_token)


def generate(
    config: ModelConfig,
    params: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: Array | None = None,
    stop_ids: Sequence[int] = (),
    rope_multipliers: Array | None = None,
    pad_id: int = 0,
    bucket: int = 64,
    max_cache_len: int | None = None,
    on_token: Callable[[Array], None] | None = None,
) -> list[list[int]]:
  """Continuations of token-id prompts by a `pope_jax.Transformer` (RoPE, PoPE or none).

  Args:
    config, params: the model (`Transformer(config)`, params from training).
    prompts: B lists of token ids, each non-empty.
    max_new_tokens: G.
    temperature, top_k, top_p: see `Sampling` (temperature 0: greedy).
    key: `jax.random` key, required when temperature > 0.
    stop_ids: a row stops after its first one (the id is included in its output).
    rope_multipliers: None, [], [L] or [L, N] frequency multipliers.
    pad_id, bucket, max_cache_len: see `generate_ids`.
    on_token: progress callback, see `decode`.

  Returns:
    B lists of new token ids.

  Raises:
    TypeError, ValueError: see `generate_ids` and `Sampling`; non-finite concrete multipliers.
  """
  sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
  if not sampling.greedy and key is None:
    raise ValueError(f"sampling with temperature={temperature} needs a jax.random key")
  encodings.check_finite_multipliers(rope_multipliers, "rope_multipliers")
  run = lambda tokens, mask: _transformer_decode_jit(
      config, params, tokens, mask, max_new_tokens=max_new_tokens, sampling=sampling, key=key,
      stop_ids=jnp.asarray(tuple(stop_ids), jnp.int32), rope_multipliers=rope_multipliers,
      pad_id=pad_id, cache_len=None, on_token=on_token)
  return generate_ids(run, prompts, vocab_size=config.vocab_size, max_new_tokens=max_new_tokens,
                      pad_id=pad_id, bucket=bucket, max_cache_len=max_cache_len)
