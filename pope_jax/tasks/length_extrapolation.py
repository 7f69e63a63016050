"""Zero-shot length extrapolation (PoPE Figure 2): perplexity vs evaluation context length.

Models trained at context L (`pope_jax.tasks.language_model`, runs shared with it) are evaluated on
the held-out split at multiples of L, over the same span of text at every length
(`pope_jax.analysis.perplexity_by_length`): PoPE and RoPE as trained; RoPE + YaRN (frequencies
interpolated with the ramp from L, attention factor 0.1·ln(s) + 1) zero-shot; and RoPE + YaRN
fine-tuned briefly at sL from the RoPE model (the paper: 500 steps at 4096 from 1024). Each seed
has its own four models (`language_model.run_name`: OUT/rope, OUT/rope_seed1, ...,
OUT/rope_yarn_finetune_seed1); results are mean ± sd over seeds at every length, and the rise
from the first to the last length.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

from pope_jax import analysis, atomic, reporting
from pope_jax.config import TrainConfig, YarnConfig
from pope_jax.model import num_params
from pope_jax.tasks import language_model as lm
from pope_jax.tasks.preset import ExperimentPreset

PAPER = ("models trained at 1024 tokens, evaluated on PG-19 to 10 240 (Figure 2, a plot only): "
         "RoPE's perplexity blows up past 1024, RoPE + YaRN fine-tuned 500 steps at 4096 holds to "
         "4096 and degrades after, PoPE stays flat to 10 240")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset(ExperimentPreset):
  lm: str                              # experiments.language_model preset trained at L.
  multiples: tuple[int, ...]           # evaluation lengths as multiples of L.
  yarn_factor: float
  finetune: TrainConfig
  eval_batch_size: int
  max_tokens: int | None              # evaluation text per length (the same span for all).


PRESETS: dict[str, Preset] = {
    "paper": Preset(
        lm="paper", multiples=tuple(range(1, 11)), yarn_factor=4.0,
        finetune=TrainConfig(steps=500, batch_size=16, learning_rate=6e-5, min_learning_rate=6e-6,
                             warmup_steps=20, b2=0.95, eval_every=250, eval_batches=20,
                             checkpoint_every=250, log_every=50, steps_per_call=10),
        eval_batch_size=2, max_tokens=64 * 10240,
        description="GPT-2-124M trained at 1024, evaluated to 10 240; YaRN fine-tune 500 steps at "
                    "4096",
        expect="the paper's setting (on OpenWebText with --data-dir; PG-19 is not used)"),
    "h200": Preset(
        lm="h200", multiples=tuple(range(1, 11)), yarn_factor=4.0,
        finetune=TrainConfig(steps=100, batch_size=4, learning_rate=6e-5, min_learning_rate=6e-6,
                             warmup_steps=10, b2=0.95, eval_every=100, eval_batches=10,
                             checkpoint_every=100, log_every=20, steps_per_call=10),
        eval_batch_size=2, max_tokens=16 * 10240,
        description="the language_model h200 models (GPT-2-124M shape, L = 1024) evaluated to "
                    "10 240; YaRN fine-tune 100 steps at 4096",
        expect="0.5% of the paper's steps on Shakespeare; whether PoPE's perplexity rises less "
               "than RoPE's from 1x to 10x (measured runs: docs/sequence_modelling.md)"),
    "cpu": Preset(
        lm="cpu", multiples=tuple(range(1, 11)), yarn_factor=4.0,
        finetune=TrainConfig(steps=60, batch_size=8, learning_rate=2e-4, min_learning_rate=2e-5,
                             warmup_steps=5, b2=0.95, eval_every=60, eval_batches=5,
                             checkpoint_every=60, log_every=20, steps_per_call=10),
        eval_batch_size=4, max_tokens=48 * 1280,
        description="the language_model cpu models (L = 128) evaluated to 1280",
        expect="tiny models far below the paper's budget, perplexities in the hundreds, one seed "
               "(measured runs: docs/sequence_modelling.md)"),
    "smoke": Preset(
        lm="smoke", multiples=(1, 3), yarn_factor=4.0,
        finetune=TrainConfig(steps=2, batch_size=2, learning_rate=1e-3, min_learning_rate=1e-4,
                             warmup_steps=1, b2=0.95, eval_every=2, eval_batches=1,
                             checkpoint_every=2, log_every=2, steps_per_call=1),
        eval_batch_size=2, max_tokens=2 * 96, description="seconds, for tests",
        expect="a plumbing check: the numbers mean nothing"),
}


def eval_lengths(preset: Preset, lm_preset: lm.Preset) -> list[int]:
  """The evaluation context lengths in tokens: the preset's multiples of the training length."""
  return [m * lm_preset.seq_len for m in preset.multiples]


def run(preset: Preset, lm_preset: lm.Preset, out: Path, *, resume: bool, progress: bool,
        seeds: Sequence[int] = (0,), data_dir: Path | None = None,
        splits: dict[str, str] | None = None, eval_batch_size: int | None = None) -> dict:
  """Trains (or reuses) the four models of every seed, evaluates them at every length and writes
  OUT/extrapolation.{json,md,png}. Prints the seconds each stage took.

  Args:
    seeds: distinct seeds; seed s trains PoPE and RoPE with seed s and fine-tunes YaRN with it.

  Returns:
    The JSON record: {"train_length", "lengths", "finetune_length", "seeds", "models",
    "perplexity": {model: {length: {"mean", "sd", "per_seed"}}}, "rise_percent": {model:
    {"mean", "sd", "per_seed"}}, "per_seed": {seed: {model: {length: {"loss", "perplexity",
    "accuracy", "windows"}}}}, "config", "eval_file", "timings" (seconds per stage), "metadata"}.

  Raises:
    ValueError: no seeds or repeated ones, or a length whose attention scores would not fit the
      memory budget.
  """
  seeds = list(seeds)
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"seeds must be distinct and non-empty, got {seeds}")
  length = lm_preset.seq_len
  lengths = eval_lengths(preset, lm_preset)
  ft_len = int(round(preset.yarn_factor * length))
  batch_size = eval_batch_size or preset.eval_batch_size
  analysis.check_memory(lm_preset.model, batch_size, lengths)
  common_args = dict(resume=resume, progress=progress, data_dir=data_dir, splits=splits)
  data_dir_used, meta, files = lm.prepare_data(lm_preset, out, data_dir, splits)
  eval_file = data_dir_used / files.get("valid", "valid.bin")
  yarn = YarnConfig(factor=preset.yarn_factor, original_max_position=length)
  zero_shot = f"rope+yarn s={preset.yarn_factor:g}"
  tuned = f"{zero_shot}, fine-tuned at {ft_len}"
  timings: dict[str, float] = {}
  per_seed, configs = {}, {}
  for seed in seeds:
    models = {}
    for enc in ("pope", "rope"):
      with reporting.timed(f"seed {seed}: {enc} trained or reloaded", timings):
        _, params, cfg = lm.train_model(
            lm_preset, enc, out, train_cfg=dataclasses.replace(lm_preset.train, seed=seed),
            **common_args)
      models[enc] = (cfg, params)
    rope_cfg, rope_params = models["rope"]
    models[zero_shot] = (dataclasses.replace(rope_cfg, rope_yarn=yarn), rope_params)
    for cfg, params in models.values():   # Compiles while the fine-tune trains (first seed).
      analysis.compile_perplexity_by_length(cfg, params, lengths, batch_size=batch_size)
    with reporting.timed(f"seed {seed}: YaRN fine-tune at {ft_len} trained or reloaded",
                         timings):
      _, ft_params, _ = lm.train_model(
          lm_preset, "rope", out, name=lm.run_name("rope_yarn_finetune", seed),
          model_cfg=models[zero_shot][0], train_cfg=dataclasses.replace(preset.finetune, seed=seed),
          seq_len=ft_len, init_params=rope_params, **common_args)
    models[tuned] = (models[zero_shot][0], ft_params)
    per_seed[seed] = {}
    for name, (cfg, params) in models.items():
      with reporting.timed(f"seed {seed}: {name} evaluated at {len(lengths)} lengths", timings):
        per_seed[seed][name] = analysis.perplexity_by_length(
            cfg, params, eval_file, lengths, batch_size=batch_size,
            max_tokens=preset.max_tokens, dtype=meta.get("dtype", "uint16"), progress=progress)
      print(f"seed {seed}: {name}",
            {k: round(v["perplexity"], 2) for k, v in per_seed[seed][name].items()}, flush=True)
    configs = {n: c for n, (c, _) in models.items()}
  summary = summarize_seeds(per_seed, lengths)
  record = {"train_length": length, "lengths": lengths, "finetune_length": ft_len,
            "seeds": seeds, "models": list(configs), **summary,
            "per_seed": per_seed,
            "config": {"preset": preset, "lm_preset": lm_preset, "eval_batch_size": batch_size,
                       "models": configs},
            "eval_file": str(eval_file), "timings": timings,
            "metadata": reporting.run_metadata(seeds[0])}
  reporting.write_json(out / "extrapolation.json", record)
  table = _tables(summary, lengths, length)
  about = reporting.what_ran(
      preset=preset.lm, description=preset.description,
      params=num_params(configs["rope"]), steps=lm_preset.train.steps,
      batch=f"{lm_preset.train.batch_size} windows of {length} tokens (YaRN fine-tune: "
            f"{preset.finetune.steps} steps of {preset.finetune.batch_size} x {ft_len}); seeds "
            f"{', '.join(map(str, seeds))}, each training its own four models",
      data=f"the validation split {eval_file.name}: its first {preset.max_tokens} tokens (all if "
           f"fewer), cut into non-overlapping windows of each length",
      paper=PAPER, expect=preset.expect)
  atomic.write_text(out / "extrapolation.md", (
      f"# Zero-shot length extrapolation (trained at {length})\n\n{about}\n" + table))
  _plot(summary["perplexity"], lengths, length, len(seeds), out / "extrapolation.png")
  print(table)
  return json.loads(json.dumps(reporting.to_jsonable(record)))


def summarize_seeds(per_seed: dict[int, dict[str, dict[int, dict]]],
                    lengths: Sequence[int]) -> dict:
  """Mean ± sd over seeds of each model's perplexity at every length, and of its rise from the
  first to the last length.

  Args:
    per_seed: seed -> model -> length -> {"perplexity", ...} (`perplexity_by_length` results);
      every seed has the same models.
    lengths: the evaluation lengths, shortest first.

  Returns:
    {"perplexity": {model: {length: {"mean", "sd", "per_seed"}}}, "rise_percent": {model:
    {"mean", "sd", "per_seed"}}}: sd is the sample standard deviation (0 with one seed), the rise
    100 · (perplexity at the last length / at the first - 1) per seed; per_seed lists follow
    the seeds' order.
  """
  spread = lambda values: dict(zip(("mean", "sd"), reporting.mean_sd(values)),
                               per_seed=list(values))
  runs = list(per_seed.values())
  out = {"perplexity": {}, "rise_percent": {}}
  for model in runs[0]:
    ppl = {n: [r[model][n]["perplexity"] for r in runs] for n in lengths}
    out["perplexity"][model] = {n: spread(v) for n, v in ppl.items()}
    out["rise_percent"][model] = spread(
        [100 * (last / first - 1) for first, last in zip(ppl[lengths[0]], ppl[lengths[-1]])])
  return out


def _tables(summary: dict, lengths: list[int], train_length: int) -> str:
  """Markdown: perplexity (mean ± sd) per model and length, and the rise per model."""
  ppl = summary["perplexity"]
  rows = [[m] + [reporting.fmt_mean_sd(ppl[m][n]["per_seed"], ".2f") for n in lengths]
          for m in ppl]
  text = ("Validation perplexity, mean ± sd over seeds:\n\n" + reporting.markdown_table(
      ["model \\ eval length"] + [str(n) for n in lengths], rows))
  span = f"{lengths[0] // train_length}× → {lengths[-1] // train_length}×"
  rise = summary["rise_percent"]
  rows = [[m, reporting.fmt_mean_sd(rise[m]["per_seed"], "+.1f"),
           ", ".join(f"{v:+.1f}" for v in rise[m]["per_seed"])] for m in rise]
  return text + (f"\nRise in perplexity from {span} the training length (%):\n\n" +
                 reporting.markdown_table(["model", "rise % (mean ± sd)", "per seed"], rows))


def _plot(perplexity: dict, lengths: list[int], train_length: int, num_seeds: int,
          path: Path) -> None:
  """Mean perplexity per model against length, with a ± sd band over seeds."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  from matplotlib import ticker
  fig, ax = plt.subplots(figsize=(6.5, 4))
  colors = ["tab:red", "tab:blue", "tab:green", "tab:orange"]
  for i, (name, by_len) in enumerate(perplexity.items()):
    mean = np.array([by_len[n]["mean"] for n in lengths])
    sd = np.array([by_len[n]["sd"] for n in lengths])
    color = colors[i % len(colors)]
    ax.plot(lengths, mean, marker="o", label=name, color=color)
    ax.fill_between(lengths, mean - sd, mean + sd, color=color, alpha=0.2, lw=0)
  ax.axvline(train_length, color="gray", ls=":", lw=1)
  ax.set_yscale("log")
  plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
  ax.yaxis.set_major_formatter(plain)
  ax.yaxis.set_minor_formatter(plain)
  ax.set_xlabel("evaluation context length (tokens)")
  ax.set_ylabel("validation perplexity")
  band = f"mean, band ± sd over {num_seeds} seeds" if num_seeds > 1 else "one seed"
  ax.set_title(f"Zero-shot length extrapolation (trained at {train_length})\n{band}",
               fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
