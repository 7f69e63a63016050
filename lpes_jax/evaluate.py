"""LPES search examples and the held-out lost-in-the-middle evaluation of a Llama model.

    batch = search_batch(task, tok, config, num_examples=200, seed=0)   # for lpes_jax.fitness
    gen = method_generator("lpes", config, params, EvalConfig(scales="results.json"))
    record = evaluate_positions(gen, tok, config, task, EvalConfig(...))

Every method decodes through `lpes_jax.generate` (base, PI, LPES: `greedy_tokens` with their
multipliers; Ms-PoE: per-prompt multipliers from `baselines.ms_poe_multipliers`) or
`baselines.buckets_greedy` (Attention Buckets); MoICE decodes through `greedy_tokens` with the
trained routers' attention (`lpes_jax.moice`). Outputs are cut at the first EOS and scored with
the task's LitM metric.

Shape letters: B batch, T prompt length, G new tokens, L layers, N query heads.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lpes_jax import baselines, fitness, generate, moice, search
from pope_jax import generation
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import Llama
from lpes_jax.tasks import begin_middle_end, position_indices
from lpes_jax.tasks.task import (ANSWER_PREFIX, TaskConfig, answer_text, encode_prompt,
                                 num_items, score, task_examples)

METHODS = ("base", "pi", "ms_poe", "buckets", "lpes", "moice")


def search_batch(task: TaskConfig, tok, config: LlamaConfig, *, num_examples: int, seed: int,
                 answer_prefix: str | None = None) -> fitness.FitnessBatch:
  """The begin/middle/end search examples: prompts and `<answer_prefix><answer>` targets.

  Args:
    task, tok, config: the task, tokenizer and model config (pad id, context length).
    num_examples: split over the three subsets as evenly as possible (the first get the rest).
    seed: KV example seed / MDQA sample seed.
    answer_prefix: default `ANSWER_PREFIX[task.task]`.

  Raises:
    ValueError: see `fitness.make_batch`.
  """
  prefix = ANSWER_PREFIX[task.task] if answer_prefix is None else answer_prefix
  prompts, answers, subset = [], [], []
  gold = begin_middle_end(num_items(task))
  for s, name in enumerate(fitness.SUBSETS):
    n = num_examples // 3 + (1 if s < num_examples % 3 else 0)
    for e in task_examples(task, gold[name], n, seed):
      prompts.append(encode_prompt(tok, e.prompt, task.chat))
      answers.append(tok.encode(prefix + answer_text(task, e), add_bos=False))
      subset.append(s)
  return fitness.make_batch(prompts, answers, subset, pad_id=config.pad_token_id or 0,
                            max_len=config.max_position_embeddings)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
  """Held-out evaluation settings (defaults: the CLI's).

  Attributes:
    method: one of METHODS.
    scales: results.json of an LPES search (method "lpes").
    num_examples: held-out examples per gold position.
    positions: gold positions (default: 5 evenly spaced, first and last included).
    seed: held-out seed (the search uses 0).
    batch_size: rows per generation call (the last batch is filled with copies, not scored).
    max_new_tokens: tokens generated per example.
    pi_scale: PI's global scale s.
    ms_poe_official: Ms-PoE indexes its ratio table with the argsort (released code).
    buckets_absolute: Attention Buckets uses the RAG bases as is.
    prompt_len: pad every prompt to this many tokens (one compiled shape for several positions
      and tasks); default: the longest prompt of each position rounded up to 32.
    moice_routers: folder of trained MoICE routers (method "moice"; `experiments.moice_train`).
  """
  method: str = "base"
  scales: str | None = None
  num_examples: int = 500
  positions: tuple[int, ...] | None = None
  seed: int = 1
  batch_size: int = 16
  max_new_tokens: int = 48
  pi_scale: float = 1.5
  ms_poe_official: bool = False
  buckets_absolute: bool = False
  prompt_len: int | None = None
  moice_routers: str | None = None

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"EvalConfig.method must be one of {METHODS}, got {self.method!r}")
    if self.method == "lpes" and not self.scales:
      raise ValueError("EvalConfig.method 'lpes' needs scales (a search's results.json)")
    if self.method == "moice" and not self.moice_routers:
      raise ValueError("EvalConfig.method 'moice' needs moice_routers (a moice_train folder)")
    if self.num_examples < 1:
      raise ValueError(f"EvalConfig.num_examples must be >= 1, got {self.num_examples}")


Generator = Callable[[np.ndarray, np.ndarray, int], jax.Array]


def method_generator(config: LlamaConfig, params: Any, ev: EvalConfig) -> Generator:
  """(tokens [B, T], mask [B, T], G) → greedy tokens [B, G] int32 of the method, jitted.

  Raises:
    ValueError: an LPES scales file that does not load or has another number of layers.
    FileNotFoundError, ValueError, moice.RoutersMismatch: MoICE routers that do not load or do
      not fit the model.
  """
  greedy = functools.partial(generate.greedy_tokens, config)
  if ev.method in ("base", "pi", "lpes"):
    if ev.method == "base":
      mult = None
    elif ev.method == "pi":
      mult = jnp.asarray(baselines.pi_multipliers(ev.pi_scale))
    else:
      mult = search.load_multipliers(ev.scales)
      if mult.shape != (config.num_layers,):
        raise ValueError(f"{ev.scales}: {mult.shape[0]} scales, but the model has "
                         f"{config.num_layers} layers")
      mult = jnp.asarray(mult)
    fn = jax.jit(lambda p, t, m, n: greedy(p, t, m, mult, n), static_argnums=3)
  elif ev.method == "ms_poe":
    ms = baselines.MsPoEConfig(official_indexing=ev.ms_poe_official)
    model = Llama(config)

    def ms_poe(p, t, m, n):
      mults = baselines.ms_poe_multipliers(model, p, t, m, ms)                 # [B, L, N]
      row = lambda ti, mi, mu: greedy(p, ti[None], mi[None], mu, n)[0]
      return jax.vmap(row)(t, m, mults)
    fn = jax.jit(ms_poe, static_argnums=3)
  elif ev.method == "moice":
    routers, mcfg = moice.load_routers(ev.moice_routers, config)
    run = jax.jit(lambda p, r, t, m, n: greedy(
        p, t, m, None, n, attention=moice.moice_attention(r, config, mcfg)), static_argnums=4)
    fn = lambda p, t, m, n: run(p, routers, t, m, n)
  else:
    bases = baselines.bucket_bases(config.rope_theta, relative=not ev.buckets_absolute)
    fn = jax.jit(lambda p, t, m, n: baselines.buckets_greedy(config, bases, p, t, m, n),
                 static_argnums=3)
  return lambda t, m, n: fn(params, t, m, n)


def held_out_batches(tok, config: LlamaConfig, task: TaskConfig, gold: int, ev: EvalConfig):
  """The held-out examples at one gold position as fixed-shape batches.

  Yields:
    (examples (at most ev.batch_size), tokens [ev.batch_size, T] int32 left-padded, mask [.., T]
    bool); T is ev.prompt_len or the longest prompt rounded up to 32 (one compiled shape per
    position), the last batch filled with copies of its first row (not scored).

  Raises:
    ValueError: a prompt plus ev.max_new_tokens longer than the model's context, or longer than
      ev.prompt_len.
  """
  exs = task_examples(task, gold, ev.num_examples, ev.seed)
  ids = [encode_prompt(tok, e.prompt, task.chat) for e in exs]
  longest = max(map(len, ids))
  if longest + ev.max_new_tokens > config.max_position_embeddings:
    raise ValueError(f"prompt of {longest} tokens + {ev.max_new_tokens} new tokens exceeds the "
                     f"model's context of {config.max_position_embeddings}: use fewer pairs")
  length = -(-longest // 32) * 32 if ev.prompt_len is None else ev.prompt_len
  if length < longest:
    raise ValueError(f"EvalConfig.prompt_len {length} is shorter than a prompt of {longest} "
                     f"tokens")
  for b in range(0, len(ids), ev.batch_size):
    chunk = ids[b:b + ev.batch_size]
    chunk = chunk + [chunk[0]] * (ev.batch_size - len(chunk))
    t, m = generation.left_pad(chunk, length, config.pad_token_id or 0)
    yield exs[b:b + ev.batch_size], t, m


def score_outputs(tok, config: LlamaConfig, task: TaskConfig, examples, out) -> list[tuple]:
  """(LitM score, text) of each example's generated tokens [>= len(examples), G], cut at EOS."""
  eos = set(config.eos_token_ids)
  scored = []
  for e, o in zip(examples, np.asarray(out)):
    o = list(o)
    stop = next((i for i, x in enumerate(o) if x in eos), len(o))
    text = tok.decode(o[:stop])
    scored.append((score(task, text, e), text))
  return scored


def evaluate_positions(gen: Generator, tok, config: LlamaConfig, task: TaskConfig,
                       ev: EvalConfig, *, log: Callable[[str], None] = print) -> dict:
  """Accuracy per gold position of one method.

  Returns:
    A JSON-able record: "accuracy" {gold: mean score}, "scores" {gold: per-example scores},
    "positions", "num_items", "samples" (the first three outputs per position), timing
    ("seconds_per_batch_median" over all batches but the first,
    "first_batch_seconds_with_compile") and the settings.

  Raises:
    ValueError: a prompt plus max_new_tokens longer than the model's context.
  """
  n_items = num_items(task)
  positions = list(ev.positions) if ev.positions else position_indices(n_items, 5)
  acc, timing, samples, all_scores = {}, [], {}, {}
  for gold in positions:
    scores = []
    for b, (exs, t, m) in enumerate(held_out_batches(tok, config, task, gold, ev)):
      t0 = time.perf_counter()
      out = np.asarray(jax.block_until_ready(gen(t, m, ev.max_new_tokens)))
      timing.append({"gold": gold, "batch": b * ev.batch_size,
                     "seconds": time.perf_counter() - t0, "prompt_len": t.shape[1]})
      for sc, text in score_outputs(tok, config, task, exs, out):
        scores.append(sc)
        if len(samples.setdefault(str(gold), [])) < 3:
          samples[str(gold)].append(text)
    acc[str(gold)] = float(np.mean(scores))
    all_scores[str(gold)] = scores
    log(f"  {ev.method:8s} gold {gold:4d}: {acc[str(gold)]:.3f}  ({len(scores)} examples)")
  steady = [x["seconds"] for x in timing[1:]] or [timing[0]["seconds"]]
  return {
      "method": ev.method, "task": task.task, "accuracy": acc, "scores": all_scores,
      "num_examples": ev.num_examples, "positions": positions, "num_items": n_items,
      "samples": samples, "seconds_per_batch_median": float(np.median(steady)),
      "batch_size": ev.batch_size, "first_batch_seconds_with_compile": timing[0]["seconds"],
  }


def multipliers_generator(config: LlamaConfig, params: Any):
  """(multipliers [M, L], tokens [B, T], mask [B, T], G) → greedy tokens [M, B, G] int32: M
  multiplier sets decoded in one jitted call (`jax.vmap` over the sets)."""
  greedy = functools.partial(generate.greedy_tokens, config)
  fn = jax.jit(jax.vmap(lambda mult, t, m, n: greedy(params, t, m, mult, n),
                        in_axes=(0, None, None, None)), static_argnums=3)
  return lambda mults, t, m, n: fn(jnp.asarray(mults, jnp.float32), t, m, n)


def evaluate_multipliers(gen, tok, config: LlamaConfig, task: TaskConfig, ev: EvalConfig,
                         multipliers, *, log: Callable[[str], None] = print
                         ) -> dict[str, np.ndarray]:
  """Per-example LitM scores of M fixed per-layer multiplier sets (LPES scales, PI, base = 1),
  all decoded together: each batch is one call of `gen` (`multipliers_generator`); `ev.method`
  is unused.

  Args:
    multipliers: [M, L] float frequency multipliers 1/s.

  Returns:
    {gold: [M, ev.num_examples] float64 scores} for each gold position.

  Raises:
    ValueError: multipliers not [M, L] for the model's L; see `held_out_batches`.
  """
  mults = np.asarray(multipliers, np.float32)
  if mults.ndim != 2 or mults.shape[1] != config.num_layers:
    raise ValueError(f"multipliers must have shape [M, {config.num_layers}], got {mults.shape}")
  positions = list(ev.positions) if ev.positions else position_indices(num_items(task), 5)
  out = {}
  for gold in positions:
    rows = [[] for _ in mults]
    for exs, t, m in held_out_batches(tok, config, task, gold, ev):
      tokens = np.asarray(gen(mults, t, m, ev.max_new_tokens))                # [M, B, G]
      for row, toks in zip(rows, tokens):
        row.extend(sc for sc, _ in score_outputs(tok, config, task, exs, toks))
    out[str(gold)] = np.asarray(rows, np.float64)
    log(f"  {len(mults)} multiplier sets, gold {gold:4d}: mean accuracy "
        f"{out[str(gold)].mean(1).round(3).tolist()}")
  return out


def plot_positions(records: list[dict], path: str) -> None:
  """Accuracy vs gold position, one line per record (the lost-in-the-middle curve)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for r in records:
    xs = [int(g) for g in r["accuracy"]]
    ax.plot(xs, list(r["accuracy"].values()), "o-", label=r["method"])
  ax.set_xlabel("gold position")
  ax.set_ylabel("accuracy")
  ax.set_ylim(-0.02, 1.02)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
