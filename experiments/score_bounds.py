"""How many query tiles of a trained PoPE model the fused kernel's magnitude bound covers.

    python -m experiments.score_bounds                   # CPU default (language_model cpu)
    python -m experiments.score_bounds --preset smoke    # seconds, for tests
    python -m experiments.score_bounds --preset h200     # GPT-2-124M shape, Shakespeare (GPU)

Uses the PoPE model of `experiments.language_model` in the same --out (trained first if missing)
and held-out windows of the validation split (`pope_jax.analysis.score_bounds`). Per layer: the
share of query tiles (windows x heads x the forward kernel's query tiles, 192 rows at head
dims <= 64 and 128 above) whose bound on |score| is within the
kernel's limit (those take `BlockSizes(bounded_softmax=True)`'s softmax without a running max),
the median and largest bound, and the largest |score| itself (how loose the bound is), all in
log2 units. Outputs: OUT/score_bounds.json, OUT/score_bounds.md, OUT/score_bounds.png (per layer:
the bounded share; the median and largest bound beside the largest |score| and the limit).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from experiments import common
from experiments import language_model as lm
from pallas_kernels.pope_attention import SUPPORTED_HEAD_DIMS
from pope_jax import analysis

MAX_WINDOWS = {"paper": 64, "h200": 64, "cpu": 64, "smoke": 2}


def run(lm_preset: lm.Preset, out: Path, *, max_windows: int, resume: bool, progress: bool,
        data_dir: Path | None = None, splits: dict[str, str] | None = None) -> dict:
  n, batches = lm.validation_batches(lm_preset, out, data_dir, splits, max_windows)
  _, params, cfg = lm.train_model(lm_preset, "pope", out, resume=resume, progress=progress,
                                  data_dir=data_dir, splits=splits)
  result = analysis.score_bounds(cfg, params, batches())
  bound, max_score, limit = result["bound"], result["max_score"], result["limit"]
  tile_rows = result["tile_rows"]
  rows = [[i, f"{100 * np.mean(bound[i] <= limit):.1f}", f"{np.median(bound[i]):.1f}",
           f"{bound[i].max():.1f}", f"{max_score[i].max():.1f}"] for i in range(len(bound))]
  table = common.markdown_table(
      ["layer", "bounded tiles (%)", "median bound", "max bound", "max abs score"], rows)
  overall = float(np.mean(bound <= limit))
  note = ("" if cfg.head_size in SUPPORTED_HEAD_DIMS else
          f" (This model's head dim {cfg.head_size} is not one the kernel runs, "
          f"{SUPPORTED_HEAD_DIMS}: the shares show what the bound would give.)")
  (out / "score_bounds.md").write_text(
      "# PoPE score bounds of a trained model\n\n"
      f"{n} validation windows of {lm_preset.seq_len} tokens, {bound.shape[1]} query tiles "
      f"(windows x heads x {tile_rows}-row tiles) per layer. Bounds and scores in log2 units; "
      f"a tile is bounded when its bound is at most {limit:g}. Bounded overall: {100 * overall:.1f} %."
      f"{note}\n\n" + table)
  record = {"bounded_share": overall,
            "per_layer": [{"bounded_share": float(np.mean(b <= limit)),
                           "bound_median": float(np.median(b)), "bound_max": float(b.max()),
                           "max_score": float(m.max())} for b, m in zip(bound, max_score)],
            "limit": limit, "tile_rows": tile_rows, "windows": n,
            "seq_len": lm_preset.seq_len,
            "config": {"lm_preset": lm_preset},
            "metadata": common.run_metadata(lm_preset.train.seed)}
  common.write_json(out / "score_bounds.json", record)
  plot(record, out / "score_bounds.png")
  print(table)
  print(f"bounded tiles overall: {100 * overall:.1f} %")
  return record


def plot(record: dict, path: Path) -> None:
  """The per-layer figures of a `run` record (also of a saved score_bounds.json) as a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  layers = np.arange(len(record["per_layer"]))
  get = lambda key: [r[key] for r in record["per_layer"]]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
  left.bar(layers, [100 * s for s in get("bounded_share")], color="tab:blue")
  left.set(xlabel="layer", ylabel="bounded query tiles (%)", ylim=(0, 100),
           title=f"bounded overall: {100 * record['bounded_share']:.1f} %")
  right.plot(layers, get("bound_median"), "o-", label="median bound")
  right.plot(layers, get("bound_max"), "s-", label="largest bound")
  right.plot(layers, get("max_score"), "^-", label="largest |score|")
  right.axhline(record["limit"], color="k", linestyle="--", label="kernel's limit")
  right.set(xlabel="layer", ylabel="log2 units", title="bound and scores")
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  lm.add_common_flags(parser, "runs/language_model")
  parser.add_argument("--max-windows", type=int, help="validation windows to measure")
  args = parser.parse_args(argv)
  if args.max_windows is not None and args.max_windows < 1:
    parser.error(f"--max-windows must be at least 1, got {args.max_windows}")
  if "pope" not in args.encodings.split(","):
    parser.error(f"--encodings {args.encodings!r}: score_bounds measures the PoPE model")
  if args.out.is_file():
    parser.error(f"--out {args.out} is a file, not a folder")
  if args.data_dir is not None and not args.data_dir.is_dir():
    parser.error(f"--data-dir {args.data_dir} is not a folder")
  max_windows = MAX_WINDOWS[args.preset] if args.max_windows is None else args.max_windows
  with common.usage_errors(parser):
    try:
      return run(lm.resolve_preset(args), args.out, max_windows=max_windows, resume=args.resume,
                 progress=not args.no_progress, data_dir=args.data_dir,
                 splits=lm.parse_splits(args.splits))
    except FileNotFoundError as e:
      parser.error(str(e))


if __name__ == "__main__":
  main()
