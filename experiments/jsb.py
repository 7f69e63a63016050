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
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(task.PRESETS), default="cpu")
  parser.add_argument("--encodings", default="rope,pope")
  parser.add_argument("--steps", type=int, help="override the preset's optimiser steps")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--transpose", type=int, default=None,
                      help="augment training with shifts -N..N semitones (0 = none)")
  parser.add_argument("--cache-dir", type=Path, help="extracted-chorale cache folder")
  parser.add_argument("--out", type=Path, default=Path("runs/jsb"))
  parser.add_argument("--resume", action="store_true",
                      help="continue unfinished runs from their checkpoints in --out")
  parser.add_argument("--no-progress", action="store_true")
  common.add_init_std_flag(parser)
  args = parser.parse_args(argv)
  preset = task.PRESETS[args.preset]
  train = dataclasses.replace(preset.train, seed=args.seed)
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
  runs = []
  for enc in [e.strip() for e in args.encodings.split(",") if e.strip()]:
    if enc not in ("rope", "pope"):
      raise SystemExit(f"--encodings: unknown encoding {enc!r}")
    with common.usage_errors(parser):
      r = task.run_one(preset, enc, args.out, resume=args.resume, progress=not args.no_progress,
                       cache_dir=args.cache_dir)
    print(f"{enc}: test NLL {r['test_nll']:.4f}", flush=True)
    runs.append(r)
  return task.summarize(args.out, runs, args.preset)


if __name__ == "__main__":
  main()
