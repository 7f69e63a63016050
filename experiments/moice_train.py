"""Trains the MoICE routers of a frozen Llama model (Lin et al., NeurIPS 2024; `lpes_jax.moice`).

    python -m experiments.moice_train --model PATH --preset h200 [--seed 1000] [--resume]

Data: KV-retrieval prompts with their answers and EOS (task flags as in lpes_search; default the
LPES setting, 6 pairs of 4-hex-digit keys and values), drawn from `--seed` (default 1000; the
search uses 0, the held-out evaluations 1, 2, 3), gold positions cycling over every position.
Loss: LM loss on every token + 0.3 × load balancing; only the routers train (AdamW, lr 1e-4).
Writes OUT/routers/ and OUT/moice.json (for `lpes_eval --method moice --moice-routers OUT`),
OUT/checkpoints/ (orbax, every step; --resume continues), history.json, results.json,
results.md and loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax

from experiments import common
from lpes_jax import moice, moice_training
from lpes_jax.llama import num_params
from lpes_jax.tasks.task import add_task_flags, task_config
from pope_jax import reporting

# (model, RouterTrainConfig): "checkpoint" loads --model; "tiny" is a random 2-layer Llama with
# the tokenizer of --model.
PRESETS = {
    "smoke": ("tiny", moice_training.RouterTrainConfig(steps=2, batch_size=4, micro_batch=2,
                                                       learning_rate=1e-2)),
    "h200": ("checkpoint", moice_training.RouterTrainConfig()),
}
PRESET_HELP = {
    "smoke": "random 2-layer Llama (width 64), 2 steps of 4 sequences: seconds on CPU",
    "h200": "the --model checkpoint, the released recipe: 7 steps of 128 sequences, lr 1e-4",
}


def build_parser() -> argparse.ArgumentParser:
  p = common.make_parser("moice_train", __doc__, PRESET_HELP)
  add_task_flags(p)
  p.set_defaults(num_pairs=6, key_length=4, value_length=4, out="runs/moice")
  p.add_argument("--preset", choices=tuple(PRESETS), default="h200",
                 help="model and training budget (see presets below)")
  p.add_argument("--seed", type=common.nonnegative_int, default=1000,
                 help="training-data seed (keep it apart from the search seed 0 and the "
                      "held-out seeds)")
  p.add_argument("--steps", type=common.positive_int, default=None,
                 help="optimiser steps (default: the preset's)")
  p.add_argument("--batch-size", type=common.positive_int, default=None,
                 help="sequences per step (default: the preset's)")
  p.add_argument("--micro-batch", type=common.positive_int, default=None,
                 help="sequences per forward/backward pass (default: the preset's)")
  p.add_argument("--learning-rate", type=common.positive_float, default=None,
                 help="AdamW learning rate (default: the preset's)")
  p.add_argument("--resume", action="store_true",
                 help="continue the run in --out from its latest checkpoint")
  return p


def train_config(p: argparse.ArgumentParser, args: argparse.Namespace
                 ) -> moice_training.RouterTrainConfig:
  """The preset's RouterTrainConfig with the flags' overrides (bad combinations: usage errors)."""
  _, tcfg = PRESETS[args.preset]
  over = {k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size),
                            ("micro_batch", args.micro_batch),
                            ("learning_rate", args.learning_rate)) if v is not None}
  if "batch_size" in over and "micro_batch" not in over:
    over["micro_batch"] = min(tcfg.micro_batch, over["batch_size"])
  try:
    return dataclasses.replace(tcfg, **over)
  except ValueError as e:
    p.error(f"{e} (flags --steps, --batch-size, --micro-batch, --learning-rate)")


def main(argv=None) -> None:
  p = build_parser()
  args = p.parse_args(argv)
  common.check_task_flags(p, args)
  if args.task != "kv":
    p.error("--task: MoICE trains on KV retrieval (kv) only")
  tcfg = train_config(p, args)
  with common.locked(p, args.out), common.usage_errors(p):
    run(args, tcfg)


def run(args: argparse.Namespace, tcfg: moice_training.RouterTrainConfig) -> None:
  """Loads the model and tokenizer, builds the data, trains, writes the reports to --out."""
  tok, config, params = moice_training.load_model(
      args.model, tiny=PRESETS[args.preset][0] == "tiny", dtype=args.dtype)
  mcfg = moice.paper_config(config.rope_theta)
  task = task_config(args)
  data = moice_training.kv_training_data(task, tok, config,
                                         num_examples=tcfg.steps * tcfg.batch_size,
                                         seed=args.seed)
  num_tokens = int(data.mask.sum())
  print(f"{data.tokens.shape[0]} sequences, {num_tokens} tokens (padded to "
        f"{data.tokens.shape[1]}); experts {mcfg.bases}, top-{mcfg.top_k}", flush=True)
  info = {"args": {k: v for k, v in vars(args).items() if k != "resume"},
          "train": dataclasses.asdict(tcfg), "moice": dataclasses.asdict(mcfg)}
  t0 = time.perf_counter()
  result = moice_training.train_routers(config, params, data, mcfg, tcfg, args.out,
                                        run_info=info, resume=args.resume,
                                        log=lambda line: print(line, flush=True))
  seconds = time.perf_counter() - t0
  history = result["history"]
  record = {**info, "history": history, "num_sequences": int(data.tokens.shape[0]),
            "num_tokens": num_tokens, "padded_length": int(data.tokens.shape[1]),
            "model_params": num_params(params),
            "router_params": sum(int(x.size) for x in jax.tree.leaves(result["routers"])),
            "train_seconds": seconds, **reporting.run_metadata(args.seed)}
  table = reporting.markdown_table(
      ["step", "loss", "LM loss", "aux loss", "grad norm"],
      [[h["step"], f"{h['loss']:.4f}", f"{h['lm_loss']:.4f}", f"{h['aux_loss']:.4f}",
        f"{h['grad_norm']:.3g}"] for h in history])
  about = reporting.what_ran(
      preset=args.preset, description=PRESET_HELP[args.preset],
      params=record["model_params"], steps=tcfg.steps,
      batch=f"{tcfg.batch_size} sequences ({num_tokens} tokens in all, padded to "
            f"{data.tokens.shape[1]})",
      data=f"KV retrieval, {args.num_pairs} pairs, seed {args.seed}, gold positions cycling",
      periodic="loss of each step's batch before its update",
      paper="7 steps of 128 OpenHermes sequences; no loss curve published",
      expect=f"{record['router_params']} router parameters; at lr 1e-4 the routers move "
             f"little from their N(0, 0.02²) start") + (
      f"- Experts: bases {list(mcfg.bases)}, top-{mcfg.top_k}, aux weight "
      f"{mcfg.aux_loss_coef}.\n- Wall time: {seconds:.1f} s.\n\n")
  reporting.write_results(args.out, title="MoICE router training", about=about, table=table,
                          record=record, runs=[{"encoding": "moice", "history": history}],
                          plot="loss.png", metric="loss", ylabel="training loss")


if __name__ == "__main__":
  main()
