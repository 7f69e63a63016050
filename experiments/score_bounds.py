"""How many query tiles of a trained PoPE model the fused kernel's magnitude bound covers.

    python -m experiments.score_bounds                   # CPU default (language_model cpu)
    python -m experiments.score_bounds --preset smoke    # seconds, for tests
    python -m experiments.score_bounds --preset h200     # GPT-2-124M shape, Shakespeare (GPU)

Uses the PoPE model of `experiments.language_model` in the same --out (trained first if missing)
and held-out windows of the validation split (`score_bounds` below: kernel-specific analysis stays
out of `pope_jax`). Per layer: the share of query tiles (windows x heads x the forward kernel's query tiles, 192 rows at head
dims <= 64 and 128 above) whose bound on |score| is within the
kernel's limit (those take `BlockSizes(bounded_softmax=True)`'s softmax without a running max),
the median and largest bound, and the largest |score| itself (how loose the bound is), all in
log2 units. Outputs: OUT/score_bounds.json, OUT/score_bounds.md, OUT/score_bounds.png (per layer:
the bounded share; the median and largest bound beside the largest |score| and the limit).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from pallas_kernels.pope_attention import (BOUNDED_SCORE_LIMIT, SUPPORTED_HEAD_DIMS,
                                           default_block_sizes, forward_tile_rows,
                                           tile_score_bound)
from pope_jax import analysis, atomic, encodings, reporting
from pope_jax.config import ModelConfig
from pope_jax.model import num_params
from pope_jax.tasks import frequency_usage, language_model as lm


def score_bounds(config: ModelConfig, params: Any,
                 batches: Iterable[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """How often the fused PoPE kernel's magnitude bound lets a query tile skip the running max.

  For each layer, every window of `batches`, every head and every query tile of the window
  (the forward kernel's, `pallas_kernels.pope_attention.forward_tile_rows` at the default
  blocks: 192 rows at head dims <= 64, else 128; the last one zero-padded): the kernel's
  bound on the tile's scores (`pallas_kernels.pope_attention.tile_score_bound`,
  Cauchy-Schwarz on PoPE's Cartesian vectors)
  beside the largest |score| it bounds, both in log2 units at the logit scale 1/sqrt(H) (the
  kernel's units). The largest score is over every key of the window, causal or not, as the
  bound does not use the mask. The model runs at its default positions, without frequency
  multipliers, with the XLA reference attention (the bound needs no kernel). A tile is bounded
  when its bound is at most `BOUNDED_SCORE_LIMIT`; with
  `BlockSizes(bounded_softmax=True)` such tiles take P = exp2(scores) with no running max.

  Args:
    config: a PoPE model's config.
    params: its parameters.
    batches: records batched as {"inputs": int [B, T]}, B, T > 0.

  Returns:
    {"bound": [L, M], "max_score": [L, M]} float32 numpy arrays over the M tiles of all windows,
    heads and tiles, "limit": the kernel's limit, and "tile_rows": the tiles' rows.

  Raises:
    ValueError: a config whose pos_encoding is not "pope", inputs not of shape [B, T] with
      B, T > 0, or no batch.
  """
  if config.pos_encoding != "pope":
    raise ValueError(f"score_bounds needs pos_encoding 'pope', got {config.pos_encoding!r}")
  config = dataclasses.replace(config, attention_implementation="xla")
  h = config.head_size
  tile_rows = forward_tile_rows(default_block_sizes(h), h, h, jnp.bfloat16)
  log2_scale = 1.0 / (math.sqrt(h) * math.log(2))

  @jax.jit
  def per_layer(params, tokens):
    t_len = tokens.shape[1]
    t_pad = -(-t_len // tile_rows) * tile_rows
    positions = jnp.arange(t_len)
    bounds, maxima = [], []
    for i, (q, k) in enumerate(analysis.layer_projections(config, params, tokens)):
      qp = jnp.pad(q, ((0, 0), (0, t_pad - t_len), (0, 0), (0, 0)))
      bounds.append(tile_score_bound(qp, k, log2_scale, tile_rows).reshape(-1))
      delta = params[f"block_{i}"]["attn"]["delta"]
      a = encodings.pope_cartesian(q, positions, base=config.pope_base,
                                   phase=-encodings.clamp_phase_bias(delta))
      b = encodings.pope_cartesian(k, positions, base=config.pope_base)
      b = jnp.repeat(b, q.shape[2] // k.shape[2], axis=2)                # kv head n // group
      scores = jnp.abs(jnp.einsum("btnd,bsnd->bnts", a, b)).max(-1) * log2_scale   # [B, N, T]
      scores = jnp.pad(scores, ((0, 0), (0, 0), (0, t_pad - t_len)))
      maxima.append(scores.reshape(*scores.shape[:2], -1, tile_rows).max(-1).reshape(-1))
    return jnp.stack(bounds), jnp.stack(maxima)

  bounds, maxima = [], []
  for batch in batches:
    tokens = jnp.asarray(batch["inputs"], jnp.int32)
    if tokens.ndim != 2 or 0 in tokens.shape:
      raise ValueError(f"score_bounds takes inputs of shape [B, T] with B, T > 0, got "
                       f"{tokens.shape}")
    bound, max_score = per_layer(params, tokens)
    bounds.append(np.asarray(bound))
    maxima.append(np.asarray(max_score))
  if not bounds:
    raise ValueError("score_bounds got no batch")
  return {"bound": np.concatenate(bounds, 1), "max_score": np.concatenate(maxima, 1),
          "limit": BOUNDED_SCORE_LIMIT, "tile_rows": tile_rows}


def run(lm_preset: lm.Preset, out: Path, *, preset_name: str, max_windows: int, resume: bool,
        progress: bool, data_dir: Path | None = None,
        splits: dict[str, str] | None = None) -> dict:
  """Measures the PoPE model's score bounds and writes OUT/score_bounds.{json,md,png}."""
  n, batches = lm.validation_batches(lm_preset, out, data_dir, splits, max_windows)
  _, params, cfg = lm.train_model(lm_preset, "pope", out, resume=resume, progress=progress,
                                  data_dir=data_dir, splits=splits)
  result = score_bounds(cfg, params, batches())
  bound, max_score, limit = result["bound"], result["max_score"], result["limit"]
  tile_rows = result["tile_rows"]
  rows = [[i, f"{100 * np.mean(bound[i] <= limit):.1f}", f"{np.median(bound[i]):.1f}",
           f"{bound[i].max():.1f}", f"{max_score[i].max():.1f}"] for i in range(len(bound))]
  table = reporting.markdown_table(
      ["layer", "bounded tiles (%)", "median bound", "max bound", "max abs score"], rows)
  overall = float(np.mean(bound <= limit))
  note = ("" if cfg.head_size in SUPPORTED_HEAD_DIMS else
          f" (This model's head dim {cfg.head_size} is not one the kernel runs, "
          f"{SUPPORTED_HEAD_DIMS}: the shares show what the bound would give.)")
  about = reporting.what_ran(
      preset=preset_name, description=lm_preset.description, params=num_params(cfg),
      steps=lm_preset.train.steps,
      batch=f"{lm_preset.train.batch_size} windows of {lm_preset.seq_len} tokens",
      data=f"{n} validation windows of {lm_preset.seq_len} tokens",
      paper="not in the paper (a property of this project's fused kernel)",
      expect="the share of tiles that can skip the running max; it depends on the trained "
             "magnitudes, so small models say little about large ones")
  atomic.write_text(out / "score_bounds.md", (
      "# PoPE score bounds of a trained model\n\n" + about + "\n"
      f"{bound.shape[1]} query tiles (windows x heads x {tile_rows}-row tiles) per layer. Bounds "
      f"and scores in log2 units; a tile is bounded when its bound is at most {limit:g}. Bounded "
      f"overall: {100 * overall:.1f} %.{note}\n\n" + table))
  record = {"bounded_share": overall,
            "per_layer": [{"bounded_share": float(np.mean(b <= limit)),
                           "bound_median": float(np.median(b)), "bound_max": float(b.max()),
                           "max_score": float(m.max())} for b, m in zip(bound, max_score)],
            "limit": limit, "tile_rows": tile_rows, "windows": n,
            "seq_len": lm_preset.seq_len,
            "config": {"lm_preset": lm_preset},
            "metadata": reporting.run_metadata(lm_preset.train.seed)}
  reporting.write_json(out / "score_bounds.json", record)
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
  parser = common.make_parser("score_bounds", __doc__, common.lm_presets_help(lm.PRESETS))
  common.add_lm_flags(parser, "runs/language_model")
  parser.add_argument("--max-windows", type=common.positive_int,
                      help="validation windows to measure (default: the preset's)")
  args = parser.parse_args(argv)
  if "pope" not in common.encodings_list(parser, args.encodings, ("rope", "pope")):
    parser.error(f"--encodings {args.encodings!r}: score_bounds measures the PoPE model")
  max_windows = (frequency_usage.MAX_WINDOWS[args.preset] if args.max_windows is None
                 else args.max_windows)
  try:
    preset = common.resolve_lm_preset(args)
  except ValueError as e:  # A config that refuses a flag's value: a usage error.
    parser.error(str(e))
  with common.locked(parser, args.out), common.usage_errors(parser):
    try:
      return run(preset, args.out, preset_name=args.preset, max_windows=max_windows,
                 resume=args.resume, progress=not args.no_progress, data_dir=args.data_dir,
                 splits=args.splits)
    except FileNotFoundError as e:
      parser.error(str(e))


if __name__ == "__main__":
  main()
