"""results.md of the LPES experiments: what ran, chance, the paper's number, and comparisons
computed from results files.

`eval_results_md(record, baseline)` and `search_results_md(record)` turn the JSON records that
`experiments.lpes_eval` / `experiments.lpes_search` write into a short Markdown page. An
evaluation is compared with a baseline evaluation record (e.g. the base model's) on the same
task and gold positions; a search with its generation 0 (the identity scales). The paper's
numbers are from arXiv 2606.27705 (see the project's LPES spec); measured runs and what to expect
from them are on the results pages (docs/lpes.md), not here.
"""

from __future__ import annotations

PAPER = ("Paper (arXiv 2606.27705): up to +11.2 % average KV-retrieval accuracy for Vicuna-7B "
         "over the base model; LPES costs no latency (2.42× faster than MoICE, 1.45× faster "
         "than Ms-PoE).")


def chance_level(task: str, num_items: int) -> str:
  """The chance level of a task, in words."""
  if task == "kv":
    return (f"1/{num_items} = {1 / num_items:.3f} for a model that copies a random value of the "
            f"{num_items} in the prompt; about 0 for a guessed value")
  return ("no fixed chance level: closed-book answers can be right without the gold document "
          "(Lost in the Middle reports the closed-book accuracy as the floor)")


def _task_line(args: dict) -> str:
  if args["task"] == "kv":
    length = lambda n: "UUID4" if n is None else f"{n}-character"
    return (f"KV retrieval, {args['num_pairs']} pairs, {length(args['key_length'])} keys, "
            f"{length(args['value_length'])} values")
  return f"multi-document QA from {args['mdqa_file']}"


def check_baseline(record: dict, baseline: dict) -> None:
  """Raises ValueError unless `baseline` is an evaluation record on `record`'s task, item count
  and gold positions (so their accuracies compare position by position)."""
  for key in ("task", "num_items"):
    if baseline.get(key) != record.get(key):
      raise ValueError(f"baseline {key} {baseline.get(key)!r} differs from {record.get(key)!r}")
  if list(baseline.get("accuracy", {})) != list(record["accuracy"]):
    raise ValueError(f"baseline gold positions {list(baseline.get('accuracy', {}))} differ from "
                     f"{list(record['accuracy'])}")


def eval_results_md(record: dict, baseline: dict | None = None) -> str:
  """Markdown for one held-out evaluation record (`experiments.lpes_eval`); with `baseline`
  (another such record, `check_baseline`), also its row and the gain over it per position.

  Raises:
    ValueError: `baseline` is on another task, item count or set of gold positions.
  """
  a = record["args"]
  golds = list(record["accuracy"])
  if baseline is not None:
    check_baseline(record, baseline)
  row = lambda name, acc, fmt: (f"| {name} | " + " | ".join(f"{acc[g]:{fmt}}" for g in golds))
  compared = ([row(baseline["method"], baseline["accuracy"], ".3f")
               + f" | {baseline['seconds_per_batch_median']:.4f} |",
               row(f"gain over {baseline['method']}",
                   {g: record["accuracy"][g] - baseline["accuracy"][g] for g in golds}, "+.3f")
               + " | |"] if baseline is not None else [])
  compared_with = ("no baseline record (`lpes_eval --baseline`)" if baseline is None else
                   f"{baseline['method']}, {baseline['num_examples']} examples per position, "
                   f"seed {baseline['args']['seed']}")
  lines = [
      f"# LPES evaluation: {record['method']} on {record['task']}", "",
      f"- Model: `{a['model']}` ({a['dtype']}{', chat template' if a['chat'] else ''}).",
      f"- Task: {_task_line(a)}; {record['num_items']} items per prompt.",
      f"- Held-out examples per gold position: {record['num_examples']} (seed {a['seed']}; "
      f"the search uses seed 0); greedy, {a['max_new_tokens']} new tokens.",
      f"- Scales: `{a['scales']}`." if record["method"] == "lpes" else
      f"- Method settings: PI s = {a['pi_scale']}." if record["method"] == "pi" else
      f"- MoICE routers: `{a.get('moice_routers')}` (experiments.moice_train)."
      if record["method"] == "moice" else
      f"- Method: {record['method']}.",
      f"- Chance level: {chance_level(record['task'], record['num_items'])}.",
      f"- {PAPER}",
      f"- Compared with: {compared_with}.",
      "",
      "| method | " + " | ".join(f"gold {g}" for g in golds) + " | s / batch |",
      "|---|" + "---:|" * (len(golds) + 1),
      row(record["method"], record["accuracy"], ".3f")
      + f" | {record['seconds_per_batch_median']:.4f} |", *compared, "",
      f"Median seconds per batch of {record['batch_size']} (first batch, with compilation, "
      f"excluded). Device: {record['device']} × {record['num_devices']}; jax "
      f"{record['versions']['jax']}; {record['date']}.",
  ]
  return "\n".join(lines) + "\n"


def _genome_line(space: dict) -> str:
  """The genome kind of a search (`lpes_jax.genomes`), in words."""
  if space["kind"] == "bezier":
    return f"{len(space['grid'])}-value grid, {space['num_control_points']} Bézier control points"
  if space["kind"] == "free":
    return f"{len(space['grid'])}-value grid, one free scale per layer"
  return (f"one global scale from {len(space['grid'])} values in [{space['grid'][0]}, "
          f"{space['grid'][-1]}]")


def search_results_md(record: dict) -> str:
  """Markdown for one search results.json (`experiments.lpes_search`)."""
  a, s = record["args"], record["search"]
  sub = record["subset_accuracy"]
  hist = record["history"]
  lines = [
      f"# LPES search on {a['task']}", "",
      f"- Model: `{a['model']}` ({a['dtype']}{', chat template' if a['chat'] else ''}).",
      f"- Task: {_task_line(a)}.",
      f"- Search examples: {a['num_examples']} (seed {a['seed']}), split over the begin / middle "
      f"/ end gold positions; fitness mode {a['mode']} (exact greedy match of "
      f"`{a['answer_prefix']}<answer>`), weights {tuple(round(w, 3) for w in s['weights'])}.",
      f"- Budget: population {s['population_size']}, {s['num_generations']} generations "
      f"({s['num_parents']} parents, {s['num_mutations']} mutations, {s['num_crossovers']} "
      f"crossovers), {_genome_line(record['genome_space'])}; GA seed {s['seed']}; "
      f"{record['num_candidates']} distinct candidates evaluated.",
      "- Chance level: the fitness is an exact match, so about 0 for guessing; the identity "
      "curve (generation 0, all s = 1) is the base model's fitness.",
      f"- {PAPER}",
      f"- Gain over generation 0's best: {record['fitness'] - hist[0]['best_fitness']:+.3f} "
      f"fitness.", "",
      "| | fitness | begin | middle | end |", "|---|---:|---:|---:|---:|",
      f"| generation 0 best | {hist[0]['best_fitness']:.3f} | " +
      " | ".join(f"{x:.3f}" for x in hist[0]["best_subset_accuracy"]) + " |",
      f"| best | {record['fitness']:.3f} | {sub['begin']:.3f} | {sub['middle']:.3f} | "
      f"{sub['end']:.3f} |", "",
      f"Best per-layer scales: {[round(x, 2) for x in record['scales']]}.",
      "These are accuracies on the search set itself, not held-out: evaluate the scales with "
      "`python -m experiments.lpes_eval --method lpes --scales results.json`.",
  ]
  return "\n".join(lines) + "\n"


def _ci(r: dict, signed: bool = False) -> str:
  f = "+.3f" if signed else ".3f"
  return f"{r['mean']:{f}} [{r['lo']:{f}}, {r['hi']:{f}}]"


def ablation_results_md(record: dict) -> str:
  """Markdown for an ablation record (`experiments.lpes_ablations`): budgets, accuracies per gold
  position and middle gains with 95 % intervals, per-seed gains, Bézier against linear."""
  from lpes_jax.ablation import LABELS  # The method names, one place.
  c, a = record["config"], record["args"]
  task = c["task"]
  lines = [
      "# LPES ablations", "",
      f"- Model: `{a['model']}` ({a['dtype']}); preset `{a['preset']}`.",
      f"- Task: KV retrieval, {task['num_pairs']} pairs searched, {c['transfer_pairs'] or 'no'} "
      f"pairs for transfer; {task['key_length']}-character keys, {task['value_length']}-character "
      f"values.",
      f"- Search: seeds {', '.join(map(str, c['search_seeds']))} (search set and GA), "
      f"{c['search_examples']} teacher-forced examples each; population "
      f"{c['search']['population_size']}, {c['search']['num_generations']} generations, "
      f"{c['search']['num_parents']} parents: a budget of {record['budget_per_search']} distinct "
      f"candidates per search.",
      f"- Held out: seeds {', '.join(map(str, c['heldout_seeds']))}, {c['num_examples']} examples "
      f"per gold position and seed, greedy ({c['max_new_tokens']} new tokens), LitM metric "
      f"(value as a substring of the output).",
      *([f"- MoICE: the routers in `{c['moice_routers']}` (experiments.moice_train), decoded "
         f"on the same held-out examples as the baselines."] if c.get("moice_routers") else []),
      "- Intervals: normal 95 % intervals over held-out examples (mean ± 1.96 sd/√n). Searched "
      "methods are pooled over search seeds by scoring each example with its mean over the seeds; "
      "gains are paired over the same examples (per-example differences). Middle = the gold "
      "positions other than the first and the last. The intervals cover held-out sampling, not "
      "the spread over search seeds (shown per seed).",
      f"- Device: {record['device']} × {record['num_devices']}; jax {record['versions']['jax']}, "
      f"flax {record['versions']['flax']}; {record['date']}; wall time {record['wall_s']:.0f} s.",
      f"- Command: `{record['command']}`", "",
      "## Search budget (distinct candidates × search examples)", "",
      "| method | " + " | ".join(f"seed {s}" for s in c["search_seeds"]) + " |",
      "|---|" + "---:|" * len(c["search_seeds"]),
  ]
  for m, by_seed in record["budget"].items():
    lines.append(f"| {LABELS[m]} | " + " | ".join(
        f"{v['candidates']} × {v['examples']} = {v['candidate_examples']}"
        for v in by_seed.values()) + " |")
  lines.append("")
  for pairs, s in record["summary"].items():
    golds = s["golds"]
    kind = "searched difficulty" if int(pairs) == task["num_pairs"] else "transfer"
    lines += [f"## {pairs} pairs ({kind})", "",
              "| method | " + " | ".join(f"gold {g}" for g in golds) +
              f" | middle gain over base ({', '.join(s['middle'])}) |",
              "|---|" + "---:|" * (len(golds) + 1)]
    for m, r in s["methods"].items():
      if m == "bezier_vs_linear":
        continue
      lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(_ci(r["accuracy"][g]) for g in golds)
                   + f" | {_ci(r['middle_gain'], True)} |")
    lines += ["", "Per search seed (held-out seeds pooled):", "",
              "| method | seed | mean accuracy | middle gain over base |", "|---|---:|---:|---:|"]
    for m, r in s["methods"].items():
      for seed, v in r.get("per_seed", {}).items():
        lines.append(f"| {LABELS[m]} | {seed} | {v['mean_accuracy']:.3f} | "
                     f"{_ci(v['middle_gain'], True)} |")
    bl = s["methods"].get("bezier_vs_linear")
    if bl:
      mid = bl["middle"]
      verdict = ("yes: the interval lies above 0" if mid["lo"] > 0 else
                 "no: linear interpolation is better (the interval lies below 0)" if mid["hi"] < 0
                 else "not resolved: the interval contains 0")
      lines += ["", f"**Does Bézier (C = 4) beat linear interpolation (C = 2) at {pairs} pairs?** "
                f"{verdict}. Middle positions: {_ci(mid, True)}; all positions: "
                f"{_ci(bl['all'], True)} (paired differences, search seeds pooled)."]
    lines.append("")
  return "\n".join(lines) + "\n"
