"""JSB Chorales (PoPE App. A): train RoPE and PoPE, report test NLL per token over seeds.

    python -m experiments.jsb                      # CPU default preset (one seed)
    python -m experiments.jsb --preset paper       # the paper's configuration, 5 seeds (GPU)
    python -m experiments.jsb --preset smoke       # seconds, for tests (8 chorales, 2 seeds)

Task logic: `pope_jax.tasks.jsb`; data: `pope_jax.data.jsb` (the standard JSB benchmark, 229 / 76
/ 77 chorales, shipped with the package). The paper reports RoPE 0.5081 and PoPE 0.4889 test NLL.

All seeds of an encoding train side by side in OUT/<encoding>/ (orbax checkpoints,
metrics.jsonl, result.json); `--resume` continues unfinished runs, finished ones with the same
config are reused. Outputs: OUT/results.json, OUT/results.md (test NLL mean ± sd, the direction
of the gap in standard errors, frequency usage per layer), OUT/loss.png (validation NLL vs step),
OUT/frequency_usage.png (heatmaps), OUT/frequency_share.png (high-frequency share per layer).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from experiments import common
from pope_jax.tasks import jsb as task


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(task.PRESETS), default="cpu")
  parser.add_argument("--encodings", default="rope,pope")
  parser.add_argument("--steps", type=int, help="override the preset's optimiser steps")
  parser.add_argument("--seeds", help="comma-separated seeds per encoding (default: the preset's)")
  parser.add_argument("--transpose", type=int, default=None,
                      help="augment training with shifts -N..N semitones (0 = none)")
  parser.add_argument("--pack", action="store_true",
                      help="train on the chorales concatenated into one stream, not one per window")
  parser.add_argument("--out", type=Path, default=Path("runs/jsb"))
  parser.add_argument("--resume", action="store_true",
                      help="continue unfinished runs from their checkpoints in --out")
  parser.add_argument("--no-progress", action="store_true")
  common.add_init_std_flag(parser)
  args = parser.parse_args(argv)
  preset = task.PRESETS[args.preset]
  if args.seeds is not None:
    try:
      seeds = tuple(int(s) for s in args.seeds.split(","))
    except ValueError:
      parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if min(seeds) < 0 or len(set(seeds)) != len(seeds):
      parser.error(f"--seeds: expected distinct non-negative integers, got {args.seeds!r}")
    preset = dataclasses.replace(preset, seeds=seeds)
  train = dataclasses.replace(preset.train, seed=preset.seeds[0])
  if args.steps:
    train = common.with_steps(train, args.steps)
  try:
    preset = dataclasses.replace(preset, train=train,
                                 model=common.with_init_std(preset.model, args.init_std))
  except ValueError as e:
    parser.error(str(e))
  if args.transpose is not None:
    preset = dataclasses.replace(preset, transpositions=tuple(range(-args.transpose,
                                                                    args.transpose + 1)))
  if args.pack:
    preset = dataclasses.replace(preset, pack_train=True)
  runs = []
  for enc in [e.strip() for e in args.encodings.split(",") if e.strip()]:
    if enc not in ("rope", "pope"):
      raise SystemExit(f"--encodings: unknown encoding {enc!r}")
    with common.usage_errors(parser):
      rs = task.run_encoding(preset, enc, args.out, resume=args.resume,
                             progress=not args.no_progress)
    print(f"{enc}: test NLL " + ", ".join(f"{r['test_nll']:.4f}" for r in rs), flush=True)
    runs += rs
  return task.summarize(args.out, runs, preset, args.preset)


if __name__ == "__main__":
  main()
