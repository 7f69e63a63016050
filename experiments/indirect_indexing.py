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

import dataclasses
from pathlib import Path

from experiments import common
from pope_jax.attention import IMPLEMENTATIONS
from pope_jax.tasks import indirect_indexing as ii


def main(argv: list[str] | None = None) -> dict:
  parser = common.make_parser("indirect_indexing", __doc__,
                              {k: p.description for k, p in ii.PRESETS.items()})
  parser.add_argument("--preset", choices=sorted(ii.PRESETS), default="cpu",
                      help="configuration to run (see presets below)")
  parser.add_argument("--encodings", default="rope,pope",
                      help="comma-separated subset of rope,pope,none")
  parser.add_argument("--seeds", type=common.comma_list(common.nonnegative_int,
                                                          "non-negative integers"), default="0",
                      help="comma-separated seeds, trained side by side (vmapped)")
  parser.add_argument("--steps", type=common.positive_int,
                      help="optimiser steps (default: the preset's)")
  parser.add_argument("--batch-size", type=common.positive_int,
                      help="examples per step (default: the preset's)")
  parser.add_argument("--steps-per-call", type=common.positive_int,
                      help="steps fused into one jitted call (default: the preset's)")
  parser.add_argument("--data-workers", type=common.nonnegative_int,
                      help="grain worker processes, 0 = in this process (default: the preset's)")
  parser.add_argument("--dtype", help="compute dtype: float32 or bfloat16 (or an alias such as "
                                      "bf16); params stay float32 (default: the preset's)")
  common.add_init_std_flag(parser)
  parser.add_argument("--attention-implementation", choices=IMPLEMENTATIONS,
                      help="attention implementation of every layer (default: best available)")
  parser.add_argument("--out", type=Path, default=Path("runs/indirect_indexing"),
                      help="run folder: one subfolder per encoding, results")
  parser.add_argument("--resume", action="store_true",
                      help="continue runs from their latest checkpoint in --out")
  parser.add_argument("--summarize", action="store_true",
                      help="only collect finished runs in --out into the table and plot")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  args = parser.parse_args(argv)

  if not args.summarize:
    encodings = common.encodings_list(parser, args.encodings, ii.ENCODINGS)
    seeds = list(args.seeds)
    if len(set(seeds)) != len(seeds):
      parser.error(f"--seeds: expected distinct non-negative integers, got {seeds}")
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
    # Each encoding's folder is locked (not OUT), so encodings can run in separate processes.
    try:
      with common.locked(parser, *(args.out / enc for enc in encodings)), \
          common.usage_errors(parser):
        for enc in encodings:
          for r in ii.run_encoding(preset, enc, seeds, args.out, resume=args.resume,
                                   progress=not args.no_progress, lock=False):
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
