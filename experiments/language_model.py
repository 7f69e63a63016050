"""Language modelling on real text: train RoPE and PoPE Transformers, report validation perplexity.

    python -m experiments.language_model                    # CPU default: Shakespeare, BPE 4096
    python -m experiments.language_model --preset smoke     # seconds, for tests
    python -m experiments.language_model --preset h200      # GPT-2-124M shape, Shakespeare (GPU)
    python -m experiments.language_model --preset h200 --seeds 0,1,2   # three seeds each
    python -m experiments.language_model --preset h200 --pack   # documents kept apart
    python -m experiments.language_model --preset paper     # GPT-2-124M, 100k steps (GPU, OWT)
    python -m experiments.language_model --preset paper --data-dir /data/owt \\
        --splits train=train.bin,valid=val.bin                  # nanoGPT OpenWebText token files

By default the data is the `shakespeare` package's complete works, split by play and tokenised with
a byte-level BPE trained on the training plays, written once to OUT/data/ (`pope_jax.tasks.
language_model`). Each model's run lives in OUT/<encoding>/ for seed 0 and OUT/<encoding>_seed<N>/
for seed N; a finished run with the same configuration is reused (also by
`experiments.length_extrapolation`, `frequency_usage` and `score_bounds` given the same --out),
and `--resume` continues an unfinished one. Outputs: OUT/results.json, OUT/results.md
(validation perplexity, mean ± sd over seeds), OUT/loss.png (validation loss vs step).

`--pack` keeps the documents (works) that share a window apart in every split: the model gets
their segment ids, so no token attends across a document boundary, and positions restarting at
0 at each document's first token (the end-of-text token closing the one before).
"""

from __future__ import annotations

import dataclasses

from experiments import common
from pope_jax import reporting
from pope_jax.tasks import language_model as lm


def main(argv: list[str] | None = None) -> dict:
  parser = common.make_parser("language_model", __doc__, common.lm_presets_help(lm.PRESETS))
  common.add_lm_flags(parser, "runs/language_model")
  common.add_seeds_flag(parser)
  parser.add_argument("--pack", action="store_true",
                      help="keep the documents sharing a window apart (segment ids, positions "
                           "restarting per document); needs an end-of-text token")
  args = parser.parse_args(argv)
  encodings = common.encodings_list(parser, args.encodings, ("rope", "pope"))
  seeds = common.seeds_list(parser, args)
  try:
    preset = dataclasses.replace(common.resolve_lm_preset(args), pack=args.pack)
  except ValueError as e:  # A config that refuses a flag's value: a usage error.
    parser.error(str(e))
  runs = []
  with common.locked(parser, args.out), common.usage_errors(parser):
    for seed in seeds:
      for enc in encodings:
        with reporting.timed(f"seed {seed}: {enc} trained or reloaded"):
          record, _, _ = lm.train_model(
              preset, enc, args.out, resume=args.resume, progress=not args.no_progress,
              data_dir=args.data_dir, splits=args.splits,
              train_cfg=dataclasses.replace(preset.train, seed=seed))
        print(f"seed {seed}: {enc}: validation perplexity {record['valid_perplexity']:.2f}",
              flush=True)
        runs.append(record)
    return lm.summarize(args.out, runs, args.preset)


if __name__ == "__main__":
  main()
