"""JSB-style Bach chorales (PoPE App. A): train RoPE and PoPE, report test NLL per token.

    python -m experiments.jsb                      # CPU default preset
    python -m experiments.jsb --preset paper       # the paper's configuration (GPU)
    python -m experiments.jsb --preset smoke       # seconds, for tests (a dozen scores)

Task logic: `pope_jax.tasks.jsb`; data: `pope_jax.data.jsb` (music21's Bach corpus → SATB
16th-note raster tokens, fixed split in JSB's 229/76/77 proportions), cached under
$POPE_JAX_CACHE (default ~/.cache/pope_jax). The paper reports RoPE 0.5081 and PoPE 0.4889 test NLL on the original JSB data; this is a different
extraction, so only the direction of the gap compares.

Each encoding's run lives in OUT/<encoding>/ (orbax checkpoints, metrics.jsonl, result.json);
`--resume` continues unfinished runs, finished ones with the same config are reused. Outputs:
OUT/results.json, OUT/results.md, OUT/loss.png (validation NLL vs step).
"""

from __future__ import annotations

import argparse
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
  parser.add_argument("--seed", type=common.nonnegative_int, default=0,
                      help="seed of each model's initialisation and data order")
  parser.add_argument("--transpose", type=common.nonnegative_int, default=None,
                      help="augment training with shifts -N..N semitones, 0 = none "
                           "(default: the preset's)")
  parser.add_argument("--cache-dir", type=Path,
                      help="extracted-chorale cache folder (default: $POPE_JAX_CACHE or "
                           "~/.cache/pope_jax)")
  parser.add_argument("--out", type=Path, default=Path("runs/jsb"),
                      help="run folder: one subfolder per encoding, results")
  parser.add_argument("--resume", action="store_true",
                      help="continue unfinished runs from their checkpoints in --out")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  common.add_init_std_flag(parser)
  args = parser.parse_args(argv)
  encodings = common.encodings_list(parser, args.encodings, ("rope", "pope"))
  if args.cache_dir is not None and args.cache_dir.exists() and not args.cache_dir.is_dir():
    parser.error(f"--cache-dir {args.cache_dir} is a file, not a folder")
  preset = task.PRESETS[args.preset]
  try:  # Configs validate themselves: report their ValueErrors as usage errors.
    train = dataclasses.replace(preset.train, seed=args.seed)
    if args.steps:
      train = common.with_steps(train, args.steps)
    preset = dataclasses.replace(preset, train=train,
                                 model=common.with_init_std(preset.model, args.init_std))
  except ValueError as e:
    parser.error(str(e))
  if args.transpose is not None:
    preset = dataclasses.replace(preset, transpositions=tuple(range(-args.transpose,
                                                                    args.transpose + 1)))
  runs = []
  with common.locked(parser, args.out), common.usage_errors(parser):
    for enc in encodings:
      r = task.run_one(preset, enc, args.out, resume=args.resume, progress=not args.no_progress,
                       cache_dir=args.cache_dir)
      print(f"{enc}: test NLL {r['test_nll']:.4f}", flush=True)
      runs.append(r)
    return task.summarize(args.out, runs, args.preset)


if __name__ == "__main__":
  main()
