"""Frequency usage (PoPE §5): per (layer, frequency) mean q/k magnitude of RoPE and PoPE models.

    python -m experiments.frequency_usage                   # CPU default (language_model cpu)
    python -m experiments.frequency_usage --preset smoke    # seconds, for tests
    python -m experiments.frequency_usage --preset h200     # GPT-2-124M, Shakespeare (GPU)
    python -m experiments.frequency_usage --preset paper    # GPT-2-124M models (GPU)

Uses the RoPE and PoPE models of `experiments.language_model` in the same --out (trained first if
missing) and held-out windows of the validation split (`pope_jax.tasks.frequency_usage`).
`--seeds 0,1,2` measures one model per seed (seeds after the first in OUT/<encoding>_seed<N>/).
Outputs: OUT/frequency_usage.json, OUT/frequency_usage.md (share of magnitude in the high-frequency
half per layer, mean ± sd over seeds, and whether the paper's contrast appears),
OUT/frequency_usage.png (heatmaps, RoPE beside PoPE, queries and keys), OUT/frequency_share.png.
"""

from __future__ import annotations

import argparse

from experiments import common
from pope_jax.tasks import frequency_usage as task


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  common.add_lm_flags(parser, "runs/language_model")
  parser.add_argument("--max-windows", type=int, help="validation windows to average over")
  parser.add_argument("--seeds", help="comma-separated seeds per encoding (default: --seed)")
  args = parser.parse_args(argv)
  try:
    seeds = [args.seed] if args.seeds is None else [int(s) for s in args.seeds.split(",")]
  except ValueError:
    parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
  if min(seeds) < 0 or len(set(seeds)) != len(seeds):
    parser.error(f"--seeds: expected distinct non-negative integers, got {args.seeds!r}")
  with common.usage_errors(parser):
    preset = common.resolve_lm_preset(args)
    return task.run(preset, args.out, preset_name=args.preset,
                    max_windows=args.max_windows or task.MAX_WINDOWS[args.preset],
                    resume=args.resume, progress=not args.no_progress, data_dir=args.data_dir,
                    splits=common.parse_splits(args.splits), seeds=seeds)


if __name__ == "__main__":
  main()
