"""Frequency usage (PoPE §5): per (layer, frequency) mean q/k magnitude of RoPE and PoPE models.

    python -m experiments.frequency_usage                   # CPU default (language_model cpu)
    python -m experiments.frequency_usage --preset smoke    # seconds, for tests
    python -m experiments.frequency_usage --preset h200     # GPT-2-124M, Shakespeare (GPU)
    python -m experiments.frequency_usage --preset paper    # GPT-2-124M models (GPU)

Uses the RoPE and PoPE models of `experiments.language_model` in the same --out (trained first if
missing) and held-out windows of the validation split (`pope_jax.tasks.frequency_usage`).
`--seeds 0,1,2` measures one model per encoding and seed (seed 0 in OUT/<encoding>/, seed N in
OUT/<encoding>_seed<N>/, the folders of `experiments.language_model --seeds`).
Outputs: OUT/frequency_usage.json, OUT/frequency_usage.md (share of magnitude in the high-frequency
half per layer, mean ± sd over seeds, and whether the paper's contrast appears),
OUT/frequency_usage.png (heatmaps, RoPE beside PoPE, queries and keys), OUT/frequency_share.png.
"""

from __future__ import annotations


from experiments import common
from pope_jax.tasks import frequency_usage as task
from pope_jax.tasks import language_model as lm


def main(argv: list[str] | None = None) -> dict:
  parser = common.make_parser("frequency_usage", __doc__, common.lm_presets_help(lm.PRESETS))
  common.add_lm_flags(parser, "runs/language_model")
  parser.add_argument("--max-windows", type=common.positive_int,
                      help="validation windows to average over (default: the preset's)")
  common.add_seeds_flag(parser)
  args = parser.parse_args(argv)
  seeds = common.seeds_list(parser, args)
  try:
    preset = common.resolve_lm_preset(args)
  except ValueError as e:  # A config that refuses a flag's value: a usage error.
    parser.error(str(e))
  with common.locked(parser, args.out), common.usage_errors(parser):
    return task.run(preset, args.out, preset_name=args.preset,
                    max_windows=args.max_windows or task.MAX_WINDOWS[args.preset],
                    resume=args.resume, progress=not args.no_progress, data_dir=args.data_dir,
                    splits=args.splits, seeds=seeds)


if __name__ == "__main__":
  main()
