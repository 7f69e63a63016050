"""JSB-style Bach chorales (PoPE App. A): train RoPE and PoPE, report test NLL per token.

    python -m experiments.jsb                      # CPU default preset
    python -m experiments.jsb --preset paper       # the paper's configuration (GPU)
    python -m experiments.jsb --preset smoke       # seconds, for tests (a dozen scores)

Data: `pope_jax.data.jsb` (music21's Bach corpus → SATB 16th-note raster tokens, fixed split in
JSB's 229/76/77 proportions), cached under $POPE_JAX_CACHE (default ~/.cache/pope_jax). The paper
reports RoPE 0.5081 and PoPE 0.4889 test NLL on the original JSB data; this is a different
extraction, so only the direction of the gap compares.

Each encoding's run lives in OUT/<encoding>/ (orbax checkpoints, metrics.jsonl, result.json);
`--resume` continues unfinished runs, finished ones with the same config are reused. Outputs:
OUT/results.json, OUT/results.md, OUT/loss.png (validation NLL vs step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from experiments import common
from pope_jax.config import MODEL_PRESETS, ModelConfig, TrainConfig
from pope_jax.data import jsb
from pope_jax.train import has_checkpoints, train_and_evaluate


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
  model: ModelConfig
  train: TrainConfig
  seq_len: int
  transpositions: tuple[int, ...] = (0,)
  num_files: int | None = None        # First N files of music21's corpus/bach (None = all).
  description: str = ""


_PAPER_MODEL = dataclasses.replace(MODEL_PRESETS["jsb"], vocab_size=jsb.VOCAB_SIZE)
PRESETS: dict[str, Preset] = {
    # PoPE App. A: 6 layers x 256 x 8 heads, dropout 0.2, delta ~ U(-2pi, 0), batch 4 x 2048,
    # 3000 steps, lr 6e-4 -> 6e-5, 10 warm-up, beta2 0.99, wd 0.01, clip 1.0.
    "paper": Preset(
        model=_PAPER_MODEL,
        train=TrainConfig(steps=3000, batch_size=4, learning_rate=6e-4, min_learning_rate=6e-5,
                          warmup_steps=10, b2=0.99, eval_every=250, checkpoint_every=500,
                          log_every=50, steps_per_call=10),
        seq_len=2048, description="the paper's configuration (App. A)"),
    "cpu": Preset(
        model=dataclasses.replace(_PAPER_MODEL, num_layers=2, d_model=128, num_heads=4),
        train=TrainConfig(steps=300, batch_size=4, learning_rate=1e-3, min_learning_rate=1e-4,
                          warmup_steps=10, b2=0.99, eval_every=100, checkpoint_every=100,
                          log_every=20, steps_per_call=10),
        seq_len=512, description="2 layers x 128, context 512: minutes on 2 CPU cores"),
    "smoke": Preset(
        model=dataclasses.replace(_PAPER_MODEL, num_layers=1, d_model=32, num_heads=2),
        train=TrainConfig(steps=4, batch_size=2, learning_rate=3e-3, min_learning_rate=3e-4,
                          warmup_steps=1, eval_every=2, eval_batches=2, checkpoint_every=2,
                          log_every=2, steps_per_call=2),
        seq_len=64, transpositions=(-1, 0, 1), num_files=8, description="seconds, for tests"),
}


def run_one(preset: Preset, encoding: str, out: Path, *, resume: bool, progress: bool = True,
            cache_dir: Path | None = None) -> dict:
  paths = jsb.music21_bach_paths()
  if preset.num_files is not None:
    paths = [p for p in paths if p.suffix == ".mxl"][:preset.num_files]
  sources, chorales, split = jsb.jsb_sources(preset.seq_len, transpositions=preset.transpositions,
                                             paths=paths, cache_dir=cache_dir, progress=progress)
  model_cfg = dataclasses.replace(preset.model, pos_encoding=encoding)
  config = {"model": model_cfg, "train": preset.train, "seq_len": preset.seq_len,
            "transpositions": preset.transpositions, "num_files": preset.num_files}
  workdir = out / encoding
  result_file = workdir / "result.json"
  if result_file.exists():
    done = json.loads(result_file.read_text())
    if done["config"] == json.loads(json.dumps(common.to_jsonable(config))):
      return done
  result = train_and_evaluate(
      model_cfg, preset.train, train_source=sources["train"],
      eval_sources={"valid": sources["valid"], "test": sources["test"]}, workdir=workdir,
      resume=resume and has_checkpoints(workdir), progress=progress)
  if isinstance(result, list):                 # One result per seed trained together.
    result = result[0]
  record = {
      "encoding": encoding, "test_nll": result.metrics["test"]["loss"],
      "valid_nll": result.metrics["valid"]["loss"],
      "test_accuracy": result.metrics["test"]["accuracy"],
      "steps_per_second": result.steps_per_second, "history": result.history,
      "data": {"pieces": {k: len(v) for k, v in split.items()},
               "records": {k: len(v) for k, v in sources.items()}, "skipped": chorales.skipped,
               "vocab_size": jsb.VOCAB_SIZE},
      "config": config, "metadata": common.run_metadata(preset.train.seed),
  }
  common.write_json(result_file, record)
  return json.loads(json.dumps(common.to_jsonable(record)))


def summarize(out: Path, runs: list[dict], preset_name: str) -> dict:
  rows = [[r["encoding"], f"{r['test_nll']:.4f}", f"{r['valid_nll']:.4f}",
           f"{100 * r['test_accuracy']:.1f}", common.fmt(r["steps_per_second"], ".2f")]
          for r in runs]
  table = common.markdown_table(
      ["encoding", "test NLL/token", "valid NLL/token", "test accuracy %", "steps/s"], rows)
  common.write_results(
      out, title=f"JSB chorales from music21 ({preset_name} preset)", table=table,
      note="Paper (original JSB, 6 x 256, 3000 steps): RoPE 0.5081, PoPE 0.4889 test NLL.",
      record={"preset": preset_name, "runs": runs}, runs=runs, plot="loss.png",
      metric="valid_loss", ylabel="validation NLL per token")
  return {r["encoding"]: r["test_nll"] for r in runs}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  parser.add_argument("--encodings", default="rope,pope")
  parser.add_argument("--steps", type=int, help="override the preset's optimiser steps")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--transpose", type=int, default=None,
                      help="augment training with shifts -N..N semitones (0 = none)")
  parser.add_argument("--cache-dir", type=Path, help="extracted-chorale cache folder")
  parser.add_argument("--out", type=Path, default=Path("runs/jsb"))
  parser.add_argument("--resume", action="store_true",
                      help="continue unfinished runs from their checkpoints in --out")
  parser.add_argument("--no-progress", action="store_true")
  common.add_init_std_flag(parser)
  args = parser.parse_args(argv)
  preset = PRESETS[args.preset]
  train = dataclasses.replace(preset.train, seed=args.seed)
  if args.steps:
    train = common.with_steps(train, args.steps)
  try:
    preset = dataclasses.replace(preset, train=train,
                                 model=common.with_init_std(preset.model, args.init_std))
  except ValueError as e:
    parser.error(str(e))
  if args.transpose is not None:
    preset = dataclasses.replace(preset, transpositions=tuple(range(-args.transpose,
                                                                    args.transpose + 1)))
  runs = []
  for enc in [e.strip() for e in args.encodings.split(",") if e.strip()]:
    if enc not in ("rope", "pope"):
      raise SystemExit(f"--encodings: unknown encoding {enc!r}")
    with common.usage_errors(parser):
      r = run_one(preset, enc, args.out, resume=args.resume, progress=not args.no_progress,
                  cache_dir=args.cache_dir)
    print(f"{enc}: test NLL {r['test_nll']:.4f}", flush=True)
    runs.append(r)
  return summarize(args.out, runs, args.preset)


if __name__ == "__main__":
  main()
