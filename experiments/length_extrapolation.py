"""Zero-shot length extrapolation (PoPE Figure 2): perplexity vs evaluation context length.

    python -m experiments.length_extrapolation                  # CPU default (trained at 128)
    python -m experiments.length_extrapolation --preset smoke   # seconds, for tests
    python -m experiments.length_extrapolation --preset h200    # GPT-2-124M, Shakespeare (GPU)
    python -m experiments.length_extrapolation --preset h200 --seeds 0,1,2   # mean ± sd
    python -m experiments.length_extrapolation --preset paper   # GPT-2-124M, OpenWebText (GPU)

Models are trained at context L with `experiments.language_model` (runs are shared: the same --out
reuses finished RoPE/PoPE models) and evaluated on the held-out split at L, 2L, ... 10L
(the same span of text at every length, cut into non-overlapping windows,
`pope_jax.tasks.length_extrapolation`), for:

* PoPE and RoPE as trained;
* RoPE + YaRN, s = 4 (frequencies interpolated with the ramp computed from the original context L,
  attention factor 0.1·ln(s) + 1), zero-shot;
* RoPE + YaRN, s = 4, fine-tuned for a few steps at 4L from the RoPE model (the paper: 500 steps at
  4096 from 1024).

With `--seeds 0,1,2` each seed trains its own four models (seed 0 in OUT/<model>/, seed N in
OUT/<model>_seed<N>/, shared with `experiments.language_model --seeds`). Outputs:
OUT/extrapolation.json (perplexity per length and the 1x -> 10x rise, mean ± sd over seeds, each
seed's numbers, config, versions, device, seconds per stage), OUT/extrapolation.md,
OUT/extrapolation.png (mean per model with a ± sd band). An evaluation length whose attention
scores would not fit the device memory is refused up front (lower --eval-batch-size).
"""

from __future__ import annotations


from experiments import common
from pope_jax import analysis
from pope_jax.tasks import length_extrapolation as task


def main(argv: list[str] | None = None) -> dict:
  parser = common.make_parser("length_extrapolation", __doc__,
                              common.lm_presets_help(task.PRESETS))
  common.add_lm_flags(parser, "runs/language_model")
  common.add_seeds_flag(parser)
  parser.add_argument("--eval-batch-size", type=common.positive_int,
                      help="windows per evaluation forward pass (default: the preset's)")
  args = parser.parse_args(argv)
  seeds = common.seeds_list(parser, args)
  preset = task.PRESETS[args.preset]
  args.preset = preset.lm
  try:
    lm_preset = common.resolve_lm_preset(args)
  except ValueError as e:  # A config that refuses a flag's value: a usage error.
    parser.error(str(e))
  try:
    analysis.check_memory(lm_preset.model, args.eval_batch_size or preset.eval_batch_size,
                          task.eval_lengths(preset, lm_preset))
  except ValueError as e:
    parser.error(f"--eval-batch-size: {e}")
  with common.locked(parser, args.out), common.usage_errors(parser):
    return task.run(preset, lm_preset, args.out, resume=args.resume,
                    progress=not args.no_progress, seeds=seeds, data_dir=args.data_dir,
                    splits=args.splits, eval_batch_size=args.eval_batch_size)


if __name__ == "__main__":
  main()
