"""JSB-style Bach chorales (PoPE App. A): presets, one encoding's training run, results page.

Data: `pope_jax.data.jsb` (music21's Bach corpus as SATB 16th-note raster tokens, fixed split in
JSB's 229/76/77 proportions). The paper's numbers are on the original JSB data; this is a different
extraction, so only the direction of the gap compares.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from pope_jax import reporting
from pope_jax.config import MODEL_PRESETS, ModelConfig, TrainConfig
from pope_jax.data import jsb
from pope_jax.model import num_params
from pope_jax.train import has_checkpoints, train_and_evaluate

PAPER = "original JSB, 6 x 256, 3000 steps: test NLL per token RoPE 0.5081, PoPE 0.4889"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
  model: ModelConfig
  train: TrainConfig
  seq_len: int
  transpositions: tuple[int, ...] = (0,)
  num_files: int | None = None        # First N files of music21's corpus/bach (None = all).
  description: str = ""
  expect: str = ""                    # What the results show at this budget (results.md).


_PAPER_MODEL = dataclasses.replace(MODEL_PRESETS["jsb"], vocab_size=jsb.VOCAB_SIZE)
PRESETS: dict[str, Preset] = {
    # PoPE App. A: 6 layers x 256 x 8 heads, dropout 0.2, delta ~ U(-2pi, 0), batch 4 x 2048,
    # 3000 steps, lr 6e-4 -> 6e-5, 10 warm-up, beta2 0.99, wd 0.01, clip 1.0.
    "paper": Preset(
        model=_PAPER_MODEL,
        train=TrainConfig(steps=3000, batch_size=4, learning_rate=6e-4, min_learning_rate=6e-5,
                          warmup_steps=10, b2=0.99, eval_every=250, checkpoint_every=500,
                          log_every=50, steps_per_call=10),
        seq_len=2048, description="the paper's configuration (App. A)",
        expect="the paper's budget on another extraction of the chorales: only the direction of "
               "the RoPE/PoPE gap compares"),
    "cpu": Preset(
        model=dataclasses.replace(_PAPER_MODEL, num_layers=2, d_model=128, num_heads=4),
        train=TrainConfig(steps=300, batch_size=4, learning_rate=1e-3, min_learning_rate=1e-4,
                          warmup_steps=10, b2=0.99, eval_every=100, checkpoint_every=100,
                          log_every=20, steps_per_call=10),
        seq_len=512, description="2 layers x 128, context 512: minutes on 2 CPU cores",
        expect="10 % of the paper's steps on a small model: NLL near 1.0, and PoPE may still "
               "trail RoPE (it did in the last recorded run, 2026-12-01)"),
    "smoke": Preset(
        model=dataclasses.replace(_PAPER_MODEL, num_layers=1, d_model=32, num_heads=2),
        train=TrainConfig(steps=4, batch_size=2, learning_rate=3e-3, min_learning_rate=3e-4,
                          warmup_steps=1, eval_every=2, eval_batches=2, checkpoint_every=2,
                          log_every=2, steps_per_call=2),
        seq_len=64, transpositions=(-1, 0, 1), num_files=8, description="seconds, for tests",
        expect="a plumbing check: the numbers mean nothing"),
}


def run_one(preset: Preset, encoding: str, out: Path, *, resume: bool, progress: bool = True,
            cache_dir: Path | None = None) -> dict:
  """Trains one encoding in OUT/<encoding>/, or reuses a finished run with the same config.

  Returns:
    The run's record (also OUT/<encoding>/result.json): test/valid NLL per token, test accuracy,
    speed, history, data sizes, config and metadata.
  """
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
    if done["config"] == json.loads(json.dumps(reporting.to_jsonable(config))):
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
      "config": config, "metadata": reporting.run_metadata(preset.train.seed),
  }
  reporting.write_json(result_file, record)
  return json.loads(json.dumps(reporting.to_jsonable(record)))


def summarize(out: Path, runs: list[dict], preset_name: str) -> dict[str, float]:
  """Writes OUT/results.{md,json} and OUT/loss.png; returns {encoding: test NLL}."""
  rows = [[r["encoding"], f"{r['test_nll']:.4f}", f"{r['valid_nll']:.4f}",
           f"{100 * r['test_accuracy']:.1f}", reporting.fmt(r["steps_per_second"], ".2f")]
          for r in runs]
  table = reporting.markdown_table(
      ["encoding", "test NLL/token", "valid NLL/token", "test accuracy %", "steps/s"], rows)
  first = runs[0]
  train, data = first["config"]["train"], first["data"]
  every = ("the whole validation split" if train["eval_batches"] is None else
           f"the first {train['eval_batches'] * train['batch_size']} validation windows")
  about = reporting.what_ran(
      preset=preset_name, description=PRESETS[preset_name].description,
      params=num_params(ModelConfig(**first["config"]["model"])), steps=train["steps"],
      batch=f"{train['batch_size']} windows of {first['config']['seq_len']} tokens",
      data=(f"Bach chorales from music21 as SATB 16th-note tokens, pieces per split "
            f"{data['pieces']}, transpositions {first['config']['transpositions']}"),
      periodic=f"validation NLL on {every} every {train['eval_every']} steps",
      chance=(f"a uniform guess over the {data['vocab_size']} tokens has NLL "
              f"{math.log(data['vocab_size']):.2f} nats"),
      paper=PAPER, expect=PRESETS[preset_name].expect)
  reporting.write_results(
      out, title=f"JSB chorales from music21 ({preset_name} preset)", about=about, table=table,
      record={"preset": preset_name, "runs": runs}, runs=runs, plot="loss.png",
      metric="valid_loss", ylabel="validation NLL per token")
  return {r["encoding"]: r["test_nll"] for r in runs}


