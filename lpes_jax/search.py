"""Constrained genetic search for per-layer RoPE scales (LPES, arXiv 2606.27705 §3.2).

Genomes are Bézier control points (`lpes_jax.bezier`). One generation: keep the best
`num_parents` (elitism), then add `num_mutations` children by mutation (one control point: y moves
by at most ±`mutation_y_steps` grid steps, x moves inside its neighbours' open interval) and
`num_crossovers` children by crossover (each control point taken whole from one of two parents;
re-drawn while x is not strictly increasing). A child equal to any earlier individual is re-drawn.
Generation 0 is the identity curve (all s = 1) plus random valid curves. Fitness is the weighted
mean of the accuracies on the begin/middle/end subsets.

The fitness function (multipliers [P, L] → subset accuracies [P, S]) comes from the caller,
e.g. `lpes_jax.fitness.make_fitness_fn`.

The state (population, fitness, history, every individual seen, numpy RNG state) is written
atomically (temp file + os.replace) after every generation, so a run killed at any point resumes
from its last finished generation and continues exactly as if never stopped.

Defaults that are this project's choice (the paper's table was unreadable; LongRoPE's search shape):
population 32, 12 generations (generation 0 included), 16 parents, 8 + 8 children, ±2 grid steps,
weights 1/3 each.

Shape letters: P population, L layers, S subsets (begin, middle, end), C control points.
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
    if len(self.weights) != len(SUBSETS):
      raise ValueError(f"SearchConfig.weights must give one weight per subset "
                       f"({', '.join(SUBSETS)}), got {len(self.weights)}: {self.weights}")
    w = np.asarray(self.weights)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
      raise ValueError(f"SearchConfig.weights must be finite, >= 0 and not all 0, got "
                       f"{self.weights}")


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
               fitness_id: dict | None = None, stop_after: int | None = None,
               lock: bool = True) -> SearchResult:
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
    lock: hold workdir's run lock (`pope_jax.run_lock`) for the whole search; False when the
      caller already holds it (the lock is not re-entrant).

  Raises:
    RunLockedError: another run is writing workdir.
    FileExistsError: a state exists and resume is False.
    ValueError: the saved state's settings (bez, cfg, fitness_id) differ; the message names the
      differing fields.
  """
  with run_lock(workdir) if lock else contextlib.nullcontext():
    return _search(subset_accuracy_fn, bez, cfg, workdir, resume=resume, progress=progress,
                   extra=extra, fitness_id=fitness_id, stop_after=stop_after)


def _search(subset_accuracy_fn, bez, cfg, workdir, *, resume, progress, extra, fitness_id,
            stop_after) -> SearchResult:
  """`run_search` once workdir is locked."""
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
