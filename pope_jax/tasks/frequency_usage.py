"""Frequency usage (PoPE §5): per (layer, frequency) mean q/k magnitude of RoPE and PoPE models.

The language models of `pope_jax.tasks.language_model` (trained first if missing) on held-out
windows of the validation split (`pope_jax.analysis.frequency_usage`): RoPE rows are 2-norms of
each rotated pair (H/2 frequencies), PoPE rows softplus magnitudes (H frequencies), averaged over
heads and tokens; frequency index 0 is the highest (1 rad/token).

Shape letters: L layers, F frequencies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pope_jax import analysis, atomic, reporting
from pope_jax.model import num_params
from pope_jax.tasks import language_model as lm

PAPER = "GPT-2-124M on OpenWebText: RoPE concentrates on low frequencies; PoPE uses high " \
        "frequencies in all layers but the first"
MAX_WINDOWS = {"paper": 64, "h200": 64, "cpu": 64, "smoke": 2}


def high_frequency_share(usage: np.ndarray) -> np.ndarray:
  """[L] share of each layer's total magnitude in the higher-frequency half of the columns."""
  half = usage.shape[1] // 2
  return usage[:, :half].sum(1) / usage.sum(1)


def run(lm_preset: lm.Preset, out: Path, *, preset_name: str, max_windows: int, resume: bool,
        progress: bool, data_dir: Path | None = None, splits: dict[str, str] | None = None) -> dict:
  """Trains (or reuses) the RoPE and PoPE models, measures their frequency usage on up to
  `max_windows` validation windows and writes OUT/frequency_usage.{json,md,png}.

  Returns:
    The record: {"usage": {encoding: {"query": [L][F], "key": [L][F], "frequencies": [F]}},
    "windows", "seq_len", "config", "metadata"}.

  Raises:
    FileNotFoundError: no validation split.
  """
  n, batches = lm.validation_batches(lm_preset, out, data_dir, splits, max_windows)
  usage, configs = {}, {}
  for enc in ("rope", "pope"):
    _, params, cfg = lm.train_model(lm_preset, enc, out, resume=resume, progress=progress,
                                    data_dir=data_dir, splits=splits)
    usage[enc] = analysis.frequency_usage(cfg, params, batches())
    configs[enc] = cfg
  rows = []
  for enc, u in usage.items():
    for which in ("query", "key"):
      share = high_frequency_share(u[which])
      rows.append([enc, which] + [f"{100 * s:.1f}" for s in share])
  layers = usage["rope"]["query"].shape[0]
  table = reporting.markdown_table(
      ["encoding", "q/k"] + [f"layer {i}" for i in range(layers)], rows)
  about = reporting.what_ran(
      preset=preset_name, description=lm_preset.description,
      params=num_params(configs["pope"]),
      steps=lm_preset.train.steps,
      batch=f"{lm_preset.train.batch_size} windows of {lm_preset.seq_len} tokens",
      data=f"{n} validation windows of {lm_preset.seq_len} tokens", paper=PAPER,
      expect=("the share is 50 % for uniform use; a model far below the paper's budget may not "
              "show the paper's pattern"))
  atomic.write_text(out / "frequency_usage.md", (
      "# Frequency usage\n\nShare (%) of each layer's mean q/k magnitude carried by the "
      "higher-frequency half of its frequencies (50 % = uniform).\n\n" + about + "\n" + table))
  record = {"usage": {e: {k: np.asarray(v).tolist() for k, v in u.items()}
                      for e, u in usage.items()},
            "windows": n, "seq_len": lm_preset.seq_len, "config": {"lm_preset": lm_preset},
            "metadata": reporting.run_metadata(lm_preset.train.seed)}
  reporting.write_json(out / "frequency_usage.json", record)
  _plot(usage, out / "frequency_usage.png")
  print(table)
  return record


def _plot(usage: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(2, 2, figsize=(10, 6))
  for col, enc in enumerate(("rope", "pope")):
    for row, which in enumerate(("query", "key")):
      ax = axes[row, col]
      im = ax.imshow(usage[enc][which], aspect="auto", origin="lower", cmap="viridis",
                     interpolation="nearest")
      ax.set_title(f"{enc.upper()} {which} magnitude")
      ax.set_xlabel("frequency index (0 = highest)")
      ax.set_ylabel("layer")
      fig.colorbar(im, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


