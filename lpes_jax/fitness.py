"""LPES fitness: search examples as token arrays, scored for a whole population in one call.

The fitness of a population is one jitted program (`make_fitness_fn`; `fitness_fn_factory` shares
it between batches of one shape): `jax.vmap` over a call's candidates' multipliers, the candidate
axis sharded over all local devices (a 1-D `Mesh` named "candidates"), examples batched within a
device and looped with `lax.map`. Two modes:
  * "teacher_forced": one forward pass over prompt + gold answer tokens; an example counts iff the
    argmax at every answer position is the next gold token — exactly when greedy decoding would
    produce the gold answer tokens first. Rows are right-padded, so the forward is a plain causal
    call (no mask, default positions), which fused attention runs;
  * "greedy": real greedy decoding (KV cache) of as many tokens as the longest answer, counted iff
    the first answer-length generated tokens equal the answer tokens.
The model enters as two functions (ForwardFn, GreedyFn): for Llama, `llama_fitness_fns(config)`;
any causal model taking `rope_multipliers` works through `full_logits_forward`.

Shape letters: P population, L layers, N heads, E examples, T tokens, W answer window, V vocabulary,
S subsets (begin, middle, end).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lpes_jax import generate
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import Llama

SUBSETS = ("begin", "middle", "end")
FITNESS_MODES = ("teacher_forced", "greedy")


@dataclasses.dataclass(frozen=True)
class FitnessBatch:
  """Search examples as left-padded token arrays (numpy).

  Attributes:
    prompt_tokens: [E, T] int32 prompts, left-padded.
    prompt_mask: [E, T] bool, False on padding.
    answer_tokens: [E, W] int32 gold answer tokens, right-padded with 0.
    answer_mask: [E, W] bool, False on answer padding.
    subset: [E] int32 index into SUBSETS.
  """
  prompt_tokens: np.ndarray
  prompt_mask: np.ndarray
  answer_tokens: np.ndarray
  answer_mask: np.ndarray
  subset: np.ndarray

  @property
  def num_examples(self) -> int:
    return self.prompt_tokens.shape[0]


def make_batch(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
               subset: Sequence[int], *, pad_id: int = 0,
               max_len: int | None = None) -> FitnessBatch:
  """Left-pads tokenised prompts and right-pads answers into a `FitnessBatch`.

  Raises:
    ValueError: empty prompt or answer, mismatched lengths, or prompt + answer longer than
      `max_len` (the model's context).
  """
  if not (len(prompts) == len(answers) == len(subset)) or not prompts:
    raise ValueError(f"need equally many (>0) prompts, answers and subset ids, got "
                     f"{len(prompts)}, {len(answers)}, {len(subset)}")
  T = max(len(p) for p in prompts)
  W = max(len(a) for a in answers)
  if min(len(p) for p in prompts) == 0 or min(len(a) for a in answers) == 0:
    raise ValueError("prompts and answers must be non-empty token lists")
  if max_len is not None and T + W > max_len:
    raise ValueError(f"prompt ({T} tokens) + answer ({W}) exceeds the model's context of "
                     f"{max_len} tokens: use fewer pairs/documents")
  E = len(prompts)
  tok = np.full((E, T), pad_id, np.int32)
  mask = np.zeros((E, T), bool)
  ans = np.zeros((E, W), np.int32)
  amask = np.zeros((E, W), bool)
  for e, (p, a) in enumerate(zip(prompts, answers)):
    tok[e, T - len(p):] = p
    mask[e, T - len(p):] = True
    ans[e, :len(a)] = a
    amask[e, :len(a)] = True
  return FitnessBatch(tok, mask, ans, amask, np.asarray(subset, np.int32))


# A teacher-forced forward: (params, tokens [B, T] right-padded, multipliers [L] or [L, N],
# at [B, W] int32 positions) → the logits at those positions [B, W, V] (float32).
ForwardFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]
# Greedy decoding: (params, tokens [B, T], mask [B, T], multipliers, num_new) → [B, num_new]
# int32.
GreedyFn = Callable[[Any, jax.Array, jax.Array, jax.Array, int], jax.Array]

# Teacher-forced rows are padded to a multiple of this many tokens: few compiled shapes, little
# padding on short rows (SmolLM2's KV prompts are ~170 tokens).
LENGTH_BUCKET = 16


def teacher_forced_inputs(batch: FitnessBatch, *, bucket: int = LENGTH_BUCKET):
  """Prompt + answer (its last token dropped) per row, from position 0, right-padded.

  A causal model reads a right-padded row exactly as the unpadded one: no token attends to the
  padding after it, and positions start at 0 with no mask. So the forward is a plain causal
  call, which fused attention (cuDNN) runs. The width is the batch's padded prompt length plus
  W − 1 rounded up to `bucket`, so batches padded alike (`pad_batch`) share one shape.

  Returns:
    tokens [E, T'] int32 (pads are id 0, never read by a real token), at [E, W] int32 (the
    position whose logits predict each answer slot), targets [E, W] int32 (gold answer tokens,
    right-aligned), target_mask [E, W] bool.
  """
  E, T = batch.prompt_tokens.shape
  W = batch.answer_tokens.shape[1]
  width = -(-(T + W - 1) // bucket) * bucket
  tokens = np.zeros((E, width), np.int32)
  at = np.zeros((E, W), np.int32)
  targets = np.zeros((E, W), np.int32)
  tmask = np.zeros((E, W), bool)
  for e in range(E):
    p = batch.prompt_tokens[e][batch.prompt_mask[e]]
    a = batch.answer_tokens[e][batch.answer_mask[e]]
    seq = np.concatenate([p, a])[:-1]
    tokens[e, :len(seq)] = seq
    # Slot w (right-aligned answers) is predicted by the logits at len(seq) − W + w.
    at[e] = np.maximum(len(seq) - W + np.arange(W), 0)
    targets[e, W - len(a):] = a
    tmask[e, W - len(a):] = True
  return tokens, at, targets, tmask


def teacher_forced_correct(forward: ForwardFn, params, multipliers, tokens, at, targets,
                           target_mask) -> jax.Array:
  """[E] bool: every answer token is the argmax of the logits one position earlier (see
  `teacher_forced_inputs`); padding slots of short answers are ignored."""
  logits = forward(params, tokens, multipliers, at)                          # [E, W, V]
  hit = jnp.argmax(logits, axis=-1) == targets
  return jnp.all(hit | ~target_mask, axis=-1)


def greedy_correct(greedy: GreedyFn, params, multipliers, prompt_tokens, prompt_mask,
                   answer_tokens, answer_mask) -> jax.Array:
  """[E] bool: the first answer-length greedy tokens equal the answer tokens."""
  out = greedy(params, prompt_tokens, prompt_mask, multipliers, answer_tokens.shape[1])
  return jnp.all((out == answer_tokens) | ~answer_mask, axis=-1)


def candidate_mesh(devices=None) -> Mesh:
  """A 1-D mesh named "candidates" over the given (default: all local) devices."""
  devices = jax.local_devices() if devices is None else devices
  return Mesh(np.asarray(devices), ("candidates",))


def _chunks(x: np.ndarray, size: int) -> np.ndarray:
  """[E, ...] → [ceil(E/size), size, ...], padding by repeating row 0 (masked out later)."""
  E = x.shape[0]
  n = -(-E // size)
  pad = n * size - E
  if pad:
    x = np.concatenate([x, np.repeat(x[:1], pad, axis=0)], axis=0)
  return x.reshape(n, size, *x.shape[1:])


def make_fitness_fn(params, batch: FitnessBatch, **kwargs):
  """A function multipliers [P, L] (or [P, L, N]) → subset accuracies [P, S] (numpy float64) on
  `batch`: `fitness_fn_factory(params, **kwargs)(batch)` (see there for the arguments)."""
  return fitness_fn_factory(params, **kwargs)(batch)


def fitness_fn_factory(params, *, mode: str = "teacher_forced", forward: ForwardFn | None = None,
                       greedy: GreedyFn | None = None, example_batch: int = 8,
                       candidate_batch: int | None = None, mesh: Mesh | None = None):
  """batch → fitness function (multipliers [P, L] or [P, L, N] → subset accuracies [P, S] numpy
  float64), all batches sharing one jitted program: batches of one shape (e.g. the search sets
  of several seeds, padded alike with `pad_batch`) compile once.

  One jitted call scores `candidate_batch` candidates on every example: `jax.vmap` over the
  candidates, sharded over `mesh`, the examples looped in chunks of `example_batch` with
  `lax.map` inside each device, so one step runs the model on candidate_batch / devices ×
  example_batch rows. A population is scored in calls of that many candidates (the last call
  padded with copies of the first candidate), so the compiled shape does not depend on P.

  Args:
    params: model parameters (replicated on every device).
    mode: "teacher_forced" (needs `forward`) or "greedy" (needs `greedy`).
    forward, greedy: the model's forward / greedy decoder (see ForwardFn, GreedyFn); any model
      taking `rope_multipliers` works (Llama, the PoPE Transformer).
    example_batch: examples per forward within a device.
    candidate_batch: candidates per call, rounded up to a multiple of the device count; None:
      the whole population in one call (one compile per population size).
    mesh: device mesh with axis "candidates".

  Raises:
    ValueError: unknown mode, missing function, example_batch or candidate_batch < 1; (when
      called) a batch with an empty subset.
  """
  if mode not in FITNESS_MODES:
    raise ValueError(f"mode must be one of {FITNESS_MODES}, got {mode!r}")
  if mode == "teacher_forced" and forward is None:
    raise ValueError("mode='teacher_forced' needs a forward function")
  if mode == "greedy" and greedy is None:
    raise ValueError("mode='greedy' needs a greedy decoding function")
  for name, value in (("example_batch", example_batch), ("candidate_batch", candidate_batch)):
    if value is not None and value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  mesh = candidate_mesh() if mesh is None else mesh
  n_dev = mesh.devices.size
  if mode == "teacher_forced":
    correct_fn = lambda p, m, d: teacher_forced_correct(forward, p, m, *d)
  else:
    correct_fn = lambda p, m, d: greedy_correct(greedy, p, m, *d)

  def one_candidate(p, m, data, valid, onehot, counts):                     # m: [L] or [L, N]
    def chunk(args):
      d, v, oh = args
      ok = correct_fn(p, m, d) & v                                           # [chunk]
      return jnp.einsum("e,es->s", ok.astype(jnp.float32), oh)
    return jnp.sum(jax.lax.map(chunk, (data, valid, onehot)), axis=0) / counts   # [S]

  replicated = NamedSharding(mesh, PartitionSpec())
  by_candidate = NamedSharding(mesh, PartitionSpec("candidates"))
  population_fn = jax.jit(
      jax.vmap(one_candidate, in_axes=(None, 0, None, None, None, None)),
      in_shardings=(replicated, by_candidate) + (replicated,) * 4,
      out_shardings=by_candidate)
  params = jax.device_put(params, replicated)

  def for_batch(batch: FitnessBatch):
    counts = np.bincount(batch.subset, minlength=len(SUBSETS)).astype(np.float32)
    if np.any(counts == 0):
      raise ValueError(f"every subset needs examples, got counts {dict(zip(SUBSETS, counts))}")
    E = batch.num_examples
    n_chunks = -(-E // example_batch)  # `_chunks` pads the last chunk: those rows do not count
    valid = (np.arange(n_chunks * example_batch) < E).reshape(n_chunks, example_batch)
    onehot = _chunks(np.eye(len(SUBSETS), dtype=np.float32)[batch.subset], example_batch)
    if mode == "teacher_forced":
      data = tuple(_chunks(a, example_batch) for a in teacher_forced_inputs(batch))
    else:
      data = tuple(_chunks(a, example_batch) for a in (
          batch.prompt_tokens, batch.prompt_mask, batch.answer_tokens, batch.answer_mask))
    inputs = jax.device_put((data, valid, onehot, counts), replicated)

    def fitness(multipliers) -> np.ndarray:
      m = np.asarray(multipliers, np.float32)
      P = m.shape[0]
      size = P if candidate_batch is None else candidate_batch
      size = -(-size // n_dev) * n_dev
      n_calls = -(-P // size)
      m = _chunks(m, size)                                                   # [calls, size, ...]
      outs = [population_fn(params, jax.device_put(m[i], by_candidate), *inputs)
              for i in range(n_calls)]                                       # dispatched async
      return np.concatenate([np.asarray(o, np.float64) for o in outs])[:P]

    return fitness

  return for_batch


def pad_batch(batch: FitnessBatch, prompt_len: int, *, pad_id: int = 0) -> FitnessBatch:
  """`batch` with its prompts left-padded further to `prompt_len` tokens (masked out), so that
  batches of several seeds share one shape.

  Raises:
    ValueError: prompt_len shorter than the batch's prompts.
  """
  E, T = batch.prompt_tokens.shape
  if prompt_len < T:
    raise ValueError(f"pad_batch: prompt_len {prompt_len} < the batch's prompt length {T}")
  tokens = np.concatenate([np.full((E, prompt_len - T), pad_id, np.int32), batch.prompt_tokens],
                          axis=1)
  mask = np.concatenate([np.zeros((E, prompt_len - T), bool), batch.prompt_mask], axis=1)
  return dataclasses.replace(batch, prompt_tokens=tokens, prompt_mask=mask)


def llama_fitness_fns(config: LlamaConfig) -> tuple[ForwardFn, GreedyFn]:
  """(forward, greedy) of a Llama model: the logits at chosen positions of one plain causal
  forward (`Llama` without mask or cache: the path that `attention_implementation=None` runs
  on cuDNN), and `generate.greedy_tokens`."""
  model = Llama(config)

  def forward(params, tokens, multipliers, at):
    _, state = model.apply({"params": params}, tokens, rope_multipliers=multipliers,
                           logits_to_keep=1, mutable=["intermediates"])
    hidden = state["intermediates"]["hidden_states"][-1]                      # [B, T, D] normed
    hidden = jnp.take_along_axis(hidden, at[..., None], axis=1)               # [B, W, D]
    head = (params["embed_tokens"]["embedding"].T if config.tie_word_embeddings
            else params["lm_head"]["kernel"])                                 # [D, V]
    return jnp.dot(hidden, head).astype(jnp.float32)

  return forward, functools.partial(generate.greedy_tokens, config)


def full_logits_forward(apply_fn) -> ForwardFn:
  """ForwardFn from any causal `apply_fn(params, tokens, multipliers) → logits [B, T, V]` (e.g.
  the PoPE `pope_jax.model.Transformer`): computes all logits and keeps those at `at`."""

  def forward(params, tokens, multipliers, at):
    logits = apply_fn(params, tokens, multipliers)
    return jnp.take_along_axis(logits, at[..., None], axis=1).astype(jnp.float32)

  return forward
