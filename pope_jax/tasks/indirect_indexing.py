"""Indirect indexing (PoPE §4, App. A): presets, training all seeds of an encoding side by side,
accuracy per shift, and the results page.

Shift 0 (copy the queried letter) is a fixed-offset lookup; the other shifts need the two-hop lookup
the task is about (find the letter, then move), so accuracy is also reported per shift.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pope_jax import reporting
from pope_jax.config import MODEL_PRESETS, ModelConfig, TrainConfig
from pope_jax.data import indirect_indexing as task
from pope_jax.model import Transformer, num_params
from pope_jax.run_lock import run_lock
from pope_jax.tasks.preset import ExperimentPreset
from pope_jax.train import (RESULT_NEUTRAL_FIELDS, ResumeError, config_diff, has_checkpoints,
                            train_and_evaluate)

PAPER = "8 x 512, 100k steps, 3 seeds, test accuracy: RoPE 11.16 ± 2.45 %, PoPE 94.82 ± 2.91 %"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset(ExperimentPreset):
  task: task.IndirectIndexingConfig
  model: ModelConfig
  train: TrainConfig


ENCODINGS = ("rope", "pope", "none")
_PAPER_MODEL = dataclasses.replace(MODEL_PRESETS["indirect_indexing"], vocab_size=len(task.VOCAB))
PRESETS: dict[str, Preset] = {
    # PoPE App. A: 8 layers x 512 x 8 heads, batch 64, 100k steps, lr 2e-4 -> 2e-5 cosine, 4000
    # warm-up, AdamW beta2 0.99, weight decay 0.01, clip 1.0, delta ~ U(-2pi, 0).
    "paper": Preset(
        task=task.IndirectIndexingConfig(),
        model=_PAPER_MODEL,
        train=TrainConfig(steps=100_000, batch_size=64, learning_rate=2e-4, min_learning_rate=2e-5,
                          warmup_steps=4000, b2=0.99, weight_decay=0.01, grad_clip=1.0,
                          eval_every=5000, eval_batches=20, checkpoint_every=5000, log_every=500,
                          steps_per_call=50, data_workers=2),
        description="the paper's configuration (App. A)",
        expect="the paper's budget: about its numbers (RoPE near 11 %, PoPE near 95 %)"),
    # A shorter task (10-16 letters, shifts within +-3) and a 2-layer model: both encodings in
    # ~4 minutes on 2 CPU cores. At this budget both learn only the easy part of the task (shift
    # 0); the paper's gap appears late in long training (see README).
    "cpu": Preset(
        task=task.IndirectIndexingConfig(min_length=10, max_length=16, max_shift=3),
        model=dataclasses.replace(_PAPER_MODEL, num_layers=2, d_model=128, num_heads=8),
        train=TrainConfig(steps=1500, batch_size=64, learning_rate=1e-3, min_learning_rate=1e-4,
                          warmup_steps=100, b2=0.99, eval_every=250, eval_batches=8,
                          checkpoint_every=250, log_every=50, steps_per_call=10),
        description="a shorter task and a 2-layer model, ~4 minutes on 2 CPU cores",
        expect="1.5 % of the paper's steps: both encodings learn only shift 0 (copy the queried "
               "letter); the paper's gap appears late in long training"),
    "smoke": Preset(
        task=task.IndirectIndexingConfig(
            min_length=6, max_length=10, max_shift=3,
            split_sizes=(("train", 2000), ("validation", 64), ("test", 64))),
        model=dataclasses.replace(_PAPER_MODEL, num_layers=1, d_model=32, num_heads=2),
        train=TrainConfig(steps=30, batch_size=16, learning_rate=3e-3, min_learning_rate=3e-4,
                          warmup_steps=5, eval_every=10, eval_batches=2, checkpoint_every=10,
                          log_every=10, steps_per_call=2),
        description="a seconds-long run for tests",
        expect="a plumbing check: the numbers mean nothing"),
}


def accuracy_by_shift(model_cfg: ModelConfig, params: Any, source: task.IndirectIndexingSource,
                      batch_size: int = 256) -> dict[str, float]:
  """Final-token accuracy of one model on a whole split, per shift: {"-15": acc, ..., "15": acc}.

  Shift 0 (copy the queried letter) is a fixed-offset lookup; the other shifts need the two-hop
  lookup the task is about (find the letter, then move), so the split separates the two.
  """
  model = Transformer(model_cfg)
  predict = jax.jit(lambda p, x: jnp.argmax(model.apply({"params": p}, x), axis=-1))
  hits: dict[int, int] = {}
  counts: dict[int, int] = {}
  for start in range(0, len(source), batch_size):
    index = range(start, min(start + batch_size, len(source)))
    records = [source[i] for i in index]
    pred = np.asarray(predict(params, np.stack([r["inputs"] for r in records])))
    for i, r, p in zip(index, records, pred):
      t = int(np.argmax(r["weights"]))
      shift = task.generate_example(source.config, source.seed, source.split, i)[2]
      hits[shift] = hits.get(shift, 0) + int(p[t] == r["targets"][t])
      counts[shift] = counts.get(shift, 0) + 1
  return {str(k): hits[k] / counts[k] for k in sorted(counts)}


def _shift_split(by_shift: dict[str, float]) -> tuple[float, float]:
  """(accuracy at shift 0, mean accuracy over the other shifts), unweighted over shifts."""
  others = [v for k, v in by_shift.items() if k != "0"]
  return by_shift.get("0", math.nan), (sum(others) / len(others) if others else math.nan)


def run_encoding(preset: Preset, encoding: str, seeds: list[int], out: Path, *, resume: bool,
                 progress: bool = True, lock: bool = True) -> list[dict]:
  """Trains all seeds of one encoding side by side (vmapped) in OUT/<encoding>/.

  Args:
    lock: hold OUT/<encoding>'s run lock (`pope_jax.run_lock`) for the whole call; False when the
      caller already holds it. Encodings lock separately, so each can run in its own process.

  Returns one result dict per seed (also written to OUT/<encoding>/result.json).

  Raises:
    RunLockedError: another run is writing OUT/<encoding>.
    ResumeError: resume=True and OUT/<encoding> holds a finished run with other settings.
    NotADirectoryError: OUT/<encoding>/checkpoints is a file.
  """
  locked = run_lock(out / encoding) if lock and jax.process_index() == 0 else None
  with locked or contextlib.nullcontext():
    return _run_encoding(preset, encoding, seeds, out, resume=resume, progress=progress)


def _run_encoding(preset: Preset, encoding: str, seeds: list[int], out: Path, *, resume: bool,
                  progress: bool) -> list[dict]:
  """`run_encoding` once OUT/<encoding> is locked."""
  workdir = out / encoding
  result_file = workdir / "result.json"
  model_cfg = dataclasses.replace(preset.model, pos_encoding=encoding)
  config = {"task": preset.task, "model": model_cfg, "train": preset.train}
  if resume and result_file.exists():
    done = json.loads(result_file.read_text())
    diff = config_diff(done["config"], json.loads(json.dumps(reporting.to_jsonable(config))),
                       RESULT_NEUTRAL_FIELDS)
    diff += ["seeds"] if done["seeds"] != seeds else []
    if diff:
      raise ResumeError(f"--resume: {result_file} holds a finished run with another configuration "
                        f"or seeds (differs in {', '.join(diff)}); use another --out")
    return done["runs"]
  # --resume continues an encoding that has checkpoints and starts one that has none yet (a file
  # named checkpoints is an error, not "not begun").
  resume = resume and has_checkpoints(workdir)
  sources = {split: task.IndirectIndexingSource(preset.task, split)
             for split in ("train", "validation", "test")}
  results = train_and_evaluate(
      model_cfg, preset.train, train_source=sources["train"],
      eval_sources={"validation": sources["validation"], "test": sources["test"]},
      workdir=workdir, resume=resume, seeds=seeds, progress=progress, lock=False)
  runs = [{"encoding": encoding, "seed": r.seed, "test_accuracy": r.metrics["test"]["accuracy"],
           "validation_accuracy": r.metrics["validation"]["accuracy"],
           "test_loss": r.metrics["test"]["loss"], "steps_per_second": r.steps_per_second,
           "test_accuracy_by_shift": accuracy_by_shift(model_cfg, r.params, sources["test"]),
           "history": r.history} for r in results]
  reporting.write_json(result_file, {
      "encoding": encoding, "seeds": seeds, "runs": runs,
      "config": config, "metadata": reporting.run_metadata()})
  return runs


def _what_ran(preset_name: str, config: dict) -> str:
  """The "what ran" section of results.md from a run's stored config (JSON)."""
  cfg = task.IndirectIndexingConfig(**{**config["task"], "split_sizes": tuple(
      tuple(s) for s in config["task"]["split_sizes"])})
  model = ModelConfig(**config["model"])
  train = config["train"]
  sizes = dict(cfg.split_sizes)
  lengths = range(cfg.min_length, cfg.max_length + 1)
  pick = 100 * sum(1 / n for n in lengths) / len(lengths)
  every = ("the whole validation split" if train["eval_batches"] is None else
           f"the first {min(sizes['validation'], train['eval_batches'] * train['batch_size'])} "
           f"of {sizes['validation']} validation examples")
  return reporting.what_ran(
      preset=preset_name, description=PRESETS[preset_name].description if preset_name in PRESETS
      else "a configuration of no preset", params=num_params(model), steps=train["steps"],
      batch=f"{train['batch_size']} examples of {cfg.seq_len} tokens",
      data=(f"strings of {cfg.min_length}-{cfg.max_length} distinct letters, shifts within "
            f"+-{cfg.max_shift}; {sizes['train']} train, {sizes['validation']} validation, "
            f"{sizes['test']} test examples (the table: the whole test split)"),
      periodic=f"validation accuracy on {every} every {train['eval_every']} steps",
      chance=(f"{100 / len(task.LETTERS):.1f} % guessing one of the {len(task.LETTERS)} "
              f"letters; {pick:.1f} % guessing a letter of the string"),
      paper=PAPER, expect=PRESETS[preset_name].expect if preset_name in PRESETS else "n/a")


def summarize(out: Path) -> dict:
  """Collects OUT/*/result.json into results.json, results.md and accuracy.png."""
  files = sorted(out.glob("*/result.json"))
  if not files:
    raise FileNotFoundError(f"no finished runs (*/result.json) under {out}")
  runs, configs = [], {}
  for f in files:
    done = json.loads(f.read_text())
    runs += done["runs"]
    configs[done["encoding"]] = {"config": done["config"], "metadata": done["metadata"]}
  by_enc: dict[str, list[dict]] = {}
  for r in sorted(runs, key=lambda r: (ENCODINGS.index(r["encoding"]), r["seed"])):
    by_enc.setdefault(r["encoding"], []).append(r)
  rows, summary = [], {}
  for enc, rs in by_enc.items():
    accs = [100 * r["test_accuracy"] for r in rs]
    sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
    speed = rs[0]["steps_per_second"]  # None (NaN in older files) when it was not measured.
    speed = None if speed is None or not math.isfinite(speed) else speed
    summary[enc] = {"test_accuracy_mean": statistics.mean(accs), "test_accuracy_sd": sd,
                    "seeds": [r["seed"] for r in rs], "per_seed": accs, "steps_per_second": speed}
    spread = f" ± {sd:.2f}" if len(accs) > 1 else " (1 seed)"
    # Runs finished before the per-shift breakdown existed have none.
    splits = [_shift_split(r["test_accuracy_by_shift"]) for r in rs
              if r.get("test_accuracy_by_shift")]
    zero, other = (("n/a", "n/a") if not splits else
                   (f"{100 * statistics.mean(z for z, _ in splits):.1f}",
                    f"{100 * statistics.mean(o for _, o in splits):.1f}"))
    rows.append([enc, f"{statistics.mean(accs):.2f}{spread}", len(accs),
                 ", ".join(f"{a:.2f}" for a in accs), zero, other,
                 reporting.fmt(speed, ".1f")])
  table = reporting.markdown_table(
      ["encoding", "test accuracy % (mean ± sd)", "seeds", "per seed", "shift 0 %",
       "other shifts % (mean over shifts)", "steps/s (all seeds together)"], rows)
  first = next(iter(configs.values()))["config"]
  preset_name = next((n for n, p in PRESETS.items() if reporting.to_jsonable(p.task) ==
                      first.get("task")), "custom")
  about = (_what_ran(preset_name, first) if first.get("task") else
           f"- Configuration not recorded.\n- Paper: {PAPER}.\n")
  reporting.write_results(
      out, title="Indirect indexing", about=about, table=table,
      record={"summary": summary, "runs": runs, "configs": configs}, runs=runs,
      plot="accuracy.png", metric="validation_accuracy", ylabel="validation accuracy (%)",
      scale=100)
  return summary


