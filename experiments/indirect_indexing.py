"""Indirect indexing (PoPE §4): train RoPE and PoPE Transformers, report test accuracy.

    python -m experiments.indirect_indexing                      # CPU default preset
    python -m experiments.indirect_indexing --preset paper       # the paper's configuration
    python -m experiments.indirect_indexing --preset smoke       # < 2 minutes, for tests

All seeds of one encoding train side by side in one program (vmapped over seeds) in
OUT/<encoding>/ (orbax checkpoints, run.json, metrics.jsonl, result.json); `--resume` continues
unfinished runs from their latest checkpoint and reuses finished ones. Encodings can also run as
separate processes (one `--encodings` each, same --out) and be summarised with `--summarize`.
Task logic: `pope_jax.tasks.indirect_indexing`. Outputs: OUT/results.json, OUT/results.md and
OUT/accuracy.png (validation accuracy vs step).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from experiments import common
from pope_jax.tasks import indirect_indexing as ii


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(ii.PRESETS), default="cpu")
  parser.add_argument("--encodings", default="rope,pope",
                      help="comma-separated subset of rope,pope,none")
  parser.add_argument("--seeds", default="0", help="comma-separated seeds")
  parser.add_argument("--steps", type=int, help="override the preset's optimiser steps")
  parser.add_argument("--batch-size", type=int, help="override the preset's batch size")
  parser.add_argument("--steps-per-call", type=int, help="steps fused into one jitted call")
  parser.add_argument("--data-workers", type=int, help="grain worker processes")
  parser.add_argument("--dtype", help="override the compute dtype: float32 or bfloat16 (or an "
                                      "alias such as bf16); params stay float32")
  common.add_init_std_flag(parser)
  parser.add_argument("--attention-implementation", choices=["xla", "pallas"],
                      help="PoPE attention implementation (default: best available)")
  parser.add_argument("--out", type=Path, default=Path("runs/indirect_indexing"))
  parser.add_argument("--resume", action="store_true",
                      help="continue runs from their latest checkpoint in --out")
  parser.add_argument("--summarize", action="store_true",
                      help="only collect finished runs in --out into the table and plot")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)

  if not args.summarize:
    encodings = list(dict.fromkeys(e.strip() for e in args.encodings.split(",") if e.strip()))
    if not encodings:
      parser.error("--encodings: name at least one of rope, pope, none")
    for enc in encodings:
      if enc not in ii.ENCODINGS:
        parser.error(f"--encodings: unknown encoding {enc!r} (choose from rope, pope, none)")
    try:
      seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
      parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    if min(seeds) < 0 or len(set(seeds)) != len(seeds):
      parser.error(f"--seeds: expected distinct non-negative integers, got {args.seeds!r}")
    preset = ii.PRESETS[args.preset]
    try:  # Configs validate themselves: report their ValueErrors as usage errors.
      overrides = {k: v for k, v in {
          "batch_size": args.batch_size, "steps_per_call": args.steps_per_call,
          "data_workers": args.data_workers}.items() if v is not None}
      train = dataclasses.replace(preset.train, **overrides)
      if args.steps is not None:
        train = common.with_steps(train, args.steps)
      preset = dataclasses.replace(preset, train=train)
      model_overrides = {k: v for k, v in {
          "dtype": args.dtype, "attention_implementation": args.attention_implementation}.items()
          if v is not None}
      model = common.with_init_std(dataclasses.replace(preset.model, **model_overrides),
                                   args.init_std)
      preset = dataclasses.replace(preset, model=model)
    except ValueError as e:
      parser.error(str(e))
    try:
      with common.usage_errors(parser):
        for enc in encodings:
          for r in ii.run_encoding(preset, enc, seeds, args.out, resume=args.resume,
                                progress=not args.no_progress):
            print(f"{enc} seed {r['seed']}: test accuracy {100 * r['test_accuracy']:.2f} %",
                  flush=True)
    except KeyboardInterrupt:
      raise SystemExit(f"interrupted: finished checkpoints are kept in {args.out}; continue with "
                       f"the same command and --resume") from None
  try:
    return ii.summarize(args.out)
  except FileNotFoundError as e:
    parser.error(f"--summarize: {e}" if args.summarize else str(e))


if __name__ == "__main__":
  main()
