"""Constrained genetic search for per-layer RoPE scales (LPES, arXiv 2606.27705 §3.2).

Genomes are Bézier control points (`lpes_jax.bezier`). One generation: keep the best
`num_parents` (elitism), then add `num_mutations` children by mutation (one control point: y moves
by at most ±`mutation_y_steps` grid steps, x moves inside its neighbours' open interval) and
`num_crossovers` children by crossover (each control point taken whole from one of two parents;
re-drawn while x is not strictly increasing). A child equal to any earlier individual is re-drawn.
Generation 0 is the identity curve (all s = 1) plus random valid curves. Fitness is the weighted
mean of the accuracies on the begin/middle/end subsets.

The fitness of a whole population is one jitted call (`make_fitness_fn`): `jax.vmap` over the
candidates' multipliers, the candidate axis sharded over all local devices (a 1-D `Mesh` named
"candidates"), examples batched within a device and looped with `lax.map`. Two modes:
  * "teacher_forced": one forward pass over prompt + gold answer tokens; an example counts iff the
    argmax at every answer position is the next gold token — exactly when greedy decoding would
    produce the gold answer tokens first;
  * "greedy": real greedy decoding (KV cache) of as many tokens as the longest answer, counted iff
    the first answer-length generated tokens equal the answer tokens.

The state (population, fitness, history, every individual seen, numpy RNG state) is written
atomically (temp file + os.replace) after every generation, so a run killed at any point resumes
from its last finished generation and continues exactly as if never stopped.

Defaults that are this project's choice (the paper's table was unreadable; LongRoPE's search shape):
population 32, 12 generations (generation 0 included), 16 parents, 8 + 8 children, ±2 grid steps,
weights 1/3 each.

Shape letters: P population, L layers, N heads, E examples, T tokens, W answer window, V vocabulary,
S subsets (begin, middle, end), C control points.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lpes_jax import bezier
from pope_jax import atomic
from pope_jax.config import config_diff

SUBSETS = ("begin", "middle", "end")
FITNESS_MODES = ("teacher_forced", "greedy")
STATE_FILE = "search_state.json"
RESULTS_FILE = "results.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchConfig:
  """Genetic-algorithm settings (defaults: assumption, see the module docstring).

  Attributes:
    population_size: individuals per generation.
    num_generations: generations evaluated, generation 0 (the initial population) included.
    num_parents: best individuals kept each generation (elitism).
    num_mutations, num_crossovers: children per generation by each operator.
    mutation_y_steps: the largest move of a control point's y, in grid steps.
    weights: fitness weights of the begin, middle and end subsets.
    seed: numpy RNG seed.
    max_redraws: attempts at a valid, new child before giving up with an error.
  """
  population_size: int = 32
  num_generations: int = 12
  num_parents: int = 16
  num_mutations: int = 8
  num_crossovers: int = 8
  mutation_y_steps: int = 2
  weights: tuple[float, ...] = (1 / 3, 1 / 3, 1 / 3)
  seed: int = 0
  max_redraws: int = 1000

  def __post_init__(self):
    object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
    for name in ("population_size", "num_generations", "num_parents", "max_redraws",
                 "mutation_y_steps"):
      if getattr(self, name) < 1:
        raise ValueError(f"SearchConfig.{name} must be >= 1, got {getattr(self, name)}")
    for name in ("num_mutations", "num_crossovers"):
      if getattr(self, name) < 0:
        raise ValueError(f"SearchConfig.{name} must be >= 0, got {getattr(self, name)}")
    total = self.num_parents + self.num_mutations + self.num_crossovers
    if total != self.population_size:
      raise ValueError(f"SearchConfig: num_parents + num_mutations + num_crossovers = {total} must "
                       f"equal population_size = {self.population_size}")
    if self.num_crossovers and self.num_parents < 2:
      raise ValueError("SearchConfig.num_parents must be >= 2 for crossover")
    w = np.asarray(self.weights)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
      raise ValueError(f"SearchConfig.weights must be finite, >= 0 and not all 0, got {self.weights}")


# ----------------------------------------------------------------------------------------------
# Genetic operators (numpy, seeded Generator).


def random_genome(rng: np.random.Generator, bez: bezier.BezierConfig) -> np.ndarray:
  """A uniformly drawn valid genome [C, 2]: strictly increasing x (ends pinned if configured)."""
  C, L, M = bez.num_control_points, bez.num_layers, bez.num_values
  if bez.pin_ends:
    inner = np.sort(rng.choice(np.arange(1, L - 1), size=C - 2, replace=False))
    x = np.concatenate([[0], inner, [L - 1]])
  else:
    x = np.sort(rng.choice(L, size=C, replace=False))
  y = rng.integers(0, M, size=C)
  return np.stack([x, y], axis=1).astype(np.int64)


def mutate(rng: np.random.Generator, genome: np.ndarray, bez: bezier.BezierConfig,
           y_steps: int) -> np.ndarray:
  """Moves one control point: y by a uniform step in [−y_steps, y_steps] \\ {0} (clipped to the
  grid), x uniformly inside its neighbours' open interval (pinned ends keep their x)."""
  g = np.array(genome, np.int64)
  C, L, M = bez.num_control_points, bez.num_layers, bez.num_values
  c = int(rng.integers(C))
  steps = np.concatenate([np.arange(-y_steps, 0), np.arange(1, y_steps + 1)])
  g[c, 1] = np.clip(g[c, 1] + rng.choice(steps), 0, M - 1)
  pinned = bez.pin_ends and c in (0, C - 1)
  if not pinned:
    lo = g[c - 1, 0] + 1 if c > 0 else 0
    hi = g[c + 1, 0] - 1 if c < C - 1 else L - 1
    g[c, 0] = rng.integers(lo, hi + 1)
  return g


def crossover(rng: np.random.Generator, a: np.ndarray, b: np.ndarray,
              bez: bezier.BezierConfig, max_redraws: int) -> np.ndarray:
  """Takes each control point whole from `a` or `b` (fair coin), re-drawing while x is not
  strictly increasing.

  Raises:
    RuntimeError: no monotone child in `max_redraws` draws.
  """
  for _ in range(max_redraws):
    pick = rng.integers(0, 2, size=a.shape[0]).astype(bool)
    child = np.where(pick[:, None], a, b)
    if np.all(np.diff(child[:, 0]) > 0):
      return child.astype(np.int64)
  raise RuntimeError(f"crossover found no monotone child in {max_redraws} draws")


def _key(genome) -> str:
  return ",".join(str(int(v)) for v in np.asarray(genome).ravel())


def _new_individual(draw: Callable[[], np.ndarray], seen: set[str], max_redraws: int,
                    what: str) -> np.ndarray:
  for _ in range(max_redraws):
    g = draw()
    if _key(g) not in seen:
      seen.add(_key(g))
      return g
  raise RuntimeError(f"no new {what} in {max_redraws} draws: the search space is exhausted "
                     "(increase the grid or layers, or lower the population)")


def initial_population(rng: np.random.Generator, bez: bezier.BezierConfig, cfg: SearchConfig,
                       seen: set[str]) -> np.ndarray:
  """[P, C, 2]: the identity curve, then random valid, distinct curves."""
  ident = bezier.identity_genome(bez)
  seen.add(_key(ident))
  pop = [ident]
  while len(pop) < cfg.population_size:
    pop.append(_new_individual(lambda: random_genome(rng, bez), seen, cfg.max_redraws,
                               "random genome"))
  return np.stack(pop)


def next_generation(rng: np.random.Generator, population: np.ndarray, fitness: np.ndarray,
                    bez: bezier.BezierConfig, cfg: SearchConfig, seen: set[str]):
  """Elitism + mutation + crossover. A crossover that finds no child not seen before in
  `cfg.max_redraws` draws (parents that differ in few control points) is replaced by a mutation.

  Raises:
    RuntimeError: no unseen mutation in `cfg.max_redraws` draws.

  Returns:
    (parents [num_parents, C, 2], parent fitness [num_parents], children [P − num_parents, C, 2]).
  """
  order = np.argsort(-np.asarray(fitness), kind="stable")[:cfg.num_parents]
  parents, parent_fit = population[order], np.asarray(fitness)[order]
  children = []
  mutation = lambda: mutate(rng, parents[rng.integers(len(parents))], bez, cfg.mutation_y_steps)
  for _ in range(cfg.num_mutations):
    children.append(_new_individual(mutation, seen, cfg.max_redraws, "mutation"))
  for _ in range(cfg.num_crossovers):
    def draw():
      i, j = rng.choice(len(parents), size=2, replace=False)
      return crossover(rng, parents[i], parents[j], bez, cfg.max_redraws)
    try:
      children.append(_new_individual(draw, seen, cfg.max_redraws, "crossover"))
    except RuntimeError:  # Few parents that differ in few points: every child already seen.
      children.append(_new_individual(mutation, seen, cfg.max_redraws,
                                      "mutation in place of a crossover"))
  return parents, parent_fit, np.stack(children)


# ----------------------------------------------------------------------------------------------
# Batches and the sharded population fitness.


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
               subset: Sequence[int], *, pad_id: int = 0, max_len: int | None = None) -> FitnessBatch:
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


# A forward: (params, tokens [B, T], mask [B, T], multipliers [L] or [L, N], window W) →
# logits of the last W positions [B, W, V] (float32).
ForwardFn = Callable[[Any, jax.Array, jax.Array, jax.Array, int], jax.Array]
# Greedy decoding: (params, tokens [B, T], mask [B, T], multipliers, num_new) → [B, num_new] int32.
GreedyFn = Callable[[Any, jax.Array, jax.Array, jax.Array, int], jax.Array]


def teacher_forced_inputs(batch: FitnessBatch):
  """Prompt + answer, the whole sequence left-padded so the answers end every row.

  Returns:
    tokens [E, T + W] int32, mask [E, T + W] bool, targets [E, W] int32 (gold answer tokens,
    right-aligned), target_mask [E, W] bool.
  """
  E, T = batch.prompt_tokens.shape
  W = batch.answer_tokens.shape[1]
  tokens = np.zeros((E, T + W), np.int32)
  mask = np.zeros((E, T + W), bool)
  targets = np.zeros((E, W), np.int32)
  tmask = np.zeros((E, W), bool)
  for e in range(E):
    p = batch.prompt_tokens[e][batch.prompt_mask[e]]
    a = batch.answer_tokens[e][batch.answer_mask[e]]
    seq = np.concatenate([p, a])
    tokens[e, T + W - len(seq):] = seq
    mask[e, T + W - len(seq):] = True
    targets[e, W - len(a):] = a
    tmask[e, W - len(a):] = True
  return tokens, mask, targets, tmask


def teacher_forced_correct(forward: ForwardFn, params, multipliers, tokens, mask, targets,
                           target_mask) -> jax.Array:
  """[E] bool: every answer token is the argmax of the logits one position earlier.

  The logits at positions T+W−W−1 … T+W−2 predict the tokens at the last W positions (the answer,
  right-aligned); padding slots of short answers are ignored.
  """
  W = targets.shape[1]
  logits = forward(params, tokens[:, :-1], mask[:, :-1], multipliers, W)        # [E, W, V]
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


def make_fitness_fn(params, batch: FitnessBatch, *, mode: str = "teacher_forced",
                    forward: ForwardFn | None = None, greedy: GreedyFn | None = None,
                    example_batch: int = 8, mesh: Mesh | None = None):
  """A function multipliers [P, L] (or [P, L, N]) → subset accuracies [P, S] (numpy float64).

  The whole population is one jitted call: `jax.vmap` over candidates, the candidate axis sharded
  over `mesh` (default: all local devices; P is padded to a multiple of the device count), the
  examples looped in chunks of `example_batch` with `lax.map` inside each device.

  Args:
    params: model parameters (replicated on every device).
    batch: the search examples.
    mode: "teacher_forced" (needs `forward`) or "greedy" (needs `greedy`).
    forward, greedy: the model's forward / greedy decoder (see ForwardFn, GreedyFn); any model
      taking `rope_multipliers` works (Llama, the PoPE Transformer).
    example_batch: examples per forward within a device.
    mesh: device mesh with axis "candidates".

  Raises:
    ValueError: unknown mode, missing function, empty subset.
  """
  if mode not in FITNESS_MODES:
    raise ValueError(f"mode must be one of {FITNESS_MODES}, got {mode!r}")
  if mode == "teacher_forced" and forward is None:
    raise ValueError("mode='teacher_forced' needs a forward function")
  if mode == "greedy" and greedy is None:
    raise ValueError("mode='greedy' needs a greedy decoding function")
  mesh = candidate_mesh() if mesh is None else mesh
  n_dev = mesh.devices.size
  counts = np.bincount(batch.subset, minlength=len(SUBSETS)).astype(np.float32)
  if np.any(counts == 0):
    raise ValueError(f"every subset needs examples, got counts {dict(zip(SUBSETS, counts))}")
  E = batch.num_examples
  n_chunks = -(-E // example_batch)  # `_chunks` pads the last chunk: those rows do not count
  valid = (np.arange(n_chunks * example_batch) < E).reshape(n_chunks, example_batch)
  onehot = _chunks(np.eye(len(SUBSETS), dtype=np.float32)[batch.subset], example_batch)
  if mode == "teacher_forced":
    data = tuple(_chunks(a, example_batch) for a in teacher_forced_inputs(batch))
    correct_fn = lambda p, m, d: teacher_forced_correct(forward, p, m, *d)
  else:
    data = tuple(_chunks(a, example_batch) for a in (
        batch.prompt_tokens, batch.prompt_mask, batch.answer_tokens, batch.answer_mask))
    correct_fn = lambda p, m, d: greedy_correct(greedy, p, m, *d)

  def one_candidate(p, m, data, valid, onehot):                             # m: [L] or [L, N]
    def chunk(args):
      d, v, oh = args
      ok = correct_fn(p, m, d) & v                                           # [chunk]
      return jnp.einsum("e,es->s", ok.astype(jnp.float32), oh)
    return jnp.sum(jax.lax.map(chunk, (data, valid, onehot)), axis=0) / counts   # [S]

  replicated = NamedSharding(mesh, PartitionSpec())
  by_candidate = NamedSharding(mesh, PartitionSpec("candidates"))
  population_fn = jax.jit(
      jax.vmap(one_candidate, in_axes=(None, 0, None, None, None)),
      in_shardings=(replicated, by_candidate, replicated, replicated, replicated),
      out_shardings=by_candidate)
  params = jax.device_put(params, replicated)
  data, valid, onehot = jax.device_put((data, valid, onehot), replicated)

  def fitness(multipliers) -> np.ndarray:
    m = np.asarray(multipliers, np.float32)
    P = m.shape[0]
    pad = (-P) % n_dev
    if pad:
      m = np.concatenate([m, np.repeat(m[:1], pad, axis=0)], axis=0)
    out = population_fn(params, jax.device_put(m, by_candidate), data, valid, onehot)
    return np.asarray(out, np.float64)[:P]

  return fitness


# ----------------------------------------------------------------------------------------------
# Search loop with atomic per-generation checkpoints.


def _rng_state(rng: np.random.Generator) -> dict:
  return rng.bit_generator.state


def _rng_from_state(state: dict) -> np.random.Generator:
  rng = np.random.default_rng()
  rng.bit_generator.state = state
  return rng


@dataclasses.dataclass
class SearchResult:
  """The best individual and the run's history.

  Attributes:
    genome: [C, 2] best control points; scales: [L] its per-layer scales; fitness: its fitness;
    subset_accuracy: its [S] accuracies; history: per generation best/mean fitness and time.
  """
  genome: np.ndarray
  scales: np.ndarray
  fitness: float
  subset_accuracy: np.ndarray
  history: list[dict]


def run_search(subset_accuracy_fn: Callable[[np.ndarray], np.ndarray],
               bez: bezier.BezierConfig, cfg: SearchConfig, workdir: str, *,
               resume: bool = False, progress: bool = True, extra: dict | None = None,
               fitness_id: dict | None = None, stop_after: int | None = None) -> SearchResult:
  """Runs (or resumes) the constrained GA, checkpointing after every generation.

  Args:
    subset_accuracy_fn: multipliers [P, L] → accuracies [P, S] (e.g. `make_fitness_fn`).
    bez: the curve space; cfg: GA settings.
    workdir: folder for search_state.json, results.json and the PNGs.
    resume: continue from workdir's state (must match bez/cfg); without it an existing state is
      an error, so that no finished generations are overwritten by accident.
    progress: tqdm bar per generation.
    extra: JSON-able run information stored in results.json.
    fitness_id: JSON-able description of what `subset_accuracy_fn` scores (model, task,
      examples, fitness mode): saved with the state, so that a resume against another model or
      task, whose fitness values would not compare, is refused.
    stop_after: stop after this generation index (used to test resumption).

  Raises:
    FileExistsError: a state exists and resume is False.
    ValueError: the saved state's settings (bez, cfg, fitness_id) differ; the message names the
      differing fields.
  """
  from tqdm import tqdm

  state_path = os.path.join(workdir, STATE_FILE)
  weights = np.asarray(cfg.weights) / np.sum(cfg.weights)
  signature = {"bezier": dataclasses.asdict(bez), "search": dataclasses.asdict(cfg),
               "fitness": fitness_id}
  signature = json.loads(json.dumps(signature))

  def evaluate(genomes):
    scales = np.asarray(bezier.curve_scales(genomes, bez))
    acc = np.asarray(subset_accuracy_fn(bezier.scales_to_multipliers(scales)), np.float64)
    if acc.shape != (len(genomes), len(SUBSETS)):
      raise ValueError(f"fitness function returned shape {acc.shape}, expected "
                       f"{(len(genomes), len(SUBSETS))}")
    return acc, acc @ weights

  if os.path.exists(state_path):
    if not resume:
      raise FileExistsError(f"{state_path} exists: pass resume=True (--resume) to continue it")
    with open(state_path) as f:
      state = json.load(f)
    saved = state["signature"]
    if "fitness" not in saved:  # Saved before the fitness was recorded: cannot be checked.
      warnings.warn(f"{state_path} does not record what its fitness scored (saved by an older "
                    f"version); resuming on trust that the model, task and examples are the same",
                    stacklevel=2)
      saved = dict(saved, fitness=signature["fitness"])
    if saved != signature:
      diff = config_diff(saved, signature)
      raise ValueError(f"{state_path} was written with other settings (differs in "
                       f"{', '.join(diff)}); resume with the same ones or use another folder")
    rng = _rng_from_state(state["rng"])
    population = np.asarray(state["population"], np.int64)
    accuracy = np.asarray(state["accuracy"], np.float64)
    fitness = accuracy @ weights
    seen = set(state["seen"])
    history = state["history"]
    start = state["generation"] + 1
  else:
    rng = np.random.default_rng(cfg.seed)
    seen: set[str] = set()
    history = []
    start = 0
    population = accuracy = fitness = None

  gens = range(start, cfg.num_generations)
  bar = tqdm(gens, desc="LPES search", unit="gen", disable=not progress, initial=start,
             total=cfg.num_generations)
  for g in bar:
    t0 = time.perf_counter()
    if g == 0:
      population = initial_population(rng, bez, cfg, seen)
      accuracy, fitness = evaluate(population)
    else:
      order = np.argsort(-fitness, kind="stable")[:cfg.num_parents]
      parents, _, children = next_generation(rng, population, fitness, bez, cfg, seen)
      child_acc, _ = evaluate(children)
      population = np.concatenate([parents, children])
      accuracy = np.concatenate([accuracy[order], child_acc])
      fitness = accuracy @ weights
    best = int(np.argmax(fitness))
    history.append({"generation": g, "best_fitness": float(fitness[best]),
                    "mean_fitness": float(np.mean(fitness)),
                    "best_subset_accuracy": accuracy[best].tolist(),
                    "seconds": time.perf_counter() - t0})
    atomic.write_json(state_path, {
        "signature": signature, "generation": g, "population": population.tolist(),
        "accuracy": accuracy.tolist(), "seen": sorted(seen), "history": history,
        "rng": _rng_state(rng)})
    bar.set_postfix(best=f"{fitness[best]:.3f}", mean=f"{np.mean(fitness):.3f}")
    if stop_after is not None and g >= stop_after:
      break
  bar.close()

  best = int(np.argmax(fitness))
  result = SearchResult(genome=population[best], fitness=float(fitness[best]),
                        scales=np.asarray(bezier.curve_scales(population[best], bez)),
                        subset_accuracy=accuracy[best], history=history)
  write_results(workdir, result, bez, cfg, extra)
  return result


def write_results(workdir: str, result: SearchResult, bez: bezier.BezierConfig,
                  cfg: SearchConfig, extra: dict | None = None) -> None:
  """results.json (best scales, multipliers, genome, fitness, configs) and two PNGs."""
  atomic.write_json(os.path.join(workdir, RESULTS_FILE), {
      "scales": [float(s) for s in result.scales],
      "multipliers": [float(m) for m in bezier.scales_to_multipliers(result.scales)],
      "genome": result.genome.tolist(),
      "fitness": result.fitness,
      "subset_accuracy": dict(zip(SUBSETS, map(float, result.subset_accuracy))),
      "history": result.history,
      "bezier": dataclasses.asdict(bez), "search": dataclasses.asdict(cfg),
      **(extra or {})})
  plot_search(workdir, result, bez)


def plot_search(workdir: str, result: SearchResult, bez: bezier.BezierConfig) -> None:
  """best_curve.png (control points + per-layer scales) and fitness.png (best/mean vs gen)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  layers = np.arange(bez.num_layers)
  ax.step(layers, result.scales, where="mid", label="per-layer scale s_l")
  cx = result.genome[:, 0]
  cy = np.asarray(bez.grid)[result.genome[:, 1]]
  ax.plot(cx, cy, "o--", alpha=0.6, label="control points")
  ax.set_xlabel("layer")
  ax.set_ylabel("scale s")
  ax.set_title(f"best curve (fitness {result.fitness:.3f})")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "best_curve.png"), dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 3.5))
  gens = [h["generation"] for h in result.history]
  ax.plot(gens, [h["best_fitness"] for h in result.history], "o-", label="best")
  ax.plot(gens, [h["mean_fitness"] for h in result.history], "s-", label="mean")
  ax.set_xlabel("generation")
  ax.set_ylabel("fitness")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "fitness.png"), dpi=120)
  plt.close(fig)


def load_scales(path: str) -> np.ndarray:
  """Per-layer scales [L] from a results.json (validated: finite, > 0).

  Raises:
    ValueError: unreadable JSON, no "scales" field, not a 1-D list, or invalid values.
  """
  try:
    with open(path) as f:
      obj = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(obj, dict) or "scales" not in obj:
    raise ValueError(f"{path}: no 'scales' field")
  try:
    scales = np.asarray(obj["scales"], np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"{path}: 'scales' must be a list of numbers, got {obj['scales']!r:.80}"
                     ) from None
  if scales.ndim != 1:
    raise ValueError(f"{path}: 'scales' must be a list of one scale per layer, got shape "
                     f"{scales.shape}")
  return bezier.validate_scales(scales, name=f"{path}: scales")


def load_multipliers(path: str) -> np.ndarray:
  """Frequency multipliers 1/s [L] float32 from a results.json."""
  return bezier.scales_to_multipliers(load_scales(path))


# ----------------------------------------------------------------------------------------------
# Adapters for models that take `rope_multipliers`.


def llama_forward(model) -> ForwardFn:
  """ForwardFn of an `lpes_jax.llama.Llama`: logits of the last W positions only (the LM head
  is applied to the final normed hidden states of those positions, not to the whole sequence)."""

  def forward(params, tokens, mask, multipliers, window):
    _, state = model.apply({"params": params}, tokens, attention_mask=mask,
                           rope_multipliers=multipliers, last_token_only=True,
                           mutable=["intermediates"])
    h = state["intermediates"]["hidden_states"][-1][:, -window:]             # [B, W, D]
    if model.config.tie_word_embeddings:
      w = params["embed_tokens"]["embedding"].T                              # [D, V]
    else:
      w = params["lm_head"]["kernel"]
    return jnp.einsum("bwd,dv->bwv", h, w.astype(h.dtype)).astype(jnp.float32)

  return forward


def llama_greedy(model) -> GreedyFn:
  """GreedyFn of an `lpes_jax.llama.Llama`: prefill with a KV cache, then `lax.scan` over
  single-token steps (traceable, so it can be vmapped over candidates)."""
  from lpes_jax.llama import init_kv_cache

  def greedy(params, tokens, mask, multipliers, num_new):
    B, T = tokens.shape
    cache = init_kv_cache(model.config, B, T + num_new)
    logits, cache = model.apply({"params": params}, tokens, attention_mask=mask,
                                rope_multipliers=multipliers, kv_cache=cache,
                                last_token_only=True)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)             # [B]

    def step(carry, _):
      tok, cache = carry
      logits, cache = model.apply({"params": params}, tok[:, None],
                                  attention_mask=jnp.ones((B, 1), bool),
                                  rope_multipliers=multipliers, kv_cache=cache,
                                  last_token_only=True)
      nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
      return (nxt, cache), nxt

    _, rest = jax.lax.scan(step, (first, cache), None, length=num_new - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)                 # [B, num_new]

  return greedy


def full_logits_forward(apply_fn) -> ForwardFn:
  """ForwardFn from any `apply_fn(params, tokens, mask, multipliers) → logits [B, T, V]` (e.g.
  the PoPE `pope_jax.model.Transformer`): computes all logits and keeps the last W."""

  def forward(params, tokens, mask, multipliers, window):
    return apply_fn(params, tokens, mask, multipliers)[:, -window:].astype(jnp.float32)

  return forward
