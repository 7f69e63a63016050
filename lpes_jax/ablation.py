"""LPES ablations: genome kinds × search seeds under one search budget, evaluated held out.

    cfg = AblationConfig(task=TaskConfig(task="kv", num_pairs=6, key_length=4, value_length=4))
    record = run_ablation(cfg, config, params, tok, "runs/ablation", resume=False)

For each search seed s (search set and GA seed s) and each searched method (`SEARCHED`: Bézier
with 4 control points, a straight line = 2 control points, free per-layer scales, one global
scale) one `lpes_jax.search` run with the same `SearchConfig`; every search set is padded to one
shape so the fitness compiles once. Then, at the searched number of pairs and at
`transfer_pairs`, on each held-out seed: all searched scales together in one vmapped greedy
decoding (`evaluate.evaluate_multipliers`), and each named baseline through
`evaluate.method_generator` (any of `evaluate.METHODS` but "lpes"; "moice" with the trained
routers of `moice_routers`). Greedy, LitM metric.

Stages are saved atomically under the run folder and skipped once done:
  search/<method>/seed<s>/results.json        (a search resumes from its last generation)
  eval/pairs<n>/seed<h>/<searched|baseline>.json   per-example scores
Intervals: `lpes_jax.intervals` (normal, over held-out examples; gains paired over examples).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import numpy as np

from lpes_jax import bezier, evaluate, fitness, genomes, intervals, moice, search
from lpes_jax.tasks import position_indices
from lpes_jax.tasks.task import TaskConfig, encode_prompt, task_examples
from pope_jax import atomic

# Searched method → (genome kind, control points).
SEARCHED = {"bezier": ("bezier", 4), "linear": ("bezier", 2), "free": ("free", 4),
            "global": ("global", 4)}
LABELS = {"bezier": "LPES (Bézier, C = 4)", "linear": "linear (C = 2)", "free": "free per-layer",
          "global": "global scale (best PI)", "base": "base", "ms_poe": "Ms-PoE",
          "pi": "PI", "buckets": "Attention Buckets", "moice": "MoICE"}


def baseline_names() -> tuple[str, ...]:
  """Methods of `lpes_jax.evaluate` that need no search result (all but "lpes")."""
  return tuple(m for m in evaluate.METHODS if m != "lpes")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AblationConfig:
  """What the ablation runs.

  Attributes:
    task: the searched task (KV at the search difficulty).
    transfer_pairs: KV pairs of the difficulty that is not searched on (0: none).
    methods: searched methods, keys of SEARCHED.
    baselines: named methods of `lpes_jax.evaluate` (see `baseline_names`); "base" is needed
      for the gains, "moice" exactly when moice_routers is given.
    search_seeds, heldout_seeds: disjoint (a held-out seed equal to a search seed would score
      the search's own examples).
    search: the GA settings shared by every search (its seed is replaced per search seed).
    grid: candidate scales.
    search_examples: search examples per search seed.
    example_batch: search examples per forward per device.
    num_examples: held-out examples per gold position and held-out seed.
    batch_size: held-out rows per generation call (each of M multiplier sets decodes them).
    max_new_tokens: tokens generated per held-out example.
    moice_routers: folder of trained MoICE routers (`experiments.moice_train`) for the "moice"
      baseline; None: no MoICE.
  """
  task: TaskConfig
  transfer_pairs: int = 10
  methods: tuple[str, ...] = tuple(SEARCHED)
  baselines: tuple[str, ...] = ("base", "ms_poe")
  search_seeds: tuple[int, ...] = (0, 1, 2)
  heldout_seeds: tuple[int, ...] = (3, 4)
  search: search.SearchConfig = search.SearchConfig()
  grid: tuple[float, ...] = bezier.DEFAULT_GRID
  search_examples: int = 200
  example_batch: int = 100
  num_examples: int = 300
  batch_size: int = 100
  max_new_tokens: int = 8
  moice_routers: str | None = None

  def __post_init__(self):
    for name in ("methods", "baselines", "search_seeds", "heldout_seeds", "grid"):
      object.__setattr__(self, name, tuple(getattr(self, name)))
    unknown = [m for m in self.methods if m not in SEARCHED]
    if unknown or not self.methods:
      raise ValueError(f"AblationConfig.methods must be some of {tuple(SEARCHED)}, got "
                       f"{self.methods}")
    bad = [b for b in self.baselines if b not in baseline_names()]
    if bad or "base" not in self.baselines:
      raise ValueError(f"AblationConfig.baselines must include 'base' and be some of "
                       f"{baseline_names()}, got {self.baselines}")
    if ("moice" in self.baselines) != bool(self.moice_routers):
      raise ValueError(f"AblationConfig: the 'moice' baseline and moice_routers go together, got "
                       f"baselines {self.baselines} and moice_routers {self.moice_routers!r}")
    for name in ("methods", "baselines", "search_seeds", "heldout_seeds"):
      values = getattr(self, name)
      if len(set(values)) != len(values) or not values:
        raise ValueError(f"AblationConfig.{name} must be distinct and non-empty, got {values}")
    if set(self.search_seeds) & set(self.heldout_seeds):
      raise ValueError(f"AblationConfig: search seeds {self.search_seeds} and held-out seeds "
                       f"{self.heldout_seeds} must be disjoint (a shared seed draws the same "
                       f"examples)")
    if self.task.task != "kv":
      raise ValueError("AblationConfig.task must be KV retrieval (the transfer changes its pairs)")
    if self.transfer_pairs and self.transfer_pairs < 3:
      raise ValueError(f"AblationConfig.transfer_pairs must be 0 or >= 3, got "
                       f"{self.transfer_pairs}")
    for name in ("search_examples", "example_batch", "num_examples", "batch_size",
                 "max_new_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"AblationConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.search_examples < 3:
      raise ValueError(f"AblationConfig.search_examples must be >= 3 (one per subset), got "
                       f"{self.search_examples}")
    genomes.FreeSpace(num_layers=1, grid=self.grid)     # Raises on a bad grid.

  @property
  def difficulties(self) -> tuple[int, ...]:
    """KV pairs evaluated: the searched difficulty, then the transfer one."""
    pairs = (self.task.num_pairs,)
    return pairs + ((self.transfer_pairs,) if self.transfer_pairs else ())

  def space(self, method: str, num_layers: int) -> genomes.GenomeSpace:
    kind, control_points = SEARCHED[method]
    return genomes.make_space(kind, num_layers, grid=self.grid, control_points=control_points,
                              budget=self.search.num_candidates)

  def to_json(self) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(self)))


def fixed_chunks(fn: Callable[[np.ndarray], np.ndarray], size: int):
  """`fn` called on [size, ...] chunks only (the last one padded with copies of its first row):
  one compiled population shape for generation 0 and the later ones alike."""

  def chunked(m):
    m = np.asarray(m)
    outs = []
    for i in range(0, len(m), size):
      part = m[i:i + size]
      pad = size - len(part)
      full = np.concatenate([part, np.repeat(part[:1], pad, axis=0)]) if pad else part
      outs.append(np.asarray(fn(full))[:len(part)])
    return np.concatenate(outs)

  return chunked


def _timed(log, what):
  t0 = time.perf_counter()
  return lambda: log(f"[{time.perf_counter() - t0:7.1f} s] {what}")


def run_searches(cfg: AblationConfig, config, params, tok, workdir: str, *, resume: bool,
                 log=print, progress: bool = False) -> dict:
  """Every (method, search seed) search; returns {method: {seed: results.json record}}."""
  pad_id = config.pad_token_id or 0
  todo = [(m, s) for m in cfg.methods for s in cfg.search_seeds
          if not os.path.exists(_search_dir(workdir, m, s, search.RESULTS_FILE))]
  factory = None
  if todo:
    batches = {s: evaluate.search_batch(cfg.task, tok, config, num_examples=cfg.search_examples,
                                        seed=s) for s in cfg.search_seeds}
    length = max(b.prompt_tokens.shape[1] for b in batches.values())
    width = {b.answer_tokens.shape[1] for b in batches.values()}
    forward, greedy = fitness.llama_fitness_fns(config)
    factory = fitness.fitness_fn_factory(params, forward=forward, greedy=greedy,
                                         example_batch=cfg.example_batch)
    chunk = cfg.search.population_size - cfg.search.num_parents
    fns = {}
    for s, b in batches.items():
      b = fitness.pad_batch(b, length, pad_id=pad_id)
      if len(width) > 1:  # Answers of one width too: right-pad with masked slots.
        W = max(width)
        extra = W - b.answer_tokens.shape[1]
        b = dataclasses.replace(
            b, answer_tokens=np.pad(b.answer_tokens, ((0, 0), (0, extra))),
            answer_mask=np.pad(b.answer_mask, ((0, 0), (0, extra))))
      fns[s] = fixed_chunks(factory(b), chunk)
  out = {}
  for method in cfg.methods:
    out[method] = {}
    for s in cfg.search_seeds:
      path = _search_dir(workdir, method, s, search.RESULTS_FILE)
      if os.path.exists(path):
        log(f"search {method} seed {s}: done, skipped")
      else:
        done = _timed(log, f"search {method} seed {s}")
        space = cfg.space(method, config.num_layers)
        scfg = dataclasses.replace(cfg.search, seed=s)
        search.run_search(fns[s], space, scfg, _search_dir(workdir, method, s), resume=resume,
                          progress=progress, lock=False,
                          fitness_id={"ablation": cfg.to_json(), "seed": s},
                          extra={"method": method, "search_seed": s,
                                 "search_examples": cfg.search_examples})
        done()
      with open(path) as f:
        out[method][s] = json.load(f)
  return out


def _search_dir(workdir, method, seed, *rest):
  return os.path.join(workdir, "search", method, f"seed{seed}", *rest)


def _eval_path(workdir, pairs, heldout, group):
  return os.path.join(workdir, "eval", f"pairs{pairs}", f"seed{heldout}", f"{group}.json")


def _bits(scores) -> str:
  """Per-example 0/1 scores as a string of '0'/'1' (the JSON record's compression)."""
  x = np.asarray(scores)
  if not np.all((x == 0) | (x == 1)):
    raise ValueError("per-example scores must be 0 or 1 to be stored as bits")
  return "".join("1" if v else "0" for v in x.ravel())


def unbits(s: str) -> np.ndarray:
  """The inverse of `_bits`: [n] float64."""
  return np.frombuffer(s.encode(), np.uint8).astype(np.float64) - ord("0")


def held_out_length(cfg: AblationConfig, tok) -> int:
  """The longest held-out prompt over every difficulty, seed and gold position, rounded up to
  32 tokens."""
  longest = 0
  for pairs in cfg.difficulties:
    task = dataclasses.replace(cfg.task, num_pairs=pairs)
    for h in cfg.heldout_seeds:
      for gold in position_indices(pairs, 5):
        for e in task_examples(task, gold, cfg.num_examples, h):
          longest = max(longest, len(encode_prompt(tok, e.prompt, task.chat)))
  return -(-longest // 32) * 32


def run_evaluations(cfg: AblationConfig, config, params, tok, workdir: str, searches: dict, *,
                    log=print) -> dict:
  """Held-out per-example scores: {pairs: {heldout: {label: {gold: bits}}}}, label
  "<method>/seed<s>" for searched scales and the baseline's name for a baseline."""
  labels = [f"{m}/seed{s}" for m in cfg.methods for s in cfg.search_seeds]
  mults = np.stack([bezier.scales_to_multipliers(searches[m][s]["scales"])
                    for m in cfg.methods for s in cfg.search_seeds])
  gens = {}   # One jitted generator per group, shared by every difficulty and held-out seed,
  length = held_out_length(cfg, tok)   # and one prompt length: one compiled program per group.
  out = {}
  for pairs in cfg.difficulties:
    task = dataclasses.replace(cfg.task, num_pairs=pairs)
    for h in cfg.heldout_seeds:
      ev = evaluate.EvalConfig(method="base", num_examples=cfg.num_examples, seed=h,
                               batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                               prompt_len=length, moice_routers=cfg.moice_routers)
      got = out.setdefault(str(pairs), {}).setdefault(str(h), {})
      for group in ("searched",) + cfg.baselines:
        path = _eval_path(workdir, pairs, h, group)
        if os.path.exists(path):
          log(f"evaluation {pairs} pairs, held-out seed {h}, {group}: done, skipped")
        else:
          done = _timed(log, f"evaluation {pairs} pairs, held-out seed {h}, {group}")
          if group == "searched":
            if group not in gens:
              gens[group] = evaluate.multipliers_generator(config, params)
            scores = evaluate.evaluate_multipliers(gens[group], tok, config, task, ev, mults,
                                                   log=log)
            record = {lab: {g: _bits(sc[i]) for g, sc in scores.items()}
                      for i, lab in enumerate(labels)}
          else:
            ev_b = dataclasses.replace(ev, method=group)
            if group not in gens:
              gens[group] = evaluate.method_generator(config, params, ev_b)
            rec = evaluate.evaluate_positions(gens[group], tok, config, task, ev_b, log=log)
            record = {group: {g: _bits(sc) for g, sc in rec["scores"].items()}}
          atomic.write_json(path, record)
          done()
        with open(path) as f:
          got.update(json.load(f))
  return out


def summarise(cfg: AblationConfig, searches: dict, scores: dict) -> dict:
  """Accuracies per gold position and middle gains over base, with 95 % intervals.

  Returns per difficulty and method: "accuracy" {gold: interval} (pooled over search and
  held-out seeds: an example's score is its mean over the search seeds), "middle_gain" (paired
  over the same examples at the gold positions other than the first and last), and for searched
  methods "per_seed" {seed: {"accuracy", "middle_gain", "mean_accuracy"}}; plus
  "bezier_vs_linear" (paired difference, middle and all positions) where both ran.
  """
  names = list(cfg.baselines) + list(cfg.methods)
  out = {}
  for pairs, by_seed in scores.items():
    golds = [str(g) for g in position_indices(int(pairs), 5)]
    middle = golds[1:-1] or golds

    def per_example(label, gold_list):     # [n] over held-out seeds and golds, fixed order.
      return np.concatenate([unbits(by_seed[str(h)][label][g])
                             for h in cfg.heldout_seeds for g in gold_list])

    def pooled(method, gold_list):
      labels = ([f"{method}/seed{s}" for s in cfg.search_seeds] if method in SEARCHED
                else [method])
      return np.mean([per_example(lab, gold_list) for lab in labels], axis=0)

    base_mid = pooled("base", middle)
    res = {}
    for m in names:
      r = {"accuracy": {g: intervals.mean_interval(pooled(m, [g])) for g in golds},
           "middle_gain": intervals.paired_gain(pooled(m, middle), base_mid)}
      if m in SEARCHED:
        r["per_seed"] = {}
        for s in cfg.search_seeds:
          lab = f"{m}/seed{s}"
          r["per_seed"][str(s)] = {
              "accuracy": {g: float(per_example(lab, [g]).mean()) for g in golds},
              "mean_accuracy": float(per_example(lab, golds).mean()),
              "middle_gain": intervals.paired_gain(per_example(lab, middle), base_mid),
              "scales": searches[m][s]["scales"]}
        accs = np.asarray([[v["accuracy"][g] for g in golds] for v in r["per_seed"].values()])
        r["accuracy_over_seeds"] = {"mean": accs.mean(0).tolist(),
                                    "sd": accs.std(0, ddof=1).tolist() if len(accs) > 1
                                    else [0.0] * len(golds)}
      res[m] = r
    if "bezier" in cfg.methods and "linear" in cfg.methods:
      res["bezier_vs_linear"] = {
          "middle": intervals.paired_gain(pooled("bezier", middle), pooled("linear", middle)),
          "all": intervals.paired_gain(pooled("bezier", golds), pooled("linear", golds))}
    out[pairs] = {"golds": golds, "middle": middle, "methods": res}
  return out


def budgets(cfg: AblationConfig, searches: dict) -> dict:
  """Per searched method and seed: distinct candidates evaluated, examples, their product."""
  return {m: {str(s): {"candidates": r["num_candidates"], "examples": cfg.search_examples,
                       "candidate_examples": r["num_candidates"] * cfg.search_examples,
                       "fitness": r["fitness"]}
              for s, r in searches[m].items()} for m in cfg.methods}


def run_ablation(cfg: AblationConfig, config, params, tok, workdir: str, *, resume: bool,
                 log=print, progress: bool = False) -> dict:
  """Searches, evaluations and the summary (see the module docstring); returns the record that
  the caller writes out with `summarise`'s numbers, budgets, scales and per-example scores.

  Raises:
    FileNotFoundError, ValueError, moice.RoutersMismatch: cfg.moice_routers that do not load or
      do not fit the model (checked before any search: `moice.load_routers`).
  """
  if cfg.moice_routers:
    moice.load_routers(cfg.moice_routers, config)
  t0 = time.perf_counter()
  searches = run_searches(cfg, config, params, tok, workdir, resume=resume, log=log,
                          progress=progress)
  t1 = time.perf_counter()
  scores = run_evaluations(cfg, config, params, tok, workdir, searches, log=log)
  t2 = time.perf_counter()
  log(f"searches {t1 - t0:.1f} s, evaluations {t2 - t1:.1f} s (this process)")
  return {"config": cfg.to_json(), "budget": budgets(cfg, searches),
          "summary": summarise(cfg, searches, scores),
          "num_items": {str(p): p for p in cfg.difficulties},
          "seconds": {"searches": t1 - t0, "evaluations": t2 - t1},
          "scores": scores}


# ----------------------------------------------------------------------------------------------
# Plots.


def plot_accuracy(record: dict, path: str) -> None:
  """Held-out accuracy per gold position per method, 95 % interval bars; a panel per
  difficulty."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  summary = record["summary"]
  fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4), squeeze=False)
  for ax, (pairs, s) in zip(axes[0], summary.items()):
    golds = s["golds"]
    names = [m for m in s["methods"] if m != "bezier_vs_linear"]
    for i, m in enumerate(names):
      acc = s["methods"][m]["accuracy"]
      y = np.asarray([acc[g]["mean"] for g in golds])
      err = np.asarray([[y[j] - acc[g]["lo"], acc[g]["hi"] - y[j]] for j, g in enumerate(golds)]).T
      x = np.arange(len(golds)) + (i - (len(names) - 1) / 2) * 0.06
      ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=LABELS.get(m, m))
    ax.set_xticks(np.arange(len(golds)), golds)
    ax.set_xlabel("gold position")
    ax.set_ylabel("held-out accuracy (95 % interval)")
    ax.set_title(f"{pairs} KV pairs" + (" (searched)" if pairs == str(
        record["config"]["task"]["num_pairs"]) else " (transfer)"))
    ax.set_ylim(-0.02, 1.02)
  axes[0][-1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_seeds(record: dict, pairs: str, path: str) -> None:
  """Per searched method (a row): the search seeds' per-layer scales (left) and their held-out
  accuracy per gold position at `pairs` with the mean ± sd over seeds (right)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  s = record["summary"][pairs]
  methods = [m for m in record["config"]["methods"]]
  fig, axes = plt.subplots(len(methods), 2, figsize=(11, 3 * len(methods)), squeeze=False)
  golds = s["golds"]
  for row, m in zip(axes, methods):
    r = s["methods"][m]
    for seed, v in r["per_seed"].items():
      row[0].step(np.arange(len(v["scales"])), v["scales"], where="mid",
                  label=f"seed {seed}: mean acc {v['mean_accuracy']:.3f}, middle gain "
                        f"{v['middle_gain']['mean']:+.3f}")
      row[1].plot(np.arange(len(golds)), [v["accuracy"][g] for g in golds], "o-", alpha=0.6,
                  label=f"seed {seed}")
    mean, sd = np.asarray(r["accuracy_over_seeds"]["mean"]), np.asarray(r["accuracy_over_seeds"]["sd"])
    row[1].errorbar(np.arange(len(golds)), mean, yerr=sd, color="k", capsize=4, lw=2,
                    label="mean ± sd over seeds")
    base = s["methods"]["base"]["accuracy"]
    row[1].plot(np.arange(len(golds)), [base[g]["mean"] for g in golds], "k--", alpha=0.5,
                label="base")
    row[0].set_title(f"{LABELS[m]}: scales found at {record['config']['task']['num_pairs']} pairs")
    row[0].set_xlabel("layer")
    row[0].set_ylabel("scale s")
    row[0].legend(fontsize=7)
    row[1].set_xticks(np.arange(len(golds)), golds)
    row[1].set_xlabel("gold position")
    row[1].set_ylabel(f"held-out accuracy, {pairs} pairs")
    row[1].set_ylim(-0.02, 1.02)
    row[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
