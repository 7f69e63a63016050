"""LPES search: Bézier-constrained genetic search of per-layer RoPE scales on a Llama model.

    python -m experiments.lpes_search --model PATH --task kv --num-pairs 10 --key-length 4 \
        --value-length 4 [--num-examples 200] [--mode teacher_forced|greedy] [--resume]

Search examples (seed `--seed`, default 0; evaluation uses 1) are split over the begin/middle/end
gold positions. The fitness target is the model's continuation `<answer prefix><value>` (KV, default
prefix ' "') or `<prefix><first answer>` (MDQA, prefix ' '), counted as an exact greedy match.
Writes search_state.json (every generation), results.json (best scales, loadable with
`--scales` in lpes_eval), best_curve.png and fitness.png under `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from experiments.lpes_eval import add_task_flags, encode_prompt, load_model, num_items, task_examples
from lpes_jax import bezier, search
from pope_jax import atomic
from lpes_jax.tasks import begin_middle_end


def build_batch(args, tok, cfg) -> search.FitnessBatch:
  """The begin/middle/end search examples as a FitnessBatch."""
  prompts, answers, subset = [], [], []
  gold = begin_middle_end(num_items(args))
  for s, name in enumerate(search.SUBSETS):
    n = args.num_examples // 3 + (1 if s < args.num_examples % 3 else 0)
    for e in task_examples(args, gold[name], n, args.seed):
      prompts.append(encode_prompt(tok, e.prompt, args.chat))
      target = e.value if args.task == "kv" else e.answers[0]
      answers.append(tok.encode(args.answer_prefix + target, add_bos=False))
      subset.append(s)
  return search.make_batch(prompts, answers, subset, pad_id=cfg.pad_token_id or 0,
                           max_len=cfg.max_position_embeddings)


def search_config(args: argparse.Namespace) -> search.SearchConfig:
  """The GA settings of the flags. Unset --parents, --mutations, --crossovers split the
  population as the defaults do (16 / 8 / 8 of 32): half kept, the rest shared by the two
  operators (evenly, or all of it to the one not set).

  Raises:
    ValueError: the settings do not fit together (see `search.SearchConfig`).
  """
  parents = args.population // 2 if args.parents is None else args.parents
  rest = args.population - parents
  mutations, crossovers = args.mutations, args.crossovers
  if mutations is None and crossovers is None:
    mutations = rest // 2
  if mutations is None:
    mutations = rest - crossovers
  if crossovers is None:
    crossovers = rest - mutations
  args.parents, args.mutations, args.crossovers = parents, mutations, crossovers  # As recorded.
  return search.SearchConfig(population_size=args.population, num_generations=args.generations,
                             num_parents=parents, num_mutations=mutations,
                             num_crossovers=crossovers, weights=args.weights, seed=args.seed)


# Flags that do not change a candidate's fitness (where to write, how to batch, the GA settings,
# which the search state records on its own).
_NOT_FITNESS = ("out", "resume", "example_batch", "population", "generations", "parents",
                "mutations", "crossovers", "control_points", "grid", "weights")


def fitness_id(args: argparse.Namespace) -> dict:
  """What the fitness scores (model, task, examples, mode): a resume must match it."""
  return {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_FITNESS}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  add_task_flags(p)
  p.add_argument("--num-examples", type=int, default=200, help="search examples (all subsets)")
  p.add_argument("--seed", type=int, default=0, help="search-set seed and GA seed")
  p.add_argument("--mode", choices=search.FITNESS_MODES, default="teacher_forced")
  p.add_argument("--answer-prefix", default=None, help="target prefix (KV ' \"', MDQA ' ')")
  p.add_argument("--population", type=int, default=32)
  p.add_argument("--generations", type=int, default=12)
  p.add_argument("--parents", type=int, default=None,
                 help="best individuals kept per generation (default: half the population)")
  p.add_argument("--mutations", type=int, default=None,
                 help="children by mutation (default: half of the rest)")
  p.add_argument("--crossovers", type=int, default=None,
                 help="children by crossover (default: what remains of the population)")
  p.add_argument("--control-points", type=int, default=4)
  p.add_argument("--grid", type=lambda s: tuple(float(x) for x in s.split(",")),
                 default=bezier.DEFAULT_GRID)
  p.add_argument("--weights", type=lambda s: tuple(float(x) for x in s.split(",")),
                 default=(1 / 3, 1 / 3, 1 / 3))
  p.add_argument("--example-batch", type=int, default=8, help="examples per forward per device")
  p.add_argument("--resume", action="store_true", help="continue the state in --out")
  return p


def main(argv=None) -> None:
  p = build_parser()
  args = p.parse_args(argv)
  if args.answer_prefix is None:
    args.answer_prefix = ' "' if args.task == "kv" else " "
  if args.num_examples < len(search.SUBSETS):
    p.error(f"--num-examples {args.num_examples}: the search needs at least one example per "
            f"subset ({', '.join(search.SUBSETS)}), so at least {len(search.SUBSETS)}")
  if args.example_batch < 1:
    p.error(f"--example-batch {args.example_batch}: must be at least 1")
  try:  # Before the slow model load; the config names its fields, the flags follow.
    scfg = search_config(args)
  except ValueError as e:
    p.error(f"{e} (flags --population, --generations, --parents, --mutations, --crossovers, "
            f"--weights)")

  model, params, cfg, tok = load_model(args)
  batch = build_batch(args, tok, cfg)
  bez = bezier.BezierConfig(num_layers=cfg.num_layers, num_control_points=args.control_points,
                            grid=args.grid)
  forward = search.llama_forward(model) if args.mode == "teacher_forced" else None
  greedy = search.llama_greedy(model) if args.mode == "greedy" else None
  fitness = search.make_fitness_fn(params, batch, mode=args.mode, forward=forward, greedy=greedy,
                                   example_batch=args.example_batch)
  counter = {"candidates": 0, "seconds": 0.0}

  def timed(mult):
    t0 = time.perf_counter()
    out = fitness(mult)
    counter["seconds"] += time.perf_counter() - t0
    counter["candidates"] += len(mult)
    return out

  t0 = time.perf_counter()
  result = search.run_search(timed, bez, scfg, args.out, resume=args.resume,
                             fitness_id=fitness_id(args), extra={
      "args": vars(args), "num_devices": jax.device_count(),
      "device": str(jax.devices()[0].device_kind)})
  total = time.perf_counter() - t0
  n = batch.num_examples
  thr = counter["candidates"] * n / max(counter["seconds"], 1e-9)
  print(f"best scales: {np.round(result.scales, 2).tolist()}")
  print(f"best fitness {result.fitness:.3f}, subsets {dict(zip(search.SUBSETS, result.subset_accuracy.round(3)))}")
  print(f"search wall time {total:.1f} s; {counter['candidates']} candidates x {n} examples; "
        f"throughput {thr:.1f} candidate-examples/s (compile included)")
  atomic.write_text(f"{args.out}/search_timing.txt",
                    f"wall_s={total:.2f} candidates={counter['candidates']} examples={n} "
                    f"fitness_s={counter['seconds']:.2f} throughput={thr:.2f}\n")


if __name__ == "__main__":
  main()
