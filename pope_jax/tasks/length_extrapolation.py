"""Zero-shot length extrapolation (PoPE Figure 2): perplexity vs evaluation context length.

Models trained at context L (`pope_jax.tasks.language_model`, runs shared with it) are evaluated on
the held-out split at multiples of L, over the same span of text at every length
(`pope_jax.analysis.perplexity_by_length`): PoPE and RoPE as trained; RoPE + YaRN (frequencies
interpolated with the ramp from L, attention factor 0.1·ln(s) + 1) zero-shot; and RoPE + YaRN
fine-tuned briefly at sL from the RoPE model (the paper: 500 steps at 4096 from 1024).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pope_jax import analysis, atomic, reporting
from pope_jax.config import TrainConfig, YarnConfig
from pope_jax.model import num_params
from pope_jax.tasks import language_model as lm

PAPER = ("models trained at 1024 tokens, evaluated on PG-19 to 10 240 (Figure 2, a plot only): "
         "RoPE's perplexity blows up past 1024, RoPE + YaRN fine-tuned 500 steps at 4096 holds to "
         "4096 and degrades after, PoPE stays flat to 10 240")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
  lm: str                              # experiments.language_model preset trained at L.
  multiples: tuple[int, ...]           # evaluation lengths as multiples of L.
  yarn_factor: float
  finetune: TrainConfig
  eval_batch_size: int
  max_tokens: int | None              # evaluation text per length (the same span for all).
  description: str = ""
  expect: str = ""                    # What the results show at this budget.


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
        expect="0.5% of the paper's steps on Shakespeare; the last recorded run (2026-12-01) had "
               "the paper's shape: PoPE +7 % from 1x to 10x, RoPE +38 %"),
    "cpu": Preset(
        lm="cpu", multiples=tuple(range(1, 11)), yarn_factor=4.0,
        finetune=TrainConfig(steps=60, batch_size=8, learning_rate=2e-4, min_learning_rate=2e-5,
                             warmup_steps=5, b2=0.95, eval_every=60, eval_batches=5,
                             checkpoint_every=60, log_every=20, steps_per_call=10),
        eval_batch_size=4, max_tokens=48 * 1280,
        description="the language_model cpu models (L = 128) evaluated to 1280",
        expect="tiny models far below the paper's budget, perplexities near 180; the last "
               "recorded run (2026-12-01) had PoPE +8 % from 1x to 10x, RoPE +19 %"),
    "smoke": Preset(
        lm="smoke", multiples=(1, 3), yarn_factor=4.0,
        finetune=TrainConfig(steps=2, batch_size=2, learning_rate=1e-3, min_learning_rate=1e-4,
                             warmup_steps=1, b2=0.95, eval_every=2, eval_batches=1,
                             checkpoint_every=2, log_every=2, steps_per_call=1),
        eval_batch_size=2, max_tokens=2 * 96, description="seconds, for tests",
        expect="a plumbing check: the numbers mean nothing"),
}


def run(preset: Preset, lm_preset: lm.Preset, out: Path, *, resume: bool, progress: bool,
        data_dir: Path | None = None, splits: dict[str, str] | None = None,
        eval_batch_size: int | None = None) -> dict:
  """Trains (or reuses) the four models, evaluates them at every length and writes
  OUT/extrapolation.{json,md,png}.

  Returns:
    The JSON record: {"train_length", "lengths", "finetune_length", "perplexity": {model:
    {length: {"loss", "perplexity", "accuracy", "windows"}}}, "config", "eval_file", "metadata"}.

  Raises:
    ValueError: a length whose attention scores would not fit the memory budget.
  """
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
            "eval_file": str(eval_file), "metadata": reporting.run_metadata(lm_preset.train.seed)}
  reporting.write_json(out / "extrapolation.json", record)
  rows = [[n] + [f"{results[n][k]['perplexity']:.2f}" for k in lengths] for n in results]
  table = reporting.markdown_table(["model \\ eval length"] + [str(k) for k in lengths], rows)
  about = reporting.what_ran(
      preset=preset.lm, description=preset.description,
      params=num_params(models["rope"][0]), steps=lm_preset.train.steps,
      batch=f"{lm_preset.train.batch_size} windows of {length} tokens (YaRN fine-tune: "
            f"{preset.finetune.steps} steps of {preset.finetune.batch_size} x {ft_len})",
      data=f"the validation split {eval_file.name}: its first {preset.max_tokens} tokens (all if "
           f"fewer), cut into non-overlapping windows of each length",
      paper=PAPER, expect=preset.expect)
  atomic.write_text(out / "extrapolation.md", (
      f"# Zero-shot length extrapolation (trained at {length})\n\n{about}\n" + table))
  _plot(results, lengths, length, out / "extrapolation.png")
  print(table)
  return json.loads(json.dumps(reporting.to_jsonable(record)))


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


