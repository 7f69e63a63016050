"""Lost-in-the-middle evaluation of a Llama-family model: accuracy per gold position.

    python -m experiments.lpes_eval --model PATH --task kv|mdqa \\
        --method base|pi|ms_poe|buckets|lpes|moice [--scales results.json] \\
        [--moice-routers DIR] [--baseline eval_kv_base.json] [--num-examples 500]

Held-out KV examples come from `--seed` (default 1; the search uses seed 0); MDQA examples from
`--mdqa-file` with the gold document moved to each position. Greedy decoding (KV cache); KV is
scored by case-insensitive substring on the whole output, MDQA by best_subspan_em on the first line.
Writes `<out>/eval_<task>_<method>.json` (accuracies, config, timing, versions), `.md` (what ran,
chance level, the paper's number and, with --baseline, the gains over an earlier evaluation) and
a lost-in-the-middle PNG, and prints a table with the median generation time per batch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

import jax

from experiments import common
from lpes_jax import evaluate, moice, report, search
from lpes_jax.checkpoints import load_checkpoint
from lpes_jax.tasks.task import add_task_flags, task_config
from lpes_jax.tokenizer import load_tokenizer
from pope_jax import atomic


def build_parser() -> argparse.ArgumentParser:
  p = common.make_parser("lpes_eval", __doc__)
  add_task_flags(p)
  p.add_argument("--method", choices=evaluate.METHODS, default="base",
                 help="base model, position interpolation, Ms-PoE, Attention Buckets, LPES "
                      "(needs --scales) or MoICE (needs --moice-routers)")
  p.add_argument("--scales", default=None,
                 help="results.json of an LPES search (default: none; --method lpes needs it)")
  p.add_argument("--moice-routers", default=None,
                 help="folder of trained MoICE routers, the --out of experiments.moice_train "
                      "(default: none; --method moice needs it)")
  p.add_argument("--baseline", default=None,
                 help="eval JSON of an earlier run on the same task and gold positions (e.g. "
                      "eval_kv_base.json): the .md adds its row and the gains over it "
                      "(default: none)")
  p.add_argument("--num-examples", type=common.positive_int, default=500,
                 help="held-out examples per position")
  p.add_argument("--positions", type=common.comma_list(common.nonnegative_int,
                                                        "non-negative integers"),
                 default=None, help="comma-separated gold positions (default: 5 evenly spaced, "
                                    "first and last included)")
  p.add_argument("--seed", type=common.nonnegative_int, default=1,
                 help="held-out seed (the search uses 0)")
  p.add_argument("--batch-size", type=common.positive_int, default=16,
                 help="examples per generation call")
  p.add_argument("--max-new-tokens", type=common.positive_int, default=48,
                 help="tokens generated per example (a quoted UUID value takes ~27)")
  p.add_argument("--pi-scale", type=common.positive_float, default=1.5,
                 help="position interpolation's global scale s")
  p.add_argument("--ms-poe-official", action="store_true",
                 help="Ms-PoE: index the ratio table with the argsort (released code)")
  p.add_argument("--buckets-absolute", action="store_true",
                 help="Attention Buckets: use the RAG bases as is, not scaled to the model's base")
  return p


def main(argv=None) -> None:
  p = build_parser()
  args = p.parse_args(argv)
  common.check_task_flags(p, args)
  if args.method == "lpes":
    if not args.scales:
      p.error("--method lpes needs --scales results.json")
    try:  # Bad files fail here, before the slow model load.
      search.load_scales(args.scales)
    except (OSError, ValueError) as e:
      p.error(f"--scales: {e}")
  if args.method == "moice":
    if not args.moice_routers:
      p.error("--method moice needs --moice-routers DIR (the --out of experiments.moice_train)")
    try:  # A missing or foreign folder fails here, before the slow model load.
      moice.load_moice_config(args.moice_routers)
    except (OSError, ValueError) as e:
      p.error(f"--moice-routers: {e}")
  if args.baseline:
    try:  # A missing or foreign file fails here, before the slow model load.
      with open(args.baseline) as f:
        baseline = json.load(f)
      if not isinstance(baseline, dict) or "accuracy" not in baseline:
        raise ValueError("not an lpes_eval record (no accuracy)")
      if baseline.get("task") != args.task:
        raise ValueError(f"its task {baseline.get('task')!r} is not --task {args.task!r}")
    except (OSError, ValueError) as e:
      p.error(f"--baseline {args.baseline}: {e}")
  if args.task == "kv" and args.positions and max(args.positions) >= args.num_pairs:
    p.error(f"--positions {','.join(map(str, args.positions))}: gold positions must be below "
            f"--num-pairs {args.num_pairs}")
  task = task_config(args)
  ev = evaluate.EvalConfig(
      method=args.method, scales=args.scales, num_examples=args.num_examples,
      positions=tuple(args.positions) if args.positions else None, seed=args.seed,
      batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, pi_scale=args.pi_scale,
      ms_poe_official=args.ms_poe_official, buckets_absolute=args.buckets_absolute,
      moice_routers=args.moice_routers)
  with common.locked(p, args.out):
    try:
      evaluate_and_report(args, task, ev)
    except moice.RoutersMismatch as e:
      p.error(f"--moice-routers: {e}")


def evaluate_and_report(args: argparse.Namespace, task, ev: evaluate.EvalConfig) -> None:
  """Loads the model, evaluates every gold position and writes the reports to --out."""
  cfg, params = load_checkpoint(args.model, dtype=args.dtype)
  tok = load_tokenizer(args.model)
  gen = evaluate.method_generator(cfg, params, ev)
  record = evaluate.evaluate_positions(gen, tok, cfg, task, ev,
                                       log=lambda line: print(line, flush=True))
  record.update({
      "args": dict(vars(args)), "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count()})
  stem = os.path.join(args.out, f"eval_{args.task}_{args.method}")
  common.write_json(stem + ".json", record)
  baseline = None
  if args.baseline:
    with open(args.baseline) as f:
      baseline = json.load(f)
  atomic.write_text(stem + ".md", report.eval_results_md(record, baseline))
  evaluate.plot_positions([record], stem + ".png")
  print("gold  " + "  ".join(f"{g:>6s}" for g in record["accuracy"]))
  print(f"{args.method:5s} " + "  ".join(f"{a:6.3f}" for a in record["accuracy"].values()))
  print(f"median seconds per batch of {args.batch_size}: {record['seconds_per_batch_median']:.4f}")


if __name__ == "__main__":
  main()
