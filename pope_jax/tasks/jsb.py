"""JSB Chorales (PoPE App. A): presets, all seeds of one encoding trained side by side, results.

Data: `pope_jax.data.jsb`, the standard benchmark (229 / 76 / 77 chorales, 16th-note grid, SATB
raster tokens, vocabulary 90), the same data in every preset (the small presets may keep the
first chorales of each split). The metric is test NLL per note token (nats), mean ± sd over
seeds, beside the paper's RoPE 0.5081 and PoPE 0.4889; the direction of the gap is tested with
Welch's t. Every preset selects a checkpoint by validation (`TrainConfig.select_split="valid"`:
the whole validation split every `eval_every` steps), and the results give test NLL both at
each seed's best validation step and at the last step; the test split never chooses anything.
At the end of a run each seed's frequency usage (PoPE §5) is measured on the test split with
the selected parameters (`pope_jax.tasks.frequency_usage`).

Assumptions where App. A is silent (each an overridable config field): Adam β1 0.9
(`TrainConfig.b1`); init N(0, 0.02²) with scaled residual projections (`ModelConfig.init_std`,
the nanoGPT scheme the paper's hyper-parameters come from); float32 compute (`ModelConfig.dtype`);
one chorale per training window, padded at zero weight, about 47 % of the tokens of a 2048 window
(`Preset.pack_train` concatenates the training chorales instead, each its own segment with
positions from its BOS, so no token attends across chorales); no transposition augmentation
(`Preset.transpositions`); no dropout on the attention probabilities
(`ModelConfig.attention_dropout`). Evaluation always scores each chorale from its own BOS.

Sampling: `load_run` reads one seed's model back from a run folder OUT/<encoding>/, and
`sample_chorale` continues BOS (or the first steps of a chorale) with the decoding loop of
`pope_jax.generation`; `pope_jax.data.midi` writes the result as a MIDI file.

Shape letters: U 16th-note steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from pope_jax import analysis, generation, reporting
from pope_jax.config import MODEL_PRESETS, ModelConfig, TrainConfig
from pope_jax.data import jsb
from pope_jax.model import init_cache, num_params
from pope_jax.tasks import frequency_usage as usage_task
from pope_jax.tasks.preset import ExperimentPreset
from pope_jax.train import has_checkpoints, restore_params, train_and_evaluate

PAPER_NLL = {"rope": 0.5081, "pope": 0.4889}
PAPER = "JSB, 6 x 256, 3000 steps: test NLL per token RoPE 0.5081, PoPE 0.4889"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset(ExperimentPreset):
  """One JSB configuration.

  Attributes:
    model, train: the model (its `pos_encoding` is set per run) and the optimisation.
      `train.select_split` "valid" (every preset) keeps each seed's best-validation parameters.
    seq_len: T, tokens per training window.
    seeds: seeds of each encoding, trained side by side (vmapped).
    transpositions: semitone shifts of the training chorales ((0,) = none).
    pack_train: train on the chorales concatenated into one stream instead of one per window,
      each chorale its own segment (`pope_jax.data.jsb.ChoraleSource`).
    pieces_per_split: keep the first (train, valid, test) chorales; None = all 229 / 76 / 77.
    usage_windows: test windows for frequency usage (None = the whole test split).
    description, expect: `ExperimentPreset`'s.
  """
  model: ModelConfig
  train: TrainConfig
  seq_len: int
  seeds: tuple[int, ...] = (0,)
  transpositions: tuple[int, ...] = (0,)
  pack_train: bool = False
  pieces_per_split: tuple[int, int, int] | None = None
  usage_windows: int | None = None


_PAPER_MODEL = dataclasses.replace(MODEL_PRESETS["jsb"], vocab_size=jsb.VOCAB_SIZE)
PRESETS: dict[str, Preset] = {
    # PoPE App. A: 6 layers x 256 x 8 heads, dropout 0.2, delta ~ U(-2pi, 0), batch 4 x 2048,
    # 3000 steps, lr 6e-4 -> 6e-5 cosine, 10 warm-up, beta2 0.99, wd 0.01, clip 1.0; 5 seeds.
    "paper": Preset(
        model=_PAPER_MODEL,
        train=TrainConfig(steps=3000, batch_size=4, learning_rate=6e-4, min_learning_rate=6e-5,
                          warmup_steps=10, b2=0.99, weight_decay=0.01, grad_clip=1.0,
                          eval_every=250, checkpoint_every=500, log_every=50, steps_per_call=10,
                          select_split="valid"),
        seq_len=2048, seeds=(0, 1, 2, 3, 4), description="the paper's configuration (App. A)",
        expect="the paper's budget and data: the means should sit near 0.51 / 0.49 and PoPE "
               "should be lower if the paper's result reproduces"),
    "cpu": Preset(
        model=dataclasses.replace(_PAPER_MODEL, num_layers=2, d_model=128, num_heads=4),
        train=TrainConfig(steps=300, batch_size=4, learning_rate=1e-3, min_learning_rate=1e-4,
                          warmup_steps=10, b2=0.99, eval_every=100, checkpoint_every=100,
                          log_every=20, steps_per_call=10, select_split="valid"),
        seq_len=512, usage_windows=64,
        description="2 layers x 128, context 512, one seed, all chorales: minutes on 2 CPU cores",
        expect="10 % of the paper's steps on a small model with one seed: NLL well above the "
               "paper's, and the gap is not resolved"),
    "smoke": Preset(
        model=dataclasses.replace(_PAPER_MODEL, num_layers=1, d_model=32, num_heads=2),
        train=TrainConfig(steps=4, batch_size=2, learning_rate=3e-3, min_learning_rate=3e-4,
                          warmup_steps=1, eval_every=2, eval_batches=2, checkpoint_every=2,
                          log_every=2, steps_per_call=2, select_split="valid"),
        seq_len=64, seeds=(0, 1), transpositions=(-1, 0, 1), pieces_per_split=(4, 2, 2),
        usage_windows=4, description="seconds, for tests (the first 4 / 2 / 2 chorales)",
        expect="a plumbing check: the numbers mean nothing"),
}


def _batches(source, batch_size: int, max_windows: int | None):
  """The first `max_windows` records of `source` as [B, T] batches; the last is padded with
  zero-weight records."""
  n = len(source) if max_windows is None else min(len(source), max_windows)
  for start in range(0, n, batch_size):
    recs = [source[i] for i in range(start, min(start + batch_size, n))]
    recs += [{k: np.zeros_like(v) for k, v in recs[0].items()}] * (batch_size - len(recs))
    yield {k: np.stack([r[k] for r in recs]) for k in recs[0]}


def run_encoding(preset: Preset, encoding: str, out: Path, *, resume: bool,
                 progress: bool = True) -> list[dict]:
  """Trains all seeds of one encoding side by side in OUT/<encoding>/, or reuses a finished run
  with the same config and seeds.

  Returns:
    One record per seed (all in OUT/<encoding>/result.json): test/valid NLL per token and test
    accuracy at the last step, and with selection ("best_step" not None) at the best validation
    step ("best_test_nll", "best_valid_nll", "best_test_accuracy"); speed, history, frequency
    usage on the test split (of the selected parameters), data sizes, config, metadata.
  """
  model_cfg = dataclasses.replace(preset.model, pos_encoding=encoding)
  config = {"model": model_cfg, "train": preset.train, "seq_len": preset.seq_len,
            "seeds": preset.seeds, "transpositions": preset.transpositions,
            "pack_train": preset.pack_train,
            "pieces_per_split": preset.pieces_per_split, "usage_windows": preset.usage_windows}
  workdir = out / encoding
  result_file = workdir / "result.json"
  if result_file.exists():
    done = json.loads(result_file.read_text())
    if done["config"] == json.loads(json.dumps(reporting.to_jsonable(config))):
      return done["runs"]
  sources = jsb.jsb_sources(preset.seq_len, transpositions=preset.transpositions,
                            pack_train=preset.pack_train,
                            pieces_per_split=preset.pieces_per_split)
  results = train_and_evaluate(
      model_cfg, preset.train, train_source=sources["train"],
      eval_sources={"valid": sources["valid"], "test": sources["test"]}, workdir=workdir,
      resume=resume and has_checkpoints(workdir), seeds=preset.seeds, progress=progress)
  data = {"pieces": {s: src.num_pieces for s, src in sources.items()},
          "records": {s: len(src) for s, src in sources.items()}, "vocab_size": jsb.VOCAB_SIZE}
  runs = []
  for r in results:
    selected = r.params if r.best_params is None else r.best_params
    usage = analysis.frequency_usage(model_cfg, selected, _batches(
        sources["test"], preset.train.batch_size, preset.usage_windows))
    best = r.best_metrics or {}
    runs.append({
        "encoding": encoding, "seed": r.seed, "test_nll": r.metrics["test"]["loss"],
        "valid_nll": r.metrics["valid"]["loss"], "test_accuracy": r.metrics["test"]["accuracy"],
        "best_step": r.best_step, "best_test_nll": best.get("test", {}).get("loss"),
        "best_valid_nll": best.get("valid", {}).get("loss"),
        "best_test_accuracy": best.get("test", {}).get("accuracy"),
        "steps_per_second": r.steps_per_second, "history": r.history, "data": data,
        "frequency_usage": {k: np.asarray(v).tolist() for k, v in usage.items()}})
  reporting.write_json(result_file, {"encoding": encoding, "runs": runs, "config": config,
                                     "metadata": reporting.run_metadata(preset.seeds[0])})
  return json.loads(json.dumps(reporting.to_jsonable(runs)))


def direction(by_enc: dict[str, list[float]], at: str = "") -> dict:
  """Whether PoPE's test NLL is below RoPE's (the paper's direction), with Welch's t-test.

  Args:
    by_enc: "rope", "pope" → per-seed test NLL.
    at: which checkpoint the values are of, for the statement ("at the best validation step").

  Returns:
    {"holds", "rope_minus_pope", "standard_errors" (Welch's t), "df" (Welch-Satterthwaite),
    "p_value" (two-sided), "statement"}; t, df and p are NaN with fewer than two seeds of either.
  """
  rope, pope = by_enc["rope"], by_enc["pope"]
  gap, t = analysis.standard_errors_apart(rope, pope)
  df = p = math.nan
  if not math.isnan(t):
    test = scipy.stats.ttest_ind(rope, pope, equal_var=False)
    df, p = float(test.df), float(test.pvalue)
  holds = gap > 0
  apart = ("one seed per encoding, no standard error" if math.isnan(t) else
           f"Welch's t = {t:.2f} (df {df:.1f}, two-sided p = {p:.2g}; {len(rope)} and "
           f"{len(pope)} seeds)")
  paper_gap = PAPER_NLL["rope"] - PAPER_NLL["pope"]
  where = f" {at}" if at else ""
  return {"holds": holds, "rope_minus_pope": gap, "standard_errors": t, "df": df, "p_value": p,
          "statement": (f"The paper's direction (PoPE below RoPE){where} "
                        f"{'holds' if holds else 'does not hold'}: RoPE - PoPE = {gap:+.4f} "
                        f"nats per token, {apart}; the paper's gap is {paper_gap:+.4f}.")}


def _spread(values: list[float]) -> dict:
  mean, sd = reporting.mean_sd(values)
  return {"mean": mean, "sd": sd, "per_seed": values}


def summarize(out: Path, runs: list[dict], preset: Preset, preset_name: str) -> dict[str, float]:
  """Writes OUT/results.{md,json}, OUT/loss.png (validation NLL of every seed vs step),
  OUT/frequency_usage.png and OUT/frequency_share.png for `preset` as run (flags applied) named
  `preset_name`.

  Returns:
    {encoding: mean test NLL over seeds at the best validation step, or at the last step for
    runs without selection}.
  """
  by_enc: dict[str, list[dict]] = {}
  for r in runs:
    by_enc.setdefault(r["encoding"], []).append(r)
  selected = all(r.get("best_step") is not None for r in runs)
  rows, summary = [], {}
  for enc, rs in by_enc.items():
    last = _spread([r["test_nll"] for r in rs])
    summary[enc] = {"seeds": [r["seed"] for r in rs], "last": last,
                    "test_nll_mean": last["mean"], "test_nll_sd": last["sd"]}
    row = [enc, len(rs)]
    if selected:
      best = _spread([r["best_test_nll"] for r in rs])
      best["steps"] = [r["best_step"] for r in rs]
      best["valid_nll"] = _spread([r["best_valid_nll"] for r in rs])
      summary[enc].update(best=best, test_nll_mean=best["mean"], test_nll_sd=best["sd"])
      row += [reporting.fmt_mean_sd(best["per_seed"], ".4f"),
              ", ".join(f"{v:.4f}" for v in best["per_seed"]),
              ", ".join(map(str, best["steps"])),
              reporting.fmt_mean_sd(best["valid_nll"]["per_seed"], ".4f"),
              f"{100 * statistics.mean(r['best_test_accuracy'] for r in rs):.1f}"]
    row += [reporting.fmt_mean_sd(last["per_seed"], ".4f"),
            ", ".join(f"{v:.4f}" for v in last["per_seed"]),
            reporting.fmt_mean_sd([r["valid_nll"] for r in rs], ".4f"), PAPER_NLL[enc],
            reporting.fmt(rs[0]["steps_per_second"], ".2f")]
    rows.append(row)
  header = ["encoding", "seeds"]
  if selected:
    header += ["test NLL at best valid step (mean ± sd)", "per seed", "best steps",
               "valid NLL at best", "test accuracy % at best"]
  header += ["test NLL at last step (mean ± sd)", "per seed", "valid NLL at last", "paper",
             "steps/s (all seeds together)"]
  table = reporting.markdown_table(header, rows)
  record = {"preset": preset_name, "summary": summary, "runs": runs}
  if {"rope", "pope"} <= set(by_enc):
    per = lambda key: {e: [r[key] for r in by_enc[e]] for e in ("rope", "pope")}
    record["direction_last"] = direction(per("test_nll"), "at the last step")
    record["direction"] = record["direction_last"]
    if selected:
      record["direction"] = direction(per("best_test_nll"), "at the best validation step")
      table += "\n" + record["direction"]["statement"] + "\n"
    table += "\n" + record["direction_last"]["statement"] + "\n"
  usage = usage_task.summarize_usage({e: [r["frequency_usage"] for r in rs]
                                      for e, rs in by_enc.items()})
  record["frequency_usage"] = usage
  table += (f"\n## Frequency usage (test split, {'selected' if selected else 'last'} "
            f"parameters)\n\n" + usage_task.usage_markdown(usage) +
            "\nHeatmaps: frequency_usage.png; shares per layer: frequency_share.png.\n")
  usage_task.plot_usage(usage, out / "frequency_usage.png", out / "frequency_share.png")
  reporting.write_results(
      out, title=f"JSB Chorales ({preset_name} preset)", table=table,
      about=_what_ran(runs[0], preset, preset_name), record=record, runs=runs, plot="loss.png",
      metric="valid_loss", ylabel="validation NLL per token")
  return {enc: s["test_nll_mean"] for enc, s in summary.items()}


def _what_ran(first: dict, preset: Preset, preset_name: str) -> str:
  train, data = preset.train, first["data"]
  windows = ("training chorales packed into one stream, each its own segment with positions "
             "from its BOS" if preset.pack_train else "one chorale per window")
  every = ("the whole validation split" if train.eval_batches is None else
           f"the first {train.eval_batches * train.batch_size} validation windows "
           f"(a subsample)")
  selection = ("; each seed's checkpoint of lowest validation NLL is kept and reported beside "
               "the last" if train.select_split == "valid" else "")
  return reporting.what_ran(
      preset=preset_name, description=preset.description, params=num_params(preset.model),
      steps=train.steps, batch=f"{train.batch_size} windows of {preset.seq_len} tokens per seed",
      data=(f"the JSB Chorales benchmark (Boulanger-Lewandowski et al. 2012 split, 16th-note "
            f"SATB raster tokens), chorales per split {data['pieces']} of 229 / 76 / 77, "
            f"transpositions {preset.transpositions}; {windows} "
            f"(assumptions, with Adam b1 {train.b1}, init std {preset.model.init_std}, "
            f"{preset.model.dtype} compute); dropout {preset.model.dropout_rate}, attention "
            f"dropout {preset.model.attention_dropout}"),
      periodic=f"validation NLL on {every} every {train.eval_every} steps{selection}",
      chance=(f"a uniform guess over the {data['vocab_size']} tokens has NLL "
              f"{math.log(data['vocab_size']):.2f} nats"),
      paper=PAPER, expect=preset.expect)


def run_seeds(run: Path) -> tuple[ModelConfig, tuple[int, ...]]:
  """The model config and the seeds trained side by side in a run folder OUT/<encoding>/.

  Decoding uses the best available attention (`attention_implementation=None`): the cache masks
  unwritten slots, which the fused kernel does not take yet.

  Raises:
    FileNotFoundError: the folder holds no run.json or no checkpoint (naming it).
  """
  info_file = run / "run.json"
  if not info_file.is_file() or not has_checkpoints(run):
    raise FileNotFoundError(f"{run} is not a JSB run (no run.json or checkpoints/); pass "
                            "OUT/<encoding> of experiments.jsb")
  info = json.loads(info_file.read_text())
  config = dataclasses.replace(ModelConfig(**info["model"]), attention_implementation=None)
  return config, tuple(info["seeds"])


def load_run(run: Path, seed: int | None = None) -> tuple[ModelConfig, dict, int]:
  """(model config, params, seed) of one seed of a JSB run folder OUT/<encoding>/, from its
  latest checkpoint.

  Args:
    run: the folder `run_encoding` trains in.
    seed: the training seed (default: the first one trained there).

  Raises:
    FileNotFoundError: see `run_seeds`. ValueError: a seed the run did not train.
  """
  config, seeds = run_seeds(run)
  seed = seeds[0] if seed is None else seed
  if seed not in seeds:
    raise ValueError(f"{run} trained seeds {', '.join(map(str, seeds))}, not seed {seed}")
  return config, restore_params(run, seeds.index(seed)), seed


def sample_chorale(config: ModelConfig, params, *, num_steps: int, key: jax.Array | None,
                   prime: np.ndarray | None = None, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None,
                   on_token=None) -> np.ndarray:
  """A chorale sampled from a JSB model: BOS, the prime steps, then `num_steps` new steps.

  BOS is never sampled: it is an input only (never a target of the default training), so its
  logit carries no meaning; the piece ends after `num_steps`.

  Args:
    config, params: the model (`load_run`).
    num_steps: new 16th-note steps to sample (4 tokens each).
    key: `jax.random` key of the sampling (None only when greedy).
    prime: None or [P, 4] int MIDI pitches (-1 = silence), e.g. the start of a test chorale.
    temperature, top_k, top_p: see `pope_jax.generation.Sampling` (temperature 0: greedy).
    on_token: progress callback with each new token's index (`generation.decode`).

  Returns:
    [P + num_steps, 4] int16 MIDI pitches, -1 = silence: the prime, then the new steps.

  Raises:
    ValueError: num_steps < 1, a prime pitch outside MIDI 21..108, bad sampling settings, or no
      key for sampling.
  """
  if num_steps < 1:
    raise ValueError(f"num_steps must be >= 1, got {num_steps}")
  sampling = generation.Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
  prime = np.zeros((0, 4), np.int16) if prime is None else np.asarray(prime, np.int16)
  prompt = jsb.tokenize(prime).tolist()                    # [1 + 4P], BOS first
  run = lambda tokens, mask: _decode_notes(
      config, params, tokens, mask, max_new_tokens=4 * num_steps, sampling=sampling, key=key,
      on_token=on_token)
  new = generation.generate_ids(run, [prompt], vocab_size=config.vocab_size,
                                max_new_tokens=4 * num_steps, pad_id=jsb.SILENCE)[0]
  return np.concatenate([prime, jsb.detokenize(np.asarray(new, np.int32))])


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "sampling", "on_token"))
def _decode_notes(config, params, tokens, mask, *, max_new_tokens, sampling, key, on_token):
  """`generation.decode` of a Transformer whose BOS logit is -inf (tokens [B, T], mask [B, T])."""
  step = generation.transformer_step(config, params)

  def no_bos(tokens, mask, cache):
    logits, cache = step(tokens, mask, cache)              # [B, V]
    return logits.at[:, jsb.BOS].set(-jnp.inf), cache

  cache = init_cache(config, tokens.shape[0], tokens.shape[1] + max_new_tokens)
  return generation.decode(no_bos, cache, tokens, mask, max_new_tokens=max_new_tokens,
                           sampling=sampling, key=key, on_token=on_token)
