"""Frequency usage (PoPE §5): per (layer, frequency) mean q/k magnitude of RoPE and PoPE models,
over seeds, with the per-layer share of magnitude in the higher-frequency half.

`summarize_usage` and `usage_markdown` / `plot_usage` serve any models (the JSB task calls them at
the end of a run); `run` measures the language models of `pope_jax.tasks.language_model`
(trained first if missing) on held-out windows of the validation split. RoPE rows are 2-norms of
each rotated pair (H/2 frequencies), PoPE rows softplus magnitudes (H frequencies), averaged over
heads and tokens; frequency index 0 is the highest (1 rad/token) (`pope_jax.analysis`).

Shape letters: M seeds, L layers, F frequencies.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from pope_jax import analysis, atomic, reporting
from pope_jax.model import num_params
from pope_jax.tasks import language_model as lm

PAPER = "GPT-2-124M on OpenWebText: RoPE concentrates on low frequencies; PoPE uses high " \
        "frequencies in all layers but the first"
# Validation windows per `language_model` preset (frequency usage and score bounds).
MAX_WINDOWS = {"paper": 64, "h200": 64, "cpu": 64, "smoke": 2}
QK = ("query", "key")


def summarize_usage(usage: dict[str, list[dict]]) -> dict:
  """Seeds pooled per encoding, and the paper's contrast tested across them.

  Args:
    usage: encoding ("rope", "pope") → one `analysis.frequency_usage` result per seed.

  Returns:
    {"encodings": {enc: {"seeds": M, "frequencies": [F], "query"/"key": {"mean": [L][F] (over
    seeds), "share_per_seed": [M][L], "share_mean": [L], "share_sd": [L] (0 with one seed)}}},
    "contrast": see `contrast`, when both encodings are present}.
  """
  out = {"encodings": {}}
  for enc, runs in usage.items():
    entry = {"seeds": len(runs), "frequencies": np.asarray(runs[0]["frequencies"]).tolist()}
    for which in QK:
      rows = np.stack([np.asarray(r[which]) for r in runs])                    # [M, L, F]
      share = analysis.high_frequency_share(rows)                              # [M, L]
      entry[which] = {"mean": rows.mean(0).tolist(), "share_per_seed": share.tolist(),
                      "share_mean": share.mean(0).tolist(),
                      "share_sd": (share.std(0, ddof=1) if len(runs) > 1
                                   else np.zeros(share.shape[1])).tolist()}
    out["encodings"][enc] = entry
  if {"rope", "pope"} <= set(usage):
    out["contrast"] = contrast(out["encodings"])
  return out


def contrast(encodings: dict) -> dict:
  """Whether PoPE's high-frequency share exceeds RoPE's in every layer but the first (every layer
  when there is one), for queries and keys: the paper's contrast (§5).

  Returns:
    {"appears": bool, "layers": [checked layer indices], "query"/"key": {"gap": [L] PoPE minus
    RoPE share, "standard_errors": [L] the gap in Welch standard errors (NaN with one seed)},
    "rope_below_half": whether RoPE's mean share is under 0.5 in the checked layers,
    "statement": one sentence for results pages}.
  """
  rope, pope = encodings["rope"], encodings["pope"]
  num_layers = len(rope["query"]["share_mean"])
  layers = list(range(1, num_layers)) if num_layers > 1 else [0]
  out = {"layers": layers}
  for which in QK:
    pairs = [analysis.standard_errors_apart(np.asarray(pope[which]["share_per_seed"])[:, i],
                                            np.asarray(rope[which]["share_per_seed"])[:, i])
             for i in range(num_layers)]
    out[which] = {"gap": [g for g, _ in pairs], "standard_errors": [z for _, z in pairs]}
  out["appears"] = all(out[w]["gap"][i] > 0 for w in QK for i in layers)
  out["rope_below_half"] = all(rope[w]["share_mean"][i] < 0.5 for w in QK for i in layers)
  gaps = [(out[w]["gap"][i], out[w]["standard_errors"][i]) for w in QK for i in layers]
  gap, z = min(gaps)
  where = "every layer but the first" if num_layers > 1 else "its one layer"
  apart = "" if math.isnan(z) else f", {z:.1f} standard errors"
  seeds = f"{rope['seeds']} RoPE and {pope['seeds']} PoPE seeds"
  verdict = "appears" if out["appears"] else "does not appear"
  out["statement"] = (
      f"The paper's contrast {verdict}: PoPE's high-frequency share "
      f"{'exceeds' if out['appears'] else 'does not exceed'} RoPE's for queries and keys in "
      f"{where} (smallest gap {100 * gap:+.1f} points{apart}; {seeds}); RoPE's share is "
      f"{'below' if out['rope_below_half'] else 'not below'} 50 % there.")
  return out


def usage_markdown(summary: dict) -> str:
  """A table of high-frequency shares (%, mean ± sd over seeds) per layer, and the contrast."""
  encodings = summary["encodings"]
  num_layers = len(next(iter(encodings.values()))["query"]["share_mean"])
  rows = []
  for enc, entry in encodings.items():
    for which in QK:
      mean, sd = entry[which]["share_mean"], entry[which]["share_sd"]
      spread = (lambda i: f" ± {100 * sd[i]:.1f}") if entry["seeds"] > 1 else (lambda i: "")
      rows.append([enc, which, entry["seeds"]] +
                  [f"{100 * mean[i]:.1f}{spread(i)}" for i in range(num_layers)])
  table = reporting.markdown_table(
      ["encoding", "q/k", "seeds"] + [f"layer {i}" for i in range(num_layers)], rows)
  text = ("Share (%) of each layer's mean q/k magnitude carried by the higher-frequency half of "
          "its frequencies (50 % = uniform), mean ± sd over seeds.\n\n" + table)
  if "contrast" in summary:
    text += "\n" + summary["contrast"]["statement"] + "\n"
  return text


def plot_usage(summary: dict, heatmaps: Path, shares: Path) -> None:
  """Heatmaps of the seed-mean magnitudes (encodings × q/k) and the per-layer shares with ± sd
  error bars, as two PNGs."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  encodings = summary["encodings"]
  fig, axes = plt.subplots(2, len(encodings), figsize=(5 * len(encodings), 6), squeeze=False)
  for col, (enc, entry) in enumerate(encodings.items()):
    for row, which in enumerate(QK):
      ax = axes[row, col]
      im = ax.imshow(np.asarray(entry[which]["mean"]), aspect="auto", origin="lower",
                     cmap="viridis", interpolation="nearest")
      seeds = entry["seeds"]
      ax.set_title(f"{enc.upper()} {which} magnitude ({seeds} seed{'s' * (seeds > 1)})")
      ax.set_xlabel("frequency index (0 = highest)")
      ax.set_ylabel("layer")
      ax.set_yticks(range(len(entry[which]["mean"])))
      fig.colorbar(im, ax=ax)
  fig.tight_layout()
  fig.savefig(heatmaps, dpi=120)
  plt.close(fig)
  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for ax, which in zip(axes, QK):
    for enc, entry in encodings.items():
      mean = 100 * np.asarray(entry[which]["share_mean"])
      ax.errorbar(np.arange(len(mean)), mean, yerr=100 * np.asarray(entry[which]["share_sd"]),
                  marker="o", capsize=3, label=enc, color=reporting.ENCODING_COLORS.get(enc))
    ax.axhline(50, color="gray", lw=0.8, ls="--")
    ax.set_title(f"{which}: high-frequency share")
    ax.set_xlabel("layer")
    ax.set_xticks(range(len(mean)))
    ax.legend()
  axes[0].set_ylabel("% of magnitude in the higher-frequency half")
  fig.tight_layout()
  fig.savefig(shares, dpi=120)
  plt.close(fig)


def run(lm_preset: lm.Preset, out: Path, *, preset_name: str, max_windows: int, resume: bool,
        progress: bool, data_dir: Path | None = None, splits: dict[str, str] | None = None,
        seeds: Sequence[int] | None = None) -> dict:
  """Trains (or reuses) RoPE and PoPE language models, one per seed, measures their frequency
  usage on up to `max_windows` validation windows and writes OUT/frequency_usage.{json,md} and
  OUT/frequency_usage.png (heatmaps), OUT/frequency_share.png (per-layer shares).

  Args:
    seeds: seeds per encoding (default: the preset's one seed), each its own run folder
      (`language_model.run_name`), shared with the other language-model commands.

  Returns:
    The record: {"summary": `summarize_usage`, "usage": {encoding: [per seed {"query": [L][F],
    "key": [L][F], "frequencies": [F]}]}, "seeds", "windows", "seq_len", "config", "metadata"}.

  Raises:
    FileNotFoundError: no validation split.
  """
  seeds = list(seeds) if seeds is not None else [lm_preset.train.seed]
  n, batches = lm.validation_batches(lm_preset, out, data_dir, splits, max_windows)
  usage, configs = {}, {}
  for enc in ("rope", "pope"):
    usage[enc] = []
    for seed in seeds:
      with reporting.timed(f"seed {seed}: {enc} trained or reloaded, usage measured"):
        _, params, cfg = lm.train_model(
            lm_preset, enc, out, resume=resume, progress=progress, data_dir=data_dir,
            splits=splits, train_cfg=dataclasses.replace(lm_preset.train, seed=seed))
        usage[enc].append(analysis.frequency_usage(cfg, params, batches()))
      configs[enc] = cfg
  summary = summarize_usage(usage)
  about = reporting.what_ran(
      preset=preset_name, description=lm_preset.description,
      params=num_params(configs["pope"]),
      steps=lm_preset.train.steps,
      batch=f"{lm_preset.train.batch_size} windows of {lm_preset.seq_len} tokens",
      data=f"{n} validation windows of {lm_preset.seq_len} tokens; seeds {seeds}", paper=PAPER,
      expect=("the share is 50 % for uniform use; a model far below the paper's budget may not "
              "show the paper's pattern"))
  text = usage_markdown(summary)
  atomic.write_text(out / "frequency_usage.md", "# Frequency usage\n\n" + about + "\n" + text)
  record = {"summary": summary,
            "usage": {e: [{k: np.asarray(v).tolist() for k, v in u.items()} for u in runs]
                      for e, runs in usage.items()},
            "seeds": seeds, "windows": n, "seq_len": lm_preset.seq_len,
            "config": {"lm_preset": lm_preset}, "metadata": reporting.run_metadata(seeds[0])}
  reporting.write_json(out / "frequency_usage.json", record)
  plot_usage(summary, out / "frequency_usage.png", out / "frequency_share.png")
  print(text)
  return record
