"""Frequency usage (PoPE §5): per (layer, frequency) mean q/k magnitude of RoPE and PoPE models.

    python -m experiments.frequency_usage                   # CPU default (language_model cpu)
    python -m experiments.frequency_usage --preset smoke    # seconds, for tests
    python -m experiments.frequency_usage --preset h200     # GPT-2-124M, Shakespeare (GPU)
    python -m experiments.frequency_usage --preset paper    # GPT-2-124M models (GPU)

Uses the RoPE and PoPE models of `experiments.language_model` in the same --out (trained first if
missing) and held-out windows of the validation split (`pope_jax.analysis.frequency_usage`):
RoPE rows are 2-norms of each rotated pair (H/2 frequencies), PoPE rows softplus magnitudes
(H frequencies), averaged over heads and tokens; frequency index 0 is the highest (1 rad/token).
Outputs: OUT/frequency_usage.json, OUT/frequency_usage.md (share of magnitude in the high-frequency
half, per layer), OUT/frequency_usage.png (heatmaps, RoPE beside PoPE, queries and keys).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from experiments import common
from experiments import language_model as lm
from pope_jax import analysis

MAX_WINDOWS = {"paper": 64, "h200": 64, "cpu": 64, "smoke": 2}


def high_frequency_share(usage: np.ndarray) -> np.ndarray:
  """[L] share of each layer's total magnitude in the higher-frequency half of the columns."""
  half = usage.shape[1] // 2
  return usage[:, :half].sum(1) / usage.sum(1)


def run(lm_preset: lm.Preset, out: Path, *, max_windows: int, resume: bool, progress: bool,
        data_dir: Path | None = None, splits: dict[str, str] | None = None) -> dict:
  n, batches = lm.validation_batches(lm_preset, out, data_dir, splits, max_windows)
  usage = {}
  for enc in ("rope", "pope"):
    _, params, cfg = lm.train_model(lm_preset, enc, out, resume=resume, progress=progress,
                                    data_dir=data_dir, splits=splits)
    usage[enc] = analysis.frequency_usage(cfg, params, batches())
  rows = []
  for enc, u in usage.items():
    for which in ("query", "key"):
      share = high_frequency_share(u[which])
      rows.append([enc, which] + [f"{100 * s:.1f}" for s in share])
  layers = usage["rope"]["query"].shape[0]
  table = common.markdown_table(["encoding", "q/k"] + [f"layer {i}" for i in range(layers)], rows)
  (out / "frequency_usage.md").write_text(
      "# Frequency usage\n\nShare (%) of each layer's mean q/k magnitude carried by the "
      "higher-frequency half of its frequencies (50 % = uniform), over "
      f"{n} validation windows of {lm_preset.seq_len} tokens.\n\n" + table +
      "\nPaper: RoPE concentrates on low frequencies; PoPE uses high frequencies in all layers "
      "but the first.\n")
  record = {"usage": {e: {k: np.asarray(v).tolist() for k, v in u.items()}
                      for e, u in usage.items()},
            "windows": n, "seq_len": lm_preset.seq_len, "config": {"lm_preset": lm_preset},
            "metadata": common.run_metadata(lm_preset.train.seed)}
  common.write_json(out / "frequency_usage.json", record)
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


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  lm.add_common_flags(parser, "runs/language_model")
  parser.add_argument("--max-windows", type=int, help="validation windows to average over")
  args = parser.parse_args(argv)
  with common.usage_errors(parser):
    return run(lm.resolve_preset(args), args.out,
               max_windows=args.max_windows or MAX_WINDOWS[args.preset], resume=args.resume,
               progress=not args.no_progress, data_dir=args.data_dir,
               splits=lm.parse_splits(args.splits))


if __name__ == "__main__":
  main()
