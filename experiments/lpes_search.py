"""LPES search: Bézier-constrained genetic search of per-layer RoPE scales on a Llama model.

    python -m experiments.lpes_search --model PATH --task kv --num-pairs 10 --key-length 4 \\
        --value-length 4 [--num-examples 200] [--mode teacher_forced|greedy] \\
        [--genome bezier|free|global] [--resume]

`--genome` picks the genome kind (`lpes_jax.genomes`): Bézier control points (LPES), one free
scale per layer, or one global scale searched over a grid of as many values as the GA's budget.

Search examples (seed `--seed`, default 0; evaluation uses 1) are split over the begin/middle/end
gold positions. The fitness target is the model's continuation `<answer prefix><value>` (KV, default
prefix ' "') or `<prefix><first answer>` (MDQA, prefix ' '), counted as an exact greedy match.
Writes search_state.json (every generation), results.json (best scales, loadable with
`--scales` in lpes_eval), results.md (what ran, chance level, the paper's number, what to expect),
best_curve.png and fitness.png under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from experiments import common
from lpes_jax import bezier, evaluate, fitness, genomes, report, search
from lpes_jax.checkpoints import load_checkpoint
from lpes_jax.tasks.task import ANSWER_PREFIX, add_task_flags, task_config
from lpes_jax.tokenizer import load_tokenizer
from pope_jax import atomic


def search_config(args: argparse.Namespace) -> search.SearchConfig:
  """The GA settings of the flags (unset counts: `search.split_population`); the filled-in
  counts are written back to `args`, as recorded in the state.

  Raises:
    ValueError: the settings do not fit together (see `search.SearchConfig`).
  """
  args.parents, args.mutations, args.crossovers = search.split_population(
      args.population, parents=args.parents, mutations=args.mutations,
      crossovers=args.crossovers)
  return search.SearchConfig(population_size=args.population, num_generations=args.generations,
                             num_parents=args.parents, num_mutations=args.mutations,
                             num_crossovers=args.crossovers, weights=args.weights, seed=args.seed)


# Flags that do not change a candidate's fitness (where to write, how to batch, the GA settings,
# which the search state records on its own).
_NOT_FITNESS = ("out", "resume", "example_batch", "population", "generations", "parents",
                "mutations", "crossovers", "genome", "control_points", "grid", "weights")


def fitness_id(args: argparse.Namespace) -> dict:
  """What the fitness scores (model, task, examples, mode): a resume must match it."""
  return {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_FITNESS}


def build_parser() -> argparse.ArgumentParser:
  p = common.make_parser("lpes_search", __doc__)
  add_task_flags(p)
  p.add_argument("--num-examples", type=common.positive_int, default=200,
                 help="search examples (all subsets)")
  p.add_argument("--seed", type=common.nonnegative_int, default=0,
                 help="search-set seed and GA seed")
  p.add_argument("--mode", choices=fitness.FITNESS_MODES, default="teacher_forced",
                 help="teacher_forced: one forward per candidate; greedy: decode the answer")
  p.add_argument("--answer-prefix", default=None,
                 help="target prefix (default: ' \"' for KV, ' ' for MDQA)")
  p.add_argument("--population", type=common.positive_int, default=32,
                 help="individuals per generation")
  p.add_argument("--generations", type=common.positive_int, default=12,
                 help="generations, the initial population included")
  p.add_argument("--parents", type=common.nonnegative_int, default=None,
                 help="best individuals kept per generation (default: half the population)")
  p.add_argument("--mutations", type=common.nonnegative_int, default=None,
                 help="children by mutation (default: half of the rest)")
  p.add_argument("--crossovers", type=common.nonnegative_int, default=None,
                 help="children by crossover (default: what remains of the population)")
  p.add_argument("--genome", choices=genomes.GENOMES, default="bezier",
                 help="bezier: control points of a curve (LPES); free: one scale per layer; "
                      "global: one scale for all layers, every value of a grid as fine as the "
                      "budget")
  p.add_argument("--control-points", type=common.positive_int, default=4,
                 help="Bézier control points of the scale curve, at least 2 (4: cubic)")
  p.add_argument("--grid", type=common.comma_list(float, "numbers"),
                 default=",".join(map(repr, bezier.DEFAULT_GRID)),
                 help="candidate scale values, comma-separated, strictly increasing, > 0")
  p.add_argument("--weights", type=common.comma_list(float, "numbers"),
                 default=(1 / 3, 1 / 3, 1 / 3),
                 help=f"fitness weights of the {', '.join(fitness.SUBSETS)} subsets, "
                      f"comma-separated (default: 1/3 each)")
  p.add_argument("--example-batch", type=common.positive_int, default=8,
                 help="examples per forward per device")
  p.add_argument("--resume", action="store_true", help="continue the state in --out")
  return p


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> search.SearchConfig:
  """Every usage error of the flags, before any work; returns the GA settings."""
  common.check_task_flags(p, args)
  if args.answer_prefix is None:
    args.answer_prefix = ANSWER_PREFIX[args.task]
  if args.num_examples < len(fitness.SUBSETS):
    p.error(f"--num-examples {args.num_examples}: the search needs at least one example per "
            f"subset ({', '.join(fitness.SUBSETS)}), so at least {len(fitness.SUBSETS)}")
  if args.control_points < 2:
    p.error(f"--control-points {args.control_points}: a curve needs at least 2")
  try:  # The grid alone; the layer count is checked against the model once it is read.
    bezier.BezierConfig(num_layers=args.control_points, num_control_points=args.control_points,
                        grid=args.grid)
  except ValueError as e:
    p.error(f"--grid: {e}")
  if len(args.weights) != len(fitness.SUBSETS):
    p.error(f"--weights: give one weight per subset ({', '.join(fitness.SUBSETS)}), got "
            f"{len(args.weights)}")
  try:  # The config names its fields, the flags follow.
    return search_config(args)
  except ValueError as e:
    p.error(f"{e} (flags --population, --generations, --parents, --mutations, --crossovers, "
            f"--weights)")


def main(argv=None) -> None:
  p = build_parser()
  args = p.parse_args(argv)
  scfg = check_flags(p, args)
  with common.locked(p, args.out):
    state = os.path.join(args.out, search.STATE_FILE)
    if os.path.exists(state) and not args.resume:
      p.error(f"--out {args.out} holds a search ({state}): pass --resume to continue it or use "
              f"another folder")
    search_and_report(p, args, scfg)


def search_and_report(p: argparse.ArgumentParser, args: argparse.Namespace,
                      scfg: search.SearchConfig) -> None:
  """Loads the model, runs the search in the (locked) --out and writes its reports."""
  cfg, params = load_checkpoint(args.model, dtype=args.dtype)
  tok = load_tokenizer(args.model)
  batch = evaluate.search_batch(task_config(args), tok, cfg, num_examples=args.num_examples,
                                seed=args.seed, answer_prefix=args.answer_prefix)
  try:
    space = genomes.make_space(args.genome, cfg.num_layers, grid=args.grid,
                               control_points=args.control_points, budget=scfg.num_candidates)
  except ValueError as e:
    p.error(f"--genome {args.genome}, --control-points {args.control_points}: {e}")
  forward, greedy = fitness.llama_fitness_fns(cfg)
  population_fitness = fitness.make_fitness_fn(params, batch, mode=args.mode, forward=forward,
                                               greedy=greedy, example_batch=args.example_batch)
  counter = {"candidates": 0, "seconds": 0.0}

  def timed(mult):
    t0 = time.perf_counter()
    out = population_fitness(mult)
    counter["seconds"] += time.perf_counter() - t0
    counter["candidates"] += len(mult)
    return out

  t0 = time.perf_counter()
  result = search.run_search(timed, space, scfg, args.out, resume=args.resume,
                             fitness_id=fitness_id(args), extra={
      "args": vars(args), "num_devices": jax.device_count(),
      "device": str(jax.devices()[0].device_kind)}, lock=False)
  total = time.perf_counter() - t0
  n = batch.num_examples
  thr = counter["candidates"] * n / max(counter["seconds"], 1e-9)
  print(f"best scales: {np.round(result.scales, 2).tolist()}")
  subsets = dict(zip(fitness.SUBSETS, result.subset_accuracy.round(3)))
  print(f"best fitness {result.fitness:.3f}, subsets {subsets}")
  print(f"search wall time {total:.1f} s; {counter['candidates']} candidates x {n} examples; "
        f"throughput {thr:.1f} candidate-examples/s (compile included)")
  atomic.write_text(f"{args.out}/search_timing.txt",
                    f"wall_s={total:.2f} candidates={counter['candidates']} examples={n} "
                    f"fitness_s={counter['seconds']:.2f} throughput={thr:.2f}\n")
  with open(f"{args.out}/{search.RESULTS_FILE}") as f:
    atomic.write_text(f"{args.out}/results.md", report.search_results_md(json.load(f)))


if __name__ == "__main__":
  main()
