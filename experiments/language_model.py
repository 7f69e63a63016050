"""Language modelling on real text: train RoPE and PoPE Transformers, report validation perplexity.

    python -m experiments.language_model                    # CPU default: Shakespeare, BPE 4096
    python -m experiments.language_model --preset smoke     # seconds, for tests
    python -m experiments.language_model --preset h200      # GPT-2-124M shape, Shakespeare (GPU)
    python -m experiments.language_model --preset paper     # GPT-2-124M, 100k steps (GPU, OWT)
    python -m experiments.language_model --preset paper --data-dir /data/owt \\
        --splits train=train.bin,valid=val.bin                  # nanoGPT OpenWebText token files

By default the data is the `shakespeare` package's complete works (modern edition), split by play
and tokenised with a byte-level BPE trained on the training plays (`pope_jax.data.text`), written
once to OUT/data/. `--data-dir` points the same loader at your own uint16 token files instead.

Each encoding's run lives in OUT/<encoding>/ (orbax checkpoints, metrics.jsonl, params.msgpack,
result.json). A finished run with the same configuration is reused (also by
`experiments.length_extrapolation` and `experiments.frequency_usage`, given the same --out);
`--resume` continues an unfinished one from its latest checkpoint. Outputs:
OUT/results.json, OUT/results.md, OUT/loss.png (validation loss vs step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import flax.serialization
import jax
from jax.experimental import multihost_utils
import numpy as np

from experiments import common
from pope_jax.config import MODEL_PRESETS, ModelConfig, TrainConfig
from pope_jax.data import text
from pope_jax.train import has_checkpoints, train_and_evaluate


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
  model: ModelConfig                 # vocab_size is replaced by the data's (rounded up to 64).
  train: TrainConfig
  seq_len: int
  tokenizer: str = "bpe"
  vocab_size: int = 4096             # BPE vocabulary requested.
  works: tuple[str, ...] | None = None
  train_stride: int | None = None    # Window stride over train.bin (default seq_len).
  description: str = ""


_GPT2 = MODEL_PRESETS["gpt2_124m"]
PRESETS: dict[str, Preset] = {
    # PoPE App. A, OpenWebText 124M: 12 x 768 x 12 heads, delta init 0, batch 64 x 1024, 100k
    # steps, lr 6e-4 -> 6e-5, 1000 warm-up, beta2 0.95, wd 0.01, clip 1.0. Meant for --data-dir
    # with OpenWebText; on Shakespeare (1.5M tokens) it overfits long before 100k steps.
    "paper": Preset(
        model=dataclasses.replace(_GPT2, dtype="bfloat16"),
        train=TrainConfig(steps=100_000, batch_size=64, learning_rate=6e-4, min_learning_rate=6e-5,
                          warmup_steps=1000, b2=0.95, eval_every=2000, eval_batches=50,
                          checkpoint_every=2000, log_every=100, steps_per_call=10,
                          data_workers=4),
        seq_len=1024, vocab_size=16384, train_stride=256,
        description="GPT-2-124M shape and the paper's OpenWebText schedule (GPU)"),
    # GPT-2-124M shape on Shakespeare for one GPU: 500 steps of 16 x 1024 tokens (~6 passes over
    # the training plays), dropout 0.1 against overfitting. Trained at L = 1024 for
    # experiments.length_extrapolation --preset h200.
    "h200": Preset(
        model=dataclasses.replace(_GPT2, dtype="bfloat16", dropout_rate=0.1),
        train=TrainConfig(steps=500, batch_size=16, learning_rate=6e-4, min_learning_rate=6e-5,
                          warmup_steps=50, b2=0.95, eval_every=100, eval_batches=20,
                          checkpoint_every=250, log_every=50, steps_per_call=10,
                          data_workers=2),
        seq_len=1024, vocab_size=8192, train_stride=256,
        description="GPT-2-124M shape on Shakespeare (BPE 8192), 500 steps: minutes on one GPU"),
    "cpu": Preset(
        model=dataclasses.replace(_GPT2, num_layers=4, d_model=128, num_heads=4),
        train=TrainConfig(steps=300, batch_size=8, learning_rate=2e-3, min_learning_rate=2e-4,
                          warmup_steps=30, b2=0.95, eval_every=100, eval_batches=10,
                          checkpoint_every=100, log_every=50, steps_per_call=10),
        seq_len=128, vocab_size=4096, train_stride=64,
        description="4 layers x 128, context 128, Shakespeare BPE 4096: minutes on 2 CPU cores"),
    "smoke": Preset(
        model=dataclasses.replace(_GPT2, num_layers=1, d_model=32, num_heads=2),
        train=TrainConfig(steps=8, batch_size=4, learning_rate=3e-3, min_learning_rate=3e-4,
                          warmup_steps=2, b2=0.95, eval_every=4, eval_batches=2,
                          checkpoint_every=4, log_every=4, steps_per_call=2),
        seq_len=32, vocab_size=400, works=("sonnets", "tempest", "phoenix_and_the_turtle"),
        description="a seconds-long run for tests"),
}


def prepare_data(preset: Preset, out: Path, data_dir: Path | None = None,
                 splits: dict[str, str] | None = None) -> tuple[Path, dict, dict]:
  """(data folder, meta, split files): OUT/data built from Shakespeare unless data_dir is given."""
  if data_dir is None:
    data_dir = out / "data"
    prepare = lambda: text.prepare_shakespeare(data_dir, tokenizer=preset.tokenizer,
                                               vocab_size=preset.vocab_size, works=preset.works)
    if jax.process_count() > 1:  # Multi-host: process 0 writes the files, the others reuse them.
      if jax.process_index() == 0:
        prepare()
      multihost_utils.sync_global_devices("experiments.language_model.prepare_data")
    meta = prepare()
    return data_dir, meta, meta["files"]
  meta_file = data_dir / "meta.json"
  meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
  return data_dir, meta, splits or meta.get("files") or {"train": "train.bin",
                                                         "valid": "valid.bin"}


def validation_batches(preset: Preset, out: Path, data_dir: Path | None,
                       splits: dict[str, str] | None, max_windows: int, batch: int = 8):
  """(n, batches): the first n = min(windows, max_windows) windows of the validation split and a
  function returning a fresh iterator over them as {"inputs", "weights"} numpy batches.

  Raises:
    FileNotFoundError: no validation split file (naming it).
  """
  data_dir_used, meta, files = prepare_data(preset, out, data_dir, splits)
  valid = data_dir_used / files.get("valid", "valid.bin")
  if not valid.is_file():
    raise FileNotFoundError(f"validation split {valid} not found (--data-dir, --splits)")
  source = text.TokenWindowSource(valid, preset.seq_len, dtype=meta.get("dtype", "uint16"))
  n = min(len(source), max_windows)

  def batches():
    for start in range(0, n, batch):
      recs = [source[i] for i in range(start, min(start + batch, n))]
      yield {k: np.stack([r[k] for r in recs]) for k in ("inputs", "weights")}

  return n, batches


def model_config(preset: Preset, encoding: str, meta: dict) -> ModelConfig:
  vocab = meta.get("vocab_size", preset.model.vocab_size)
  return dataclasses.replace(preset.model, pos_encoding=encoding,
                             vocab_size=-(-vocab // 64) * 64)


def load_params(path: Path) -> Any:
  return flax.serialization.msgpack_restore(path.read_bytes())


def train_model(preset: Preset, encoding: str, out: Path, *, resume: bool, progress: bool = True,
                data_dir: Path | None = None, splits: dict[str, str] | None = None,
                name: str | None = None, model_cfg: ModelConfig | None = None,
                train_cfg: TrainConfig | None = None, seq_len: int | None = None,
                init_params: Any = None) -> tuple[dict, Any, ModelConfig]:
  """Trains (or, with resume and a finished run, reloads) one model.

  Returns:
    (result record, params, model config). The record is also OUT/<name>/result.json and the
    params OUT/<name>/params.msgpack.
  """
  data_dir, meta, files = prepare_data(preset, out, data_dir, splits)
  model_cfg = model_cfg or model_config(preset, encoding, meta)
  train_cfg = train_cfg or preset.train
  seq_len = seq_len or preset.seq_len
  workdir = out / (name or encoding)
  result_file, params_file = workdir / "result.json", workdir / "params.msgpack"
  config = {"model": model_cfg, "train": train_cfg}
  if result_file.exists() and params_file.exists():          # Finished with the same config.
    done = json.loads(result_file.read_text())
    if done["config"] == json.loads(json.dumps(common.to_jsonable(config))):
      return done, load_params(params_file), model_cfg
  sources = text.token_sources(data_dir, seq_len, splits=files,
                               train_stride=preset.train_stride and min(preset.train_stride, seq_len))
  extra = {} if init_params is None else {"init_params": init_params}
  result = train_and_evaluate(
      model_cfg, train_cfg, train_source=sources["train"],
      eval_sources={k: v for k, v in sources.items() if k != "train"}, workdir=workdir,
      resume=resume and has_checkpoints(workdir), progress=progress, **extra)
  if isinstance(result, list):                 # One result per seed trained together.
    result = result[0]
  if jax.process_index() == 0:  # Multi-host: every process holds the same results; one writes.
    params_file.write_bytes(flax.serialization.msgpack_serialize(result.params))
  record = {
      "name": name or encoding, "encoding": encoding,
      "valid_loss": result.metrics["valid"]["loss"],
      "valid_perplexity": math.exp(result.metrics["valid"]["loss"]),
      "valid_accuracy": result.metrics["valid"]["accuracy"],
      "steps_per_second": result.steps_per_second,
      "tokens_per_second": result.steps_per_second * train_cfg.batch_size * seq_len,
      "history": result.history, "seq_len": seq_len,
      "data": {"dir": str(data_dir), "files": files, "tokenizer": meta.get("tokenizer"),
               "vocab_size": meta.get("vocab_size"), "num_tokens": meta.get("num_tokens"),
               "split": meta.get("split")},
      "config": config,
      "metadata": common.run_metadata(train_cfg.seed),
  }
  if jax.process_index() == 0:
    common.write_json(result_file, record)
  return json.loads(json.dumps(common.to_jsonable(record))), result.params, model_cfg


def summarize(out: Path, runs: list[dict], preset_name: str) -> dict:
  rows = [[r["encoding"], f"{r['valid_loss']:.4f}", f"{r['valid_perplexity']:.2f}",
           common.fmt(r["tokens_per_second"], ".0f")] for r in runs]
  table = common.markdown_table(
      ["encoding", "valid loss (nats/token)", "valid perplexity", "train tokens/s"], rows)
  common.write_results(
      out, title=f"Language modelling ({preset_name} preset)", table=table,
      note="Paper (OpenWebText, GPT-2-124M, 100k steps): RoPE 21.55, PoPE 21.33 validation "
           "perplexity.",
      record={"preset": preset_name, "runs": runs}, runs=runs, plot="loss.png",
      metric="valid_loss", ylabel="validation loss (nats/token)")
  return {r["encoding"]: r["valid_perplexity"] for r in runs}


def parse_splits(value: str | None) -> dict[str, str] | None:
  if not value:
    return None
  try:
    return dict(item.split("=", 1) for item in value.split(","))
  except ValueError:
    raise SystemExit(f"--splits must look like train=train.bin,valid=val.bin, got {value!r}")


def add_common_flags(parser: argparse.ArgumentParser, default_out: str) -> None:
  parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  parser.add_argument("--encodings", default="rope,pope", help="comma-separated rope,pope")
  parser.add_argument("--steps", type=int, help="override the preset's optimiser steps")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--data-dir", type=Path, help="folder of uint16 token files to use instead")
  parser.add_argument("--splits", help="split=file pairs in --data-dir, e.g. "
                                       "train=train.bin,valid=val.bin")
  parser.add_argument("--out", type=Path, default=Path(default_out))
  parser.add_argument("--resume", action="store_true",
                      help="continue unfinished runs from their checkpoints in --out")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--fsdp", action="store_true",
                      help="shard parameters and optimiser state over the devices (FSDP)")
  parser.add_argument("--distributed", action="store_true",
                      help="call jax.distributed.initialize() first (multi-host: run the same "
                           "command on every host); auto-detected on SLURM/TPU, else give:")
  parser.add_argument("--coordinator", help="host:port of process 0 (multi-host)")
  parser.add_argument("--num-processes", type=int, help="number of processes (multi-host)")
  parser.add_argument("--process-id", type=int, help="this process's index (multi-host)")
  common.add_init_std_flag(parser)


def resolve_preset(args) -> Preset:
  if args.distributed:
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)
  preset = PRESETS[args.preset]
  train = dataclasses.replace(preset.train, seed=args.seed, fsdp=args.fsdp)
  if args.steps:
    train = common.with_steps(train, args.steps)
  return dataclasses.replace(preset, train=train,
                             model=common.with_init_std(preset.model, args.init_std))


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_common_flags(parser, "runs/language_model")
  args = parser.parse_args(argv)
  try:
    preset = resolve_preset(args)
  except ValueError as e:  # A config that refuses a flag's value: a usage error.
    parser.error(str(e))
  runs = []
  for enc in [e.strip() for e in args.encodings.split(",") if e.strip()]:
    if enc not in ("rope", "pope"):
      raise SystemExit(f"--encodings: unknown encoding {enc!r}")
    with common.usage_errors(parser):
      record, _, _ = train_model(preset, enc, args.out, resume=args.resume,
                                 progress=not args.no_progress, data_dir=args.data_dir,
                                 splits=parse_splits(args.splits))
    print(f"{enc}: validation perplexity {record['valid_perplexity']:.2f}", flush=True)
    runs.append(record)
  return summarize(args.out, runs, args.preset)


if __name__ == "__main__":
  main()
