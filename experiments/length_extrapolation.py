"""Zero-shot length extrapolation (PoPE Figure 2): perplexity vs evaluation context length.

    python -m experiments.length_extrapolation                  # CPU default (trained at 128)
    python -m experiments.length_extrapolation --preset smoke   # seconds, for tests
    python -m experiments.length_extrapolation --preset h200    # GPT-2-124M, Shakespeare (GPU)
    python -m experiments.length_extrapolation --preset paper   # GPT-2-124M, OpenWebText (GPU)

Models are trained at context L with `experiments.language_model` (runs are shared: the same --out
reuses finished RoPE/PoPE models) and evaluated on the held-out split at L, 2L, ... 10L
(the same span of text at every length, cut into non-overlapping windows,
`pope_jax.analysis.perplexity_by_length`), for:

* PoPE and RoPE as trained;
* RoPE + YaRN, s = 4 (frequencies interpolated with the ramp computed from the original context L,
  attention factor 0.1·ln(s) + 1), zero-shot;
* RoPE + YaRN, s = 4, fine-tuned for a few steps at 4L from the RoPE model (the paper: 500 steps at
  4096 from 1024).

Outputs: OUT/extrapolation.json (results.json: config, versions, device), OUT/extrapolation.md,
OUT/extrapolation.png. An evaluation length whose attention scores would not fit the device
memory is refused up front (lower --eval-batch-size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from experiments import common
from experiments import language_model as lm
from pope_jax import analysis
from pope_jax.config import TrainConfig, YarnConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
  lm: str                              # experiments.language_model preset trained at L.
  multiples: tuple[int, ...]           # evaluation lengths as multiples of L.
  yarn_factor: float
  finetune: TrainConfig
  eval_batch_size: int
  max_tokens: int | None              # evaluation text per length (the same span for all).
  description: str = ""


PRESETS: dict[str, Preset] = {
    "paper": Preset(
        lm="paper", multiples=tuple(range(1, 11)), yarn_factor=4.0,
        finetune=TrainConfig(steps=500, batch_size=16, learning_rate=6e-5, min_learning_rate=6e-6,
                             warmup_steps=20, b2=0.95, eval_every=250, eval_batches=20,
                             checkpoint_every=250, log_every=50, steps_per_call=10),
        eval_batch_size=2, max_tokens=64 * 10240,
        description="GPT-2-124M trained at 1024, evaluated to 10 240; YaRN fine-tune 500 steps at "
                    "4096"),
    "h200": Preset(
        lm="h200", multiples=tuple(range(1, 11)), yarn_factor=4.0,
        finetune=TrainConfig(steps=100, batch_size=4, learning_rate=6e-5, min_learning_rate=6e-6,
                             warmup_steps=10, b2=0.95, eval_every=100, eval_batches=10,
                             checkpoint_every=100, log_every=20, steps_per_call=10),
        eval_batch_size=2, max_tokens=16 * 10240,
        description="the language_model h200 models (GPT-2-124M shape, L = 1024) evaluated to "
                    "10 240; YaRN fine-tune 100 steps at 4096"),
    "cpu": Preset(
        lm="cpu", multiples=tuple(range(1, 11)), yarn_factor=4.0,
        finetune=TrainConfig(steps=60, batch_size=8, learning_rate=2e-4, min_learning_rate=2e-5,
                             warmup_steps=5, b2=0.95, eval_every=60, eval_batches=5,
                             checkpoint_every=60, log_every=20, steps_per_call=10),
        eval_batch_size=4, max_tokens=48 * 1280,
        description="the language_model cpu models (L = 128) evaluated to 1280"),
    "smoke": Preset(
        lm="smoke", multiples=(1, 3), yarn_factor=4.0,
        finetune=TrainConfig(steps=2, batch_size=2, learning_rate=1e-3, min_learning_rate=1e-4,
                             warmup_steps=1, b2=0.95, eval_every=2, eval_batches=1,
                             checkpoint_every=2, log_every=2, steps_per_call=1),
        eval_batch_size=2, max_tokens=2 * 96, description="seconds, for tests"),
}


def run(preset: Preset, lm_preset: lm.Preset, out: Path, *, resume: bool, progress: bool,
        data_dir: Path | None = None, splits: dict[str, str] | None = None,
        eval_batch_size: int | None = None) -> dict:
  length = lm_preset.seq_len
  common_args = dict(resume=resume, progress=progress, data_dir=data_dir, splits=splits)
  models = {}
  for enc in ("pope", "rope"):
    _, params, cfg = lm.train_model(lm_preset, enc, out, **common_args)
    models[enc] = (cfg, params)
  rope_cfg, rope_params = models["rope"]
  yarn = YarnConfig(factor=preset.yarn_factor, original_max_position=length)
  yarn_cfg = dataclasses.replace(rope_cfg, rope_yarn=yarn)
  models[f"rope+yarn s={preset.yarn_factor:g}"] = (yarn_cfg, rope_params)
  ft_len = int(round(preset.yarn_factor * length))
  _, ft_params, _ = lm.train_model(
      lm_preset, "rope", out, name="rope_yarn_finetune", model_cfg=yarn_cfg,
      train_cfg=dataclasses.replace(preset.finetune, seed=lm_preset.train.seed), seq_len=ft_len,
      init_params=rope_params, **common_args)
  models[f"rope+yarn s={preset.yarn_factor:g}, fine-tuned at {ft_len}"] = (yarn_cfg, ft_params)

  data_dir_used, meta, files = lm.prepare_data(lm_preset, out, data_dir, splits)
  eval_file = data_dir_used / files.get("valid", "valid.bin")
  lengths = [m * length for m in preset.multiples]
  results = {}
  for name, (cfg, params) in models.items():
    results[name] = analysis.perplexity_by_length(
        cfg, params, eval_file, lengths, batch_size=eval_batch_size or preset.eval_batch_size,
        max_tokens=preset.max_tokens, dtype=meta.get("dtype", "uint16"), progress=progress)
    print(name, {k: round(v["perplexity"], 2) for k, v in results[name].items()}, flush=True)
  record = {"train_length": length, "lengths": lengths, "finetune_length": ft_len,
            "perplexity": {n: {str(k): v for k, v in r.items()} for n, r in results.items()},
            "config": {"preset": preset, "lm_preset": lm_preset,
                       "models": {n: c for n, (c, _) in models.items()}},
            "eval_file": str(eval_file), "metadata": common.run_metadata(lm_preset.train.seed)}
  common.write_json(out / "extrapolation.json", record)
  rows = [[n] + [f"{results[n][k]['perplexity']:.2f}" for k in lengths] for n in results]
  table = common.markdown_table(["model \\ eval length"] + [str(k) for k in lengths], rows)
  (out / "extrapolation.md").write_text(
      f"# Zero-shot length extrapolation (trained at {length})\n\nValidation perplexity over "
      f"the first {preset.max_tokens} validation tokens (all of them if fewer), cut into "
      f"non-overlapping windows of each length.\n\n" + table)
  _plot(results, lengths, length, out / "extrapolation.png")
  print(table)
  return json.loads(json.dumps(common.to_jsonable(record)))


def _plot(results: dict, lengths: list[int], train_length: int, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.5, 4))
  colors = ["tab:red", "tab:blue", "tab:green", "tab:orange"]
  for i, (name, r) in enumerate(results.items()):
    ax.plot(lengths, [r[k]["perplexity"] for k in lengths], marker="o", label=name,
            color=colors[i % len(colors)])
  ax.axvline(train_length, color="gray", ls=":", lw=1)
  ax.set_yscale("log")
  ax.set_xlabel("evaluation context length (tokens)")
  ax.set_ylabel("validation perplexity")
  ax.set_title(f"Zero-shot length extrapolation (trained at {train_length})")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  lm.add_common_flags(parser, "runs/language_model")
  parser.add_argument("--eval-batch-size", type=int, help="windows per evaluation forward pass")
  args = parser.parse_args(argv)
  preset = PRESETS[args.preset]
  args.preset = preset.lm
  try:
    lm_preset = lm.resolve_preset(args)
  except ValueError as e:  # A config that refuses a flag's value: a usage error.
    parser.error(str(e))
  with common.usage_errors(parser):
    return run(preset, lm_preset, args.out, resume=args.resume,
               progress=not args.no_progress, data_dir=args.data_dir,
               splits=lm.parse_splits(args.splits), eval_batch_size=args.eval_batch_size)


if __name__ == "__main__":
  main()
