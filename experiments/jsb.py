"""JSB Chorales (PoPE App. A): train RoPE and PoPE, report test NLL per token over seeds.

    python -m experiments.jsb                      # CPU default preset (one seed)
    python -m experiments.jsb --preset paper       # the paper's configuration, 5 seeds (GPU)
    python -m experiments.jsb --preset smoke       # seconds, for tests (8 chorales, 2 seeds)

The paper preset's three variants, each in its own --out (settings are chosen by validation NLL,
never by test):

    python -m experiments.jsb --preset paper --out runs/jsb_paper
    python -m experiments.jsb --preset paper --transpose 6 --out runs/jsb_transpose6
    python -m experiments.jsb --preset paper --attention-dropout 0.1 --out runs/jsb_attn_dropout0.1

An encoding at a time (`--encodings rope`, then `--encodings pope`, then both: the finished runs
are reused and the comparison written) keeps each command shorter.

Task logic: `pope_jax.tasks.jsb`; data: `pope_jax.data.jsb` (the standard JSB benchmark, 229 / 76
/ 77 chorales, shipped with the package). The paper reports RoPE 0.5081 and PoPE 0.4889 test NLL.

All seeds of an encoding train side by side in OUT/<encoding>/ (orbax checkpoints,
metrics.jsonl, result.json); `--resume` continues unfinished runs, finished ones with the same
config are reused. Every preset keeps each seed's best-validation checkpoint beside the latest.
Outputs: OUT/results.json, OUT/results.md (test NLL mean ± sd at the best validation step and at
the last step, Welch's t between the encodings at each, frequency usage per layer), OUT/loss.png
(validation NLL vs step, every seed), OUT/frequency_usage.png (heatmaps),
OUT/frequency_share.png (high-frequency share per layer).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from experiments import common
from pope_jax.tasks import jsb as task


def main(argv: list[str] | None = None) -> dict:
  parser = common.make_parser("jsb", __doc__, common.lm_presets_help(task.PRESETS))
  parser.add_argument("--preset", choices=sorted(task.PRESETS), default="cpu",
                      help="configuration to run (see presets below)")
  parser.add_argument("--encodings", default="rope,pope", help="comma-separated rope,pope")
  parser.add_argument("--steps", type=common.positive_int,
                      help="optimiser steps (default: the preset's)")
  parser.add_argument("--seeds", type=common.comma_list(common.nonnegative_int,
                                                        "non-negative integers"),
                      help="comma-separated seeds per encoding, trained side by side "
                           "(default: the preset's)")
  parser.add_argument("--transpose", type=common.nonnegative_int, default=None,
                      help="augment training with shifts -N..N semitones, 0 = none "
                           "(default: the preset's)")
  parser.add_argument("--pack", action="store_true",
                      help="train on the chorales concatenated into one stream, not one per "
                           "window; each chorale is its own segment (no attention across "
                           "chorales, positions from its BOS)")
  parser.add_argument("--attention-dropout", type=float, default=None,
                      help="dropout on the attention probabilities in training, in [0, 1) "
                           "(default: the preset's, 0); runs the XLA reference attention")
  parser.add_argument("--out", type=Path, default=Path("runs/jsb"),
                      help="run folder: one subfolder per encoding, results")
  parser.add_argument("--resume", action="store_true",
                      help="continue unfinished runs from their checkpoints in --out")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  common.add_init_std_flag(parser)
  args = parser.parse_args(argv)
  encodings = common.encodings_list(parser, args.encodings, ("rope", "pope"))
  preset = task.PRESETS[args.preset]
  if args.seeds is not None:
    if len(set(args.seeds)) != len(args.seeds):
      parser.error(f"--seeds: expected distinct seeds, got {','.join(map(str, args.seeds))}")
    preset = dataclasses.replace(preset, seeds=tuple(args.seeds))
  try:  # Configs validate themselves: report their ValueErrors as usage errors.
    train = dataclasses.replace(preset.train, seed=preset.seeds[0])
    if args.steps:
      train = common.with_steps(train, args.steps)
    preset = dataclasses.replace(preset, train=train,
                                 model=common.with_init_std(preset.model, args.init_std))
    if args.transpose is not None:
      preset = dataclasses.replace(preset, transpositions=tuple(range(-args.transpose,
                                                                      args.transpose + 1)))
    if args.pack:
      preset = dataclasses.replace(preset, pack_train=True)
    if args.attention_dropout is not None:
      preset = dataclasses.replace(preset, model=dataclasses.replace(
          preset.model, attention_dropout=args.attention_dropout))
  except ValueError as e:
    parser.error(str(e))
  runs = []
  with common.locked(parser, args.out), common.usage_errors(parser):
    for enc in encodings:
      rs = task.run_encoding(preset, enc, args.out, resume=args.resume,
                             progress=not args.no_progress)
      print(f"{enc}: test NLL " + ", ".join(f"{r['test_nll']:.4f}" for r in rs), flush=True)
      runs += rs
    return task.summarize(args.out, runs, preset, args.preset)


if __name__ == "__main__":
  main()
