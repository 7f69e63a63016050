"""LPES ablations under one search budget: Bézier (C = 4), linear (C = 2), free per-layer and
global-scale searches over several search seeds, evaluated with base and Ms-PoE on held-out seeds
at the searched difficulty and at a transfer difficulty, with 95 % intervals.

    python -m experiments.lpes_ablations --preset h200 [--model PATH] [--out DIR] [--resume] \\
        [--moice-routers DIR]

One process loads the model once and compiles the search fitness once. Every search and every
held-out evaluation is saved atomically under --out and skipped by --resume. Writes results.json
(config, versions, device, budgets, accuracies with intervals, per-example scores as 0/1 strings),
results.md (tables and whether Bézier beats linear interpolation), accuracy.png (held-out accuracy
per gold position with interval bars) and seeds_pairs<N>.png (the search seeds' scale curves and
their held-out accuracy, mean ± sd) per difficulty. With --moice-routers (the --out of
`experiments.moice_train` for the same model) MoICE is one more baseline, in every table and plot;
--resume with --moice-routers adds it to a run made without, running only MoICE's evaluations.

--reuse-record DIR starts --out from a finished run's record (its config.json, results.json with
the per-example scores, and search.json, {"<method>_seed<s>": a search's results}; either may be
gzip-compressed, as docs/raw/lpes/ablations keeps them) and resumes it: with --moice-routers only MoICE is evaluated, on the same held-out examples,
and its intervals and gains over base come out beside the recorded rows. Give the record's
settings (its config.json, --model path included).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import shlex
import sys
import time

import jax

from experiments import common
from lpes_jax import ablation, bezier, moice, report, search
from lpes_jax.tasks.task import TaskConfig
from pope_jax import atomic
from pope_jax.config import config_diff

PRESETS = {
    "smoke": dict(num_pairs=3, transfer_pairs=4, key_length=2, value_length=2, search_examples=6,
                  population=4, generations=2, num_examples=2, batch_size=2, example_batch=3,
                  max_new_tokens=4),
    "h200": dict(num_pairs=6, transfer_pairs=10, key_length=4, value_length=4,
                 search_examples=200, population=32, generations=12, num_examples=300,
                 batch_size=100, example_batch=100, max_new_tokens=8),
}
PRESET_HELP = {
    "smoke": "a tiny random-weight Llama and a byte tokenizer; 3 pairs (transfer 4), budget of "
             "6 candidates x 6 examples, 2 held-out examples per position: seconds on a CPU",
    "h200": "SmolLM2-135M-Instruct (GGUF); 6 pairs (transfer 10), 4-hex keys and values, 32 x 12 "
            "GA = 208 candidates x 200 examples per search, 300 held-out examples per position",
}
# The smoke model: random weights over `lpes_jax.tokenizer.byte_tokenizer`'s 258 ids.
SMOKE_MODEL = dict(vocab_size=258, hidden_size=32, intermediate_size=64, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=1024,
                   bos_token_id=256, eos_token_ids=(257,))
CONFIG_FILE = "config.json"
_NOT_RESULTS = ("out", "resume", "no_progress", "reuse_record")  # Flags a resume may change.


def build_parser() -> argparse.ArgumentParser:
  p = common.make_parser("lpes_ablations", __doc__, PRESET_HELP)
  ints = common.comma_list(common.nonnegative_int, "non-negative integers")
  p.add_argument("--preset", choices=tuple(PRESETS), default="smoke",
                 help="model and sizes (see presets below)")
  p.add_argument("--model", type=common.existing_path, default=None,
                 help="GGUF file or Hugging Face folder (default: smoke, random weights; h200, "
                      "the cached SmolLM2-135M-Instruct GGUF, downloaded on first use)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="model weights and compute dtype")
  p.add_argument("--methods", default=",".join(ablation.SEARCHED),
                 help=f"comma-separated searched methods, of {', '.join(ablation.SEARCHED)}")
  p.add_argument("--baselines", default="base,ms_poe",
                 help=f"comma-separated methods of lpes_eval evaluated by name, base included, "
                      f"of {', '.join(ablation.baseline_names())} (moice: see --moice-routers)")
  p.add_argument("--moice-routers", default=None,
                 help="folder of trained MoICE routers, the --out of experiments.moice_train "
                      "for this model: adds moice to --baselines (default: none, no MoICE)")
  p.add_argument("--search-seeds", type=ints, default=(0, 1, 2),
                 help="comma-separated search seeds (search set and GA)")
  p.add_argument("--heldout-seeds", type=ints, default=(3, 4),
                 help="comma-separated held-out seeds, none of them a search seed")
  p.add_argument("--num-pairs", type=common.positive_int, help="KV pairs searched on "
                 "(default: the preset's)")
  p.add_argument("--transfer-pairs", type=common.nonnegative_int,
                 help="KV pairs of the transfer evaluation, 0 for none (default: the preset's)")
  p.add_argument("--key-length", type=common.positive_int,
                 help="KV key characters (default: the preset's)")
  p.add_argument("--value-length", type=common.positive_int,
                 help="KV value characters (default: the preset's)")
  p.add_argument("--search-examples", type=common.positive_int,
                 help="search examples per search seed (default: the preset's)")
  p.add_argument("--population", type=common.positive_int,
                 help="GA individuals per generation; half are kept (default: the preset's)")
  p.add_argument("--generations", type=common.positive_int,
                 help="GA generations, the first included (default: the preset's)")
  p.add_argument("--grid", type=common.comma_list(float, "numbers"),
                 default=",".join(map(repr, bezier.DEFAULT_GRID)),
                 help="candidate scale values, comma-separated, increasing, with 1.0")
  p.add_argument("--num-examples", type=common.positive_int,
                 help="held-out examples per gold position and held-out seed (default: the "
                      "preset's)")
  p.add_argument("--batch-size", type=common.positive_int,
                 help="held-out rows per generation call (default: the preset's)")
  p.add_argument("--example-batch", type=common.positive_int,
                 help="search examples per forward (default: the preset's)")
  p.add_argument("--max-new-tokens", type=common.positive_int,
                 help="tokens generated per held-out example (default: the preset's)")
  p.add_argument("--out", default="runs/lpes_ablations", help="run folder")
  p.add_argument("--resume", action="store_true",
                 help="continue the run in --out, skipping its finished stages")
  p.add_argument("--no-progress", action="store_true", help="hide the search progress bars")
  p.add_argument("--reuse-record", type=common.existing_path, default=None,
                 help="a finished run's recorded folder (config.json, results.json, "
                      "search.json) to start --out from and resume (default: none)")
  return p


def _read_json(path: str):
  """A record's JSON file, read from `path` or, where the record stores it compressed, from
  `path`.gz."""
  if not os.path.exists(path) and os.path.exists(path + ".gz"):
    with gzip.open(path + ".gz", "rt") as f:
      return json.load(f)
  with open(path) as f:
    return json.load(f)


def seed_from_record(record_dir: str, out: str) -> None:
  """Writes a finished run's settings, searches and held-out scores from its record into `out`
  (config.json, search/<method>/seed<s>/results.json, eval/pairs<P>/seed<h>/<group>.json), so
  that a resume recomputes none of them.

  Raises:
    FileExistsError: `out` already holds a run. FileNotFoundError: a recorded file is missing.
  """
  if os.path.exists(os.path.join(out, CONFIG_FILE)):
    raise FileExistsError(f"--out {out} already holds an ablation run; --reuse-record starts a "
                          f"fresh folder")
  record = _read_json(os.path.join(record_dir, "results.json"))
  settings = _read_json(os.path.join(record_dir, CONFIG_FILE))
  searches = _read_json(os.path.join(record_dir, "search.json"))     # {"<method>_seed<s>": ...}
  methods = [m for m in settings["methods"].split(",") if m]
  for m in methods:
    for s in settings["search_seeds"]:
      atomic.write_json(ablation._search_dir(out, m, s, search.RESULTS_FILE),
                        searches[f"{m}_seed{s}"])
  searched = {f"{m}/seed{s}" for m in methods for s in settings["search_seeds"]}
  for pairs, by_seed in record["scores"].items():
    for h, by_label in by_seed.items():
      groups = {"searched": {k: v for k, v in by_label.items() if k in searched},
                **{k: {k: v} for k, v in by_label.items() if k not in searched}}
      for group, scores in groups.items():
        atomic.write_json(ablation._eval_path(out, pairs, h, group), scores)
  atomic.write_json(os.path.join(out, CONFIG_FILE), settings)


def _names(p, flag: str, value: str, allowed) -> tuple[str, ...]:
  names = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
  bad = [n for n in names if n not in allowed]
  if bad or not names:
    p.error(f"{flag}: unknown or no names {', '.join(bad)} (choose from {', '.join(allowed)})")
  return names


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> ablation.AblationConfig:
  """The preset's values for unset flags, then every usage error before any model loads."""
  for k, v in PRESETS[args.preset].items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  methods = _names(p, "--methods", args.methods, tuple(ablation.SEARCHED))
  baselines = _names(p, "--baselines", args.baselines, ablation.baseline_names())
  if "base" not in baselines:
    p.error("--baselines must include base (the gains are over base)")
  if args.moice_routers:
    try:  # A missing or foreign folder fails here, before the slow model load.
      moice.load_moice_config(args.moice_routers)
    except (OSError, ValueError) as e:
      p.error(f"--moice-routers: {e}")
    baselines = tuple(dict.fromkeys(baselines + ("moice",)))
  elif "moice" in baselines:
    p.error("--baselines moice needs --moice-routers DIR (the --out of experiments.moice_train)")
  if args.num_pairs < 3:
    p.error(f"--num-pairs {args.num_pairs}: the search needs begin, middle and end, so >= 3")
  parents = args.population // 2
  try:
    scfg = search.SearchConfig(population_size=args.population, num_generations=args.generations,
                               num_parents=parents, num_mutations=(args.population - parents) // 2,
                               num_crossovers=args.population - parents
                               - (args.population - parents) // 2)
  except ValueError as e:
    p.error(f"{e} (flags --population, --generations)")
  from lpes_jax.tasks.kv_retrieval import KVConfig
  for pairs in (args.num_pairs, args.transfer_pairs or args.num_pairs):
    try:
      KVConfig(num_pairs=pairs, key_length=args.key_length, value_length=args.value_length)
    except ValueError as e:
      p.error(f"{e} (flags --num-pairs, --transfer-pairs, --key-length, --value-length)")
  try:
    return ablation.AblationConfig(
        task=TaskConfig(task="kv", num_pairs=args.num_pairs, key_length=args.key_length,
                        value_length=args.value_length),
        transfer_pairs=args.transfer_pairs, methods=methods, baselines=baselines,
        search_seeds=args.search_seeds, heldout_seeds=args.heldout_seeds, search=scfg,
        grid=args.grid, search_examples=args.search_examples, example_batch=args.example_batch,
        num_examples=args.num_examples, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, moice_routers=args.moice_routers)
  except ValueError as e:
    p.error(f"{e} (flags --methods, --baselines, --search-seeds, --heldout-seeds, "
            f"--transfer-pairs, --grid, --search-examples, ...)")


def main(argv=None) -> None:
  p = build_parser()
  args = p.parse_args(argv)
  cfg = check_flags(p, args)
  with common.locked(p, args.out):
    if args.reuse_record:
      try:
        seed_from_record(args.reuse_record, args.out)
      except (OSError, KeyError, ValueError) as e:
        p.error(f"--reuse-record: {e}")
      args.resume = True
    saved_path = os.path.join(args.out, CONFIG_FILE)
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_RESULTS}
    settings = json.loads(json.dumps(settings))
    if os.path.exists(saved_path):
      if not args.resume:
        p.error(f"--out {args.out} holds an ablation run: pass --resume to continue it or use "
                f"another folder")
      with open(saved_path) as f:
        saved = json.load(f)
      diff = config_diff(saved, settings)
      if diff == ["moice_routers"] and saved["moice_routers"] is None:
        diff = []  # MoICE added to a run without it: its evaluations run, the rest is reused.
      if diff:
        p.error(f"--resume: {saved_path} was written with other settings (differs in "
                f"{', '.join(diff)})")
    t0 = time.perf_counter()
    model = load_model(args)
    print(f"[{time.perf_counter() - t0:7.1f} s] model loaded ({model[0].num_layers} layers)",
          flush=True)
    if cfg.moice_routers:
      try:  # Routers of another model: a usage error before the run folder is claimed.
        moice.load_routers(cfg.moice_routers, model[0])
      except moice.RoutersMismatch as e:
        p.error(f"--moice-routers: {e}")
    atomic.write_json(saved_path, settings)
    run_and_report(args, cfg, model, t0, "python -m experiments.lpes_ablations " + shlex.join(
        sys.argv[1:] if argv is None else argv))


def load_model(args: argparse.Namespace):
  """(config, params, tokenizer) of --model, or of the preset (smoke: random weights)."""
  from lpes_jax.checkpoints import load_checkpoint
  from lpes_jax.tokenizer import load_tokenizer
  path = args.model
  if path is None and args.preset == "smoke":
    from lpes_jax.config import LlamaConfig
    from lpes_jax.llama import init_params
    from lpes_jax.tokenizer import byte_tokenizer
    config = LlamaConfig(**SMOKE_MODEL, dtype=args.dtype)
    return config, init_params(config, jax.random.key(0), scale=0.3), byte_tokenizer()
  if path is None:
    from lpes_jax.assets import smollm2_gguf
    path = args.model = smollm2_gguf()
  config, params = load_checkpoint(path, dtype=args.dtype)
  return config, params, load_tokenizer(path, model_vocab_size=config.vocab_size)


def run_and_report(args: argparse.Namespace, cfg: ablation.AblationConfig, model: tuple,
                   t0: float, command: str) -> None:
  """Runs the ablation with the loaded (config, params, tokenizer) in the (locked) --out and
  writes its reports; t0: the `time.perf_counter()` the wall time counts from."""
  import flax
  log = lambda line: print(line, flush=True)
  config, params, tok = model
  record = ablation.run_ablation(cfg, config, params, tok, args.out, resume=args.resume, log=log,
                                 progress=not args.no_progress)
  record.update({
      "args": {k: v for k, v in vars(args).items()},
      "model": args.model or "random weights (smoke)",
      "budget_per_search": cfg.search.num_candidates,
      "command": command,
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "versions": {"jax": jax.__version__, "flax": flax.__version__,
                   "python": platform.python_version()},
      "device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count(),
      "wall_s": time.perf_counter() - t0})
  record["args"]["model"] = record["model"]
  common.write_json(os.path.join(args.out, "results.json"), record)
  atomic.write_text(os.path.join(args.out, "results.md"), report.ablation_results_md(record))
  ablation.plot_accuracy(record, os.path.join(args.out, "accuracy.png"))
  for pairs in record["summary"]:
    ablation.plot_seeds(record, pairs, os.path.join(args.out, f"seeds_pairs{pairs}.png"))
  log(f"[{time.perf_counter() - t0:7.1f} s] wrote {args.out}/results.json, results.md, PNGs")


if __name__ == "__main__":
  main()
