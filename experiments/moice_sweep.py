"""MoICE at its best: the routers' training budget and learning rate, chosen on held-out router data.

    python -m experiments.moice_sweep --model PATH --preset h200 --out runs/moice_sweep [--resume]
    python -m experiments.moice_sweep --model PATH --preset h200 --out runs/moice_sweep --resume \
        --learning-rates 1e-3          # one learning rate per command; a last one reuses them all

For each learning rate, one constant-lr run of max(--budgets) steps (`lpes_jax.moice_training`,
the released recipe but for the budget and lr: 128 sequences per step, AdamW, clip 1) saves its
routers after every budget (OUT/lr_<lr>/step_<budget>/): with a constant learning rate the state
after b steps is that of a run of budget b. The training sequences are a pool of --train-examples
KV-retrieval prompts with answers from --seed (1000, as experiments.moice_train), cycled. The
held-out split of the router data, --heldout-examples sequences from --heldout-seed (1001; apart
from the training seed, the LPES search seed 0 and the evaluation seeds 1-3), picks for each budget
the learning rate of lowest held-out loss, and then the budget. Its routers are copied to
OUT/best for the accuracy evaluation on the ablation table's held-out examples and intervals
(`experiments.lpes_ablations --moice-routers OUT/best`).

Writes OUT/results.json and OUT/results.md (held-out loss, LM loss and router entropy for every
learning rate and budget, the choice per budget, the best), OUT/loss.png (training loss of every
learning rate vs step) and OUT/heldout.png (held-out loss vs step). Router entropy is in nats:
log 7 = 1.946 for uniform routing over the seven experts, the untrained routers' value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

from experiments import common
from lpes_jax import moice, moice_training
from lpes_jax.llama import num_params
from lpes_jax.tasks.task import add_task_flags, task_config
from pope_jax import reporting
from pope_jax import train as pope_train


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sweep:
  """model: "checkpoint" (--model) or "tiny"; train: the recipe whose steps and learning_rate the
  sweep sets; budgets, learning_rates: the grid; train_examples: the cycled training pool (a
  multiple of train.batch_size); heldout_examples: held-out sequences (a multiple of
  train.micro_batch); eval_every: held-out evaluations between budgets (for the curves)."""
  model: str
  train: moice_training.RouterTrainConfig
  budgets: tuple[int, ...]
  learning_rates: tuple[float, ...]
  train_examples: int
  heldout_examples: int
  eval_every: int
  checkpoint_every: int


PRESETS = {
    "smoke": Sweep(model="tiny", train=moice_training.RouterTrainConfig(batch_size=4,
                                                                        micro_batch=2),
                   budgets=(1, 3), learning_rates=(1e-2, 3e-2), train_examples=8,
                   heldout_examples=4, eval_every=2, checkpoint_every=2),
    # 1000 steps of 128 sequences see each of the 25 600 sequences 5 times.
    "h200": Sweep(model="checkpoint", train=moice_training.RouterTrainConfig(),
                  budgets=(7, 50, 200, 1000), learning_rates=(1e-4, 3e-4, 1e-3, 3e-3),
                  train_examples=25_600, heldout_examples=256, eval_every=50,
                  checkpoint_every=50),
}
PRESET_HELP = {
    "smoke": "random 2-layer Llama, budgets 1 and 3, two learning rates: seconds on CPU",
    "h200": "the --model checkpoint: budgets 7, 50, 200, 1000 x lr 1e-4, 3e-4, 1e-3, 3e-3 "
            "(4 runs of 1000 steps of 128 sequences; GPU)",
}


def build_parser() -> argparse.ArgumentParser:
  p = common.make_parser("moice_sweep", __doc__, PRESET_HELP)
  add_task_flags(p)
  p.set_defaults(num_pairs=6, key_length=4, value_length=4, out="runs/moice_sweep")
  p.add_argument("--preset", choices=tuple(PRESETS), default="h200",
                 help="model, grid and data sizes (see presets below)")
  p.add_argument("--seed", type=common.nonnegative_int, default=1000,
                 help="training-data seed (as experiments.moice_train)")
  p.add_argument("--heldout-seed", type=common.nonnegative_int, default=1001,
                 help="held-out router data seed (apart from --seed, the search seed 0 and the "
                      "evaluation seeds)")
  p.add_argument("--budgets", type=common.comma_list(common.positive_int, "positive integers"),
                 help="comma-separated training budgets in steps (default: the preset's)")
  p.add_argument("--learning-rates",
                 type=common.comma_list(common.positive_float, "positive numbers"),
                 help="comma-separated constant learning rates (default: the preset's)")
  p.add_argument("--resume", action="store_true",
                 help="continue the runs in --out from their latest checkpoints")
  return p


def main(argv=None) -> dict:
  p = build_parser()
  args = p.parse_args(argv)
  common.check_task_flags(p, args)
  if args.task != "kv":
    p.error("--task: MoICE trains on KV retrieval (kv) only")
  if args.seed == args.heldout_seed:
    p.error("--heldout-seed must differ from --seed")
  sweep = PRESETS[args.preset]
  over = {k: tuple(sorted(set(v))) for k, v in (("budgets", args.budgets),
                                                ("learning_rates", args.learning_rates)) if v}
  sweep = dataclasses.replace(sweep, **over)
  with common.locked(p, args.out), common.usage_errors(p):
    return run(args, sweep)


def _lr_name(lr: float) -> str:
  return f"lr_{lr:g}"


def run(args: argparse.Namespace, sweep: Sweep) -> dict:
  """Trains one run per learning rate, chooses by held-out loss, writes the reports."""
  out = Path(args.out)
  tok, config, params = moice_training.load_model(args.model, tiny=sweep.model == "tiny",
                                                  dtype=args.dtype)
  mcfg = moice.paper_config(config.rope_theta)
  task = task_config(args)
  data = moice_training.kv_training_data(task, tok, config, num_examples=sweep.train_examples,
                                         seed=args.seed)
  heldout = moice_training.kv_training_data(task, tok, config,
                                            num_examples=sweep.heldout_examples,
                                            seed=args.heldout_seed)
  steps = max(sweep.budgets)
  runs, seconds = [], {}
  for lr in sweep.learning_rates:
    tcfg = dataclasses.replace(sweep.train, steps=steps, learning_rate=lr)
    workdir = out / _lr_name(lr)
    # What defines this learning rate's run (not the other learning rates of the grid), so each
    # may run in its own command on one --out and a later command reuses it.
    info = {"args": {k: v for k, v in vars(args).items()
                     if k not in ("resume", "out", "budgets", "learning_rates")},
            "sweep": dataclasses.asdict(dataclasses.replace(sweep, learning_rates=(lr,))),
            "train": dataclasses.asdict(tcfg), "moice": dataclasses.asdict(mcfg)}
    t0 = time.perf_counter()
    result = moice_training.train_routers(
        config, params, data, mcfg, tcfg, workdir, run_info=info,
        resume=args.resume and pope_train.has_checkpoints(workdir), heldout=heldout,
        eval_every=sweep.eval_every, snapshot_steps=sweep.budgets,
        checkpoint_every=sweep.checkpoint_every,
        log=lambda line, lr=lr: print(f"lr {lr:g}: {line}", flush=True))
    seconds[lr] = time.perf_counter() - t0
    runs.append({"encoding": f"lr {lr:g}", "learning_rate": lr, "history": result["history"]})
  record = choose(runs, sweep.budgets)
  best = record["best"]
  routers, _ = moice.load_routers(out / _lr_name(best["learning_rate"]) /
                                  f"step_{best['budget']}", config)
  moice.save_routers(out / "best", routers, mcfg, config)
  record.update({"sweep": dataclasses.asdict(sweep), "train_seconds": seconds,
                 "num_train_sequences": int(data.tokens.shape[0]),
                 "num_heldout_sequences": int(heldout.tokens.shape[0]),
                 **reporting.run_metadata(args.seed)})
  about = reporting.what_ran(
      preset=args.preset, description=PRESET_HELP[args.preset], params=num_params(params),
      steps=steps,
      batch=f"{sweep.train.batch_size} sequences per step from a pool of {sweep.train_examples}"
            f" (seed {args.seed}), cycled",
      data=f"KV retrieval, {args.num_pairs} pairs; held out: {sweep.heldout_examples} sequences"
           f" of seed {args.heldout_seed}",
      periodic=f"held-out loss at each budget and every {sweep.eval_every} steps",
      paper="the released recipe: 7 steps of 128 OpenHermes sequences at lr 1e-4",
      expect="the budget and learning rate of lowest held-out router loss; accuracy comes from "
             "experiments.lpes_ablations --moice-routers OUT/best") + (
      f"- Chosen: lr {best['learning_rate']:g} at {best['budget']} steps, held-out loss "
      f"{best['heldout_loss']:.4f} (router entropy {best['heldout_router_entropy']:.3f} nats, "
      f"uniform {math.log(mcfg.num_experts):.3f}); routers in OUT/best.\n"
      f"- Wall time per learning rate (s): "
      + ", ".join(f"{lr:g}: {s:.0f}" for lr, s in seconds.items()) + ".\n\n")
  reporting.write_results(out, title="MoICE router budget and learning rate", about=about,
                          table=_table(record), record=record, runs=runs, plot="loss.png",
                          metric="loss", ylabel="training loss")
  reporting.plot_history(runs, out / "heldout.png", metric="heldout_loss",
                         ylabel="held-out router loss", title="MoICE routers, held-out loss")
  return record


def choose(runs: list[dict], budgets: tuple[int, ...]) -> dict:
  """The held-out metrics of every (learning rate, budget), the learning rate of lowest held-out
  loss per budget, and the best (budget, learning rate) overall.

  Args:
    runs: {"learning_rate", "history"} per learning rate; each history holds "heldout_*" at every
      budget.

  Returns:
    {"grid": [{"learning_rate", "budget", "loss", "heldout_loss", ...}], "per_budget":
    {budget: the grid row chosen}, "best": the row of lowest held-out loss}.
  """
  grid = []
  for r in runs:
    at = {h["step"]: h for h in r["history"]}
    for b in budgets:
      grid.append({"learning_rate": r["learning_rate"], "budget": b, **at[b]})
  per_budget = {b: min((g for g in grid if g["budget"] == b), key=lambda g: g["heldout_loss"])
                for b in budgets}
  best = min(per_budget.values(), key=lambda g: g["heldout_loss"])
  return {"grid": grid, "per_budget": per_budget, "best": best}


def _table(record: dict) -> str:
  rows = [[g["budget"], f"{g['learning_rate']:g}", f"{g['heldout_loss']:.4f}",
           f"{g['heldout_lm_loss']:.4f}", f"{g['heldout_router_entropy']:.3f}",
           f"{g['loss']:.4f}", f"{g['grad_norm']:.3g}",
           "chosen" if g is record["per_budget"][g["budget"]] else ""]
          for g in sorted(record["grid"], key=lambda g: (g["budget"], g["learning_rate"]))]
  return reporting.markdown_table(
      ["budget (steps)", "lr", "held-out loss", "held-out LM loss", "held-out router entropy",
       "train loss (last step)", "grad norm", "lr for the budget"], rows)


if __name__ == "__main__":
  main()
