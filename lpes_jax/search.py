"""Constrained genetic search for per-layer RoPE scales (LPES, arXiv 2606.27705 §3.2).

Genomes are one of the kinds of `lpes_jax.genomes` (Bézier control points, free per-layer
scales, one global scale). One generation: keep the best `num_parents` (elitism), then add
`num_mutations` children by mutation (one gene moves by at most ±`mutation_y_steps` grid steps)
and `num_crossovers` children by crossover (each gene taken whole from one of two parents). A child
whose per-layer scales equal any earlier candidate's is re-drawn, so every kind spends the same
budget, `SearchConfig.num_candidates`, on distinct candidates; a space no larger than that budget is
evaluated whole instead (the one-gene "global" kind, a 2-point line). Generation 0 is the identity
(all s = 1) plus random valid genomes. Fitness is the weighted mean of the accuracies on the
begin/middle/end subsets.

The fitness function (multipliers [P, L] → subset accuracies [P, S]) comes from the caller,
e.g. `lpes_jax.fitness.make_fitness_fn`.

The state (population, fitness, history, every individual seen, numpy RNG state) is written
atomically (temp file + os.replace) after every generation, so a run killed at any point resumes
from its last finished generation and continues exactly as if never stopped.

Defaults that are this project's choice (the paper's table was unreadable; LongRoPE's search shape):
population 32, 12 generations (generation 0 included), 16 parents, 8 + 8 children, ±2 grid steps,
weights 1/3 each.

Shape letters: P population, L layers, S subsets (begin, middle, end).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from typing import Callable

import numpy as np

from lpes_jax import bezier
from lpes_jax.fitness import SUBSETS
from lpes_jax.genomes import GenomeSpace
from pope_jax import atomic
from pope_jax.config import config_diff
from pope_jax.run_lock import run_lock

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
    mutation_y_steps: the largest move of a gene (a control point's y), in grid steps.
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
    if len(self.weights) != len(SUBSETS):
      raise ValueError(f"SearchConfig.weights must give one weight per subset "
                       f"({', '.join(SUBSETS)}), got {len(self.weights)}: {self.weights}")
    w = np.asarray(self.weights)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
      raise ValueError(f"SearchConfig.weights must be finite, >= 0 and not all 0, got "
                       f"{self.weights}")

  @property
  def num_candidates(self) -> int:
    """Distinct candidates evaluated in a full run: P + (generations − 1) · (P − parents)."""
    return self.population_size + (self.num_generations - 1) * (
        self.population_size - self.num_parents)


def split_population(population: int, *, parents: int | None = None,
                     mutations: int | None = None,
                     crossovers: int | None = None) -> tuple[int, int, int]:
  """(parents, mutations, crossovers) with the unset ones filled as the defaults split 32 into
  16 / 8 / 8: half kept, the rest shared by the two operators (evenly, or all of it to the one
  not set). The result may not add up when all three are given: `SearchConfig` checks that."""
  parents = population // 2 if parents is None else parents
  rest = population - parents
  if mutations is None and crossovers is None:
    mutations = rest // 2
  if mutations is None:
    mutations = rest - crossovers
  if crossovers is None:
    crossovers = rest - mutations
  return parents, mutations, crossovers


# ----------------------------------------------------------------------------------------------
# One generation (numpy, seeded Generator).


def _new_individual(draw: Callable[[], np.ndarray], space: GenomeSpace, seen: set[str],
                    max_redraws: int, what: str) -> np.ndarray:
  for _ in range(max_redraws):
    g = draw()
    key = space.key(g)
    if key not in seen:
      seen.add(key)
      return g
  raise RuntimeError(f"no new {what} in {max_redraws} draws: the search space is exhausted "
                     "(increase the grid or layers, or lower the population)")


def _unseen(genomes: np.ndarray, space: GenomeSpace, seen: set[str], count: int) -> np.ndarray:
  """The first `count` of `genomes` (a listed space) whose phenotype is not in `seen` (added)."""
  out = []
  for g in genomes:
    if len(out) == count:
      break
    key = space.key(g)
    if key not in seen:
      seen.add(key)
      out.append(g)
  return np.stack(out) if out else genomes[:0]


def initial_population(rng: np.random.Generator, space: GenomeSpace, cfg: SearchConfig,
                       seen: set[str], listed: np.ndarray | None = None) -> np.ndarray:
  """[P, ...]: the identity, then random valid, distinct genomes (or the first P of `listed`,
  the whole space when it is searched exhaustively)."""
  if listed is not None:
    return _unseen(listed, space, seen, cfg.population_size)
  ident = space.identity()
  seen.add(space.key(ident))
  pop = [ident]
  while len(pop) < cfg.population_size:
    pop.append(_new_individual(lambda: space.random(rng), space, seen, cfg.max_redraws,
                               "random genome"))
  return np.stack(pop)


def next_generation(rng: np.random.Generator, population: np.ndarray, fitness: np.ndarray,
                    space: GenomeSpace, cfg: SearchConfig, seen: set[str],
                    listed: np.ndarray | None = None):
  """Elitism + mutation + crossover (or, for a listed space, the next unseen genomes). A
  crossover that finds no child not seen before in `cfg.max_redraws` draws (parents that differ
  in few genes) is replaced by a mutation.

  Raises:
    RuntimeError: no unseen mutation in `cfg.max_redraws` draws.

  Returns:
    (parents [num_parents, ...], parent fitness [num_parents], children [<= P − num_parents, ...];
    no children once a listed space is exhausted).
  """
  order = np.argsort(-np.asarray(fitness), kind="stable")[:cfg.num_parents]
  parents, parent_fit = population[order], np.asarray(fitness)[order]
  n_children = cfg.population_size - cfg.num_parents
  if listed is not None:
    return parents, parent_fit, _unseen(listed, space, seen, n_children)
  children = []
  mutation = lambda: space.mutate(rng, parents[rng.integers(len(parents))], cfg.mutation_y_steps)
  for _ in range(cfg.num_mutations):
    children.append(_new_individual(mutation, space, seen, cfg.max_redraws, "mutation"))
  for _ in range(cfg.num_crossovers):
    def draw():
      i, j = rng.choice(len(parents), size=2, replace=False)
      return space.crossover(rng, parents[i], parents[j], cfg.max_redraws)
    try:
      children.append(_new_individual(draw, space, seen, cfg.max_redraws, "crossover"))
    except RuntimeError:  # Few parents that differ in few genes: every child already seen.
      children.append(_new_individual(mutation, space, seen, cfg.max_redraws,
                                      "mutation in place of a crossover"))
  return parents, parent_fit, np.stack(children)


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
    genome: the best genome ([C, 2] control points, [L] or [1] grid indices); scales: [L] its
    per-layer scales; fitness: its fitness; subset_accuracy: its [S] accuracies; history: per
    generation best/mean fitness and time; num_candidates: distinct candidates evaluated.
  """
  genome: np.ndarray
  scales: np.ndarray
  fitness: float
  subset_accuracy: np.ndarray
  history: list[dict]
  num_candidates: int


def run_search(subset_accuracy_fn: Callable[[np.ndarray], np.ndarray],
               space: GenomeSpace, cfg: SearchConfig, workdir: str, *,
               resume: bool = False, progress: bool = True, extra: dict | None = None,
               fitness_id: dict | None = None, stop_after: int | None = None,
               lock: bool = True) -> SearchResult:
  """Runs (or resumes) the search, checkpointing after every generation.

  A space with at most `cfg.num_candidates` genomes is searched exhaustively (every genome,
  P in generation 0 and P − num_parents in each later one, until none is left); any other by the
  GA.

  Args:
    subset_accuracy_fn: multipliers [P, L] → accuracies [P, S] (e.g. `make_fitness_fn`).
    space: the genome kind (`lpes_jax.genomes`); cfg: GA settings.
    workdir: folder for search_state.json, results.json and the PNGs.
    resume: continue from workdir's state (must match space/cfg); without it an existing state is
      an error, so that no finished generations are overwritten by accident.
    progress: tqdm bar per generation.
    extra: JSON-able run information stored in results.json.
    fitness_id: JSON-able description of what `subset_accuracy_fn` scores (model, task,
      examples, fitness mode): saved with the state, so that a resume against another model or
      task, whose fitness values would not compare, is refused.
    stop_after: stop after this generation index (used to test resumption).
    lock: hold workdir's run lock (`pope_jax.run_lock`) for the whole search; False when the
      caller already holds it (the lock is not re-entrant).

  Raises:
    RunLockedError: another run is writing workdir.
    FileExistsError: a state exists and resume is False.
    ValueError: the saved state's settings (space, cfg, fitness_id) differ; the message names the
      differing fields.
  """
  with run_lock(workdir) if lock else contextlib.nullcontext():
    return _search(subset_accuracy_fn, space, cfg, workdir, resume=resume, progress=progress,
                   extra=extra, fitness_id=fitness_id, stop_after=stop_after)


def _search(subset_accuracy_fn, space, cfg, workdir, *, resume, progress, extra, fitness_id,
            stop_after) -> SearchResult:
  """`run_search` once workdir is locked."""
  from tqdm import tqdm

  state_path = os.path.join(workdir, STATE_FILE)
  weights = np.asarray(cfg.weights) / np.sum(cfg.weights)
  signature = {"genome": space.describe(), "search": dataclasses.asdict(cfg),
               "fitness": fitness_id}
  signature = json.loads(json.dumps(signature))

  def evaluate(genomes):
    scales = space.scales(genomes)
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

  listed = space.enumerate(cfg.num_candidates)
  gens = range(start, cfg.num_generations)
  bar = tqdm(gens, desc="LPES search", unit="gen", disable=not progress, initial=start,
             total=cfg.num_generations)
  for g in bar:
    t0 = time.perf_counter()
    if g == 0:
      population = initial_population(rng, space, cfg, seen, listed)
      accuracy, fitness = evaluate(population)
    else:
      order = np.argsort(-fitness, kind="stable")[:cfg.num_parents]
      parents, _, children = next_generation(rng, population, fitness, space, cfg, seen, listed)
      if not len(children):  # A listed space, all evaluated.
        break
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
                        scales=space.scales(population[best:best + 1])[0],
                        subset_accuracy=accuracy[best], history=history,
                        num_candidates=len(seen))
  write_results(workdir, result, space, cfg, extra)
  return result


def write_results(workdir: str, result: SearchResult, space: GenomeSpace,
                  cfg: SearchConfig, extra: dict | None = None) -> None:
  """results.json (best scales, multipliers, genome, fitness, budget spent, configs) and two
  PNGs."""
  atomic.write_json(os.path.join(workdir, RESULTS_FILE), {
      "scales": [float(s) for s in result.scales],
      "multipliers": [float(m) for m in bezier.scales_to_multipliers(result.scales)],
      "genome": result.genome.tolist(),
      "fitness": result.fitness,
      "subset_accuracy": dict(zip(SUBSETS, map(float, result.subset_accuracy))),
      "history": result.history,
      "num_candidates": result.num_candidates,
      "genome_space": space.describe(), "search": dataclasses.asdict(cfg),
      **(extra or {})})
  plot_search(workdir, result, space)


def plot_search(workdir: str, result: SearchResult, space: GenomeSpace) -> None:
  """best_curve.png (per-layer scales, and control points of a Bézier genome) and fitness.png
  (best/mean vs generation)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  layers = np.arange(space.num_layers)
  ax.step(layers, result.scales, where="mid", label="per-layer scale s_l")
  if space.kind == "bezier":
    cy = np.asarray(space.grid)[result.genome[:, 1]]
    ax.plot(result.genome[:, 0], cy, "o--", alpha=0.6, label="control points")
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
