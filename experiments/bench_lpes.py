"""Throughput of the LPES teacher-forced fitness in candidate-examples per second.

    python -m experiments.bench_lpes --export-smollm2 .cache/smollm2_set   # where the GGUF is
    python -m experiments.bench_lpes --preset h100 --out runs/bench_lpes    # one GPU, ~3 min
    python -m experiments.bench_lpes --preset smoke --smollm2 /tmp/s --out /tmp/bench_lpes  # CPU
    python -m experiments.bench_lpes --report --out runs/bench_lpes         # tables only

Cases: SmolLM2-135M on its KV search set (6 pairs, 4-hex keys and values, seed 0: the set of
docs/lpes.md), and the Llama-7B shape with random bf16 weights at the prompt lengths of the
paper's tasks (random tokens: the cost of a row depends only on its length). The SmolLM2 case
reads a folder that `--export-smollm2` writes from the real GGUF (config.json and the search set's
rows and candidates, tens of KB, so it travels where the GGUF does not) and, unless the
folder holds weights (`--with-weights`), runs random bf16 weights of SmolLM2's shape: throughput
does not depend on the weight values, and the output says which weights ran. Each case is timed
with two settings of `lpes_jax.fitness`: "before", the settings of the search runs in
docs/lpes.md (XLA attention; SmolLM2 in float32 with 100 examples per forward; at 7B, KV only,
the largest steps that fit, as all candidates at once do not), and "fused", bfloat16 with
`attention_implementation=None` (cuDNN on a GPU). From the 7B rates it projects a search of
208 candidates × 200 examples on one device, beside the paper's 3-4 h on four H100s.

`experiments/lpes_transformers.py` scores the same folder in PyTorch; `--report` reads that
script's JSON files from --out and prints its rates beside ours and whether the SmolLM2 counts
agree.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import statistics
import time

import jax
import numpy as np

from experiments import common
from lpes_jax import bezier, evaluate, fitness, genomes
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import init_params
from lpes_jax.tasks.task import TaskConfig

PAPER_SEARCH = (208, 200)          # candidates × examples of a search (population 32, 12 gens)
PAPER_HOURS = "3-4 h on four H100s"
LLAMA_7B = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                       num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=4096, dtype="bfloat16")
TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)


@dataclasses.dataclass(frozen=True)
class Settings:
  """How the fitness runs: attention implementation, dtype, examples and candidates per call."""
  implementation: str | None
  dtype: str
  example_batch: int
  candidate_batch: int

  def label(self) -> str:
    return (f"{self.implementation or 'fused'} {self.dtype}, {self.example_batch} ex x "
            f"{self.candidate_batch} cand per step")


@dataclasses.dataclass(frozen=True)
class Case:
  """One model and one set of rows, timed with each of `settings`."""
  name: str
  settings: dict[str, Settings]
  candidates: int
  examples: int
  prompt_len: int = 0          # synthetic rows (random weights): prompt and answer lengths
  window: int = 0


# The paper's tasks at the 7B shape (Lost in the Middle's settings that fit a 4k context): KV
# retrieval with 75 UUID pairs (about 4k Llama tokens; the answer, a quote and a UUID, up to 32)
# and multi-document QA with 20 documents (about 3k tokens; the answer's first words, 8).
LENGTHS = {"kv": (4000, 32), "mdqa": (3000, 8)}
BEFORE_7B = Settings("xla", "bfloat16", 2, 1)
FUSED_7B = Settings(None, "bfloat16", 4, 2)
PRESETS = {
    "h100": [
        Case("smollm2_kv", {"before": Settings("xla", "float32", 100, 16),
                            "fused": Settings(None, "bfloat16", 100, 16)}, 16, 200),
        Case("llama7b_kv", {"before": BEFORE_7B, "fused": FUSED_7B}, 2, 16, *LENGTHS["kv"]),
        Case("llama7b_mdqa", {"fused": FUSED_7B}, 2, 16, *LENGTHS["mdqa"])],
    "smoke": [
        Case("smollm2_kv", {"before": Settings("xla", "float32", 4, 2),
                            "fused": Settings(None, "bfloat16", 4, 2)}, 2, 6),
        Case("llama7b_kv", {"before": Settings("xla", "bfloat16", 2, 1),
                            "fused": Settings(None, "bfloat16", 2, 2)}, 2, 4, 40, 4),
        Case("llama7b_mdqa", {"fused": Settings(None, "bfloat16", 2, 2)}, 2, 4, 30, 2)],
}
PRESET_HELP = {"h100": "the --smollm2 folder (exported: 200 examples x 16 candidates) and the 7B "
                       "shape (16 x 2) at KV 4000 and MDQA 3000 tokens (before: KV only)",
               "smoke": "tiny random-weight shapes on the CPU (export: a tiny model), for tests"}


def smollm2_search_set(smoke: bool, num_examples: int, num_candidates: int):
  """(config, params, batch, multipliers [P, L]): the real SmolLM2 (the GGUF) and its KV search
  set (smoke: a tiny random model and random rows), identity plus random Bézier candidates."""
  if smoke:
    config, params = TINY, init_params(TINY, jax.random.key(0), scale=0.3)
    rng = np.random.default_rng(0)
    batch = fitness.make_batch([list(rng.integers(3, 256, rng.integers(20, 30)))
                                for _ in range(num_examples)],
                               [list(rng.integers(3, 256, 3)) for _ in range(num_examples)],
                               np.arange(num_examples) % 3)
  else:
    from lpes_jax import load_pretrained, load_tokenizer
    from lpes_jax.assets import smollm2_gguf
    _, params, config = load_pretrained(smollm2_gguf())
    task = TaskConfig(task="kv", num_pairs=6, key_length=4, value_length=4)
    batch = evaluate.search_batch(task, load_tokenizer(smollm2_gguf()), config,
                                  num_examples=num_examples, seed=0)
  space = genomes.BezierSpace(bezier.BezierConfig(num_layers=config.num_layers))
  rng = np.random.default_rng(0)
  genome = np.stack([space.identity()] + [space.random(rng) for _ in range(num_candidates - 1)])
  return config, params, batch, bezier.scales_to_multipliers(space.scales(genome))


BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(fitness.FitnessBatch))


def export_smollm2(folder: str, smoke: bool, num_examples: int, num_candidates: int,
                   with_weights: bool) -> None:
  """The SmolLM2 search set as a folder that needs no GGUF: config.json (Hugging Face form),
  search_set.npz (the `FitnessBatch` arrays, the candidates' `multipliers` [P, L] and the
  teacher-forced `tokens`, `at`, `targets`, `target_mask` that `lpes_transformers` reads) and,
  `with_weights`, the float32 weights as model.safetensors (about 0.5 GB for SmolLM2)."""
  config, params, batch, mults = smollm2_search_set(smoke, num_examples, num_candidates)
  os.makedirs(folder, exist_ok=True)
  tokens, at, targets, tmask = fitness.teacher_forced_inputs(batch)
  what = "tiny shape, random rows" if smoke else "SmolLM2-135M shape, its KV search set"
  np.savez_compressed(os.path.join(folder, "search_set.npz"), what=what,
                      multipliers=np.asarray(mults, np.float32), tokens=tokens, at=at,
                      targets=targets, target_mask=tmask,
                      **{name: getattr(batch, name) for name in BATCH_FIELDS})
  common.write_json(os.path.join(folder, "config.json"), hf_config(config))
  if with_weights:
    export_weights(config, params, folder)


def load_smollm2(folder: str):
  """(config, params, batch, multipliers, what) from an `export_smollm2` folder: its weights if
  it has model.safetensors, else random bf16 weights of its config (the throughput of a forward
  does not depend on the weight values); `what` names the model, the rows and the weights."""
  from lpes_jax.checkpoints import load_hf, load_hf_config
  with np.load(os.path.join(folder, "search_set.npz")) as f:
    batch = fitness.FitnessBatch(**{name: f[name] for name in BATCH_FIELDS})
    mults, what = f["multipliers"], str(f["what"])
  if os.path.exists(os.path.join(folder, "model.safetensors")):
    config, params = load_hf(folder)
    return config, params, batch, mults, what + ", its weights"
  config = load_hf_config(folder)
  params = init_params(dataclasses.replace(config, dtype="bfloat16"), jax.random.key(0))
  return config, params, batch, mults, what + ", random weights"


def synthetic_batch(config: LlamaConfig, examples: int, prompt_len: int, window: int):
  """Random prompts of `prompt_len` tokens and answers of `window` tokens (all rows alike)."""
  rng = np.random.default_rng(0)
  return fitness.make_batch(rng.integers(3, config.vocab_size, (examples, prompt_len)).tolist(),
                            rng.integers(3, config.vocab_size, (examples, window)).tolist(),
                            np.arange(examples) % 3)


def time_fitness(config, params, batch, mults, s: Settings, reps: int) -> dict:
  """Compiles and times one setting: seconds of the first call and the median of `reps`."""
  cfg = dataclasses.replace(config, dtype=s.dtype, attention_implementation=s.implementation)
  params = jax.tree.map(lambda x: x.astype(s.dtype), params)
  fn = fitness.make_fitness_fn(params, batch, forward=fitness.llama_fitness_fns(cfg)[0],
                               example_batch=s.example_batch, candidate_batch=s.candidate_batch)
  t0 = time.perf_counter()
  acc = fn(mults)
  first = time.perf_counter() - t0
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn(mults)
    times.append(time.perf_counter() - t0)
  sec = statistics.median(times)
  counts = np.rint(acc * np.bincount(batch.subset, minlength=3)).astype(int)
  return {"settings": dataclasses.asdict(s), "first_call_s": first, "median_s": sec,
          "candidate_examples_per_s": len(mults) * batch.num_examples / sec,
          "counts": counts.tolist()}


def hf_config(config: LlamaConfig) -> dict:
  """The Hugging Face `LlamaForCausalLM` config.json of `config` (read back by
  `checkpoints.load_hf_config`, and by transformers)."""
  if config.rope_scaling is not None:
    raise ValueError("hf_config: checkpoints with built-in RoPE scaling are not exported")
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
          "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "intermediate_size": config.intermediate_size,
          "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
          "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
          "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
          "max_position_embeddings": config.max_position_embeddings,
          "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
          "torch_dtype": "float32"}


def export_weights(config: LlamaConfig, params, folder: str) -> None:
  """`folder/model.safetensors`: the params as float32 Hugging Face tensors, through the
  loader's own name map (`checkpoints.hf_name_map`)."""
  from safetensors.numpy import save_file
  from lpes_jax.checkpoints import hf_name_map
  tensors = {}
  for spec in hf_name_map(config):
    w = params
    for key in spec.path:
      w = w[key]
    w = np.asarray(w, np.float32)
    tensors[spec.name] = np.ascontiguousarray(w.T if "transpose" in spec.transform else w)
    assert tensors[spec.name].shape == spec.shape, (spec.name, tensors[spec.name].shape)
  save_file(tensors, os.path.join(folder, "model.safetensors"))


def run(args) -> dict:
  smoke = args.preset == "smoke"
  results = {"preset": args.preset, "device": str(jax.devices()[0].device_kind),
             "num_devices": jax.device_count(), "jax": jax.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": {}}
  for case in PRESETS[args.preset]:
    if case.name.startswith("llama7b") and args.skip_7b:
      continue
    if case.prompt_len:
      config = TINY if smoke else LLAMA_7B
      params = init_params(dataclasses.replace(config, dtype="bfloat16"), jax.random.key(0))
      batch = synthetic_batch(config, case.examples, case.prompt_len, case.window)
      mults = 1 / np.random.default_rng(0).uniform(1, 2, (case.candidates, config.num_layers))
      what = f"{'tiny' if smoke else 'Llama-7B'} shape, random rows, random weights"
    else:
      config, params, batch, mults, what = load_smollm2(args.smollm2)
    rows = fitness.teacher_forced_inputs(batch)[0].shape[1]
    record = results["cases"][case.name] = {"what": what, "tokens_per_row": rows,
                                            "examples": batch.num_examples,
                                            "candidates": len(mults)}
    print(f"{case.name}: {what}", flush=True)
    for name, s in case.settings.items():
      record[name] = time_fitness(config, params, batch, mults, s, args.reps)
      print(f"{case.name:14s} {name:7s} {s.label():40s} "
            f"{record[name]['candidate_examples_per_s']:10.2f} cand-ex/s "
            f"(first call {record[name]['first_call_s']:.1f} s)", flush=True)
    del params
    common.write_json(os.path.join(args.out, "results.json"), results)
  return results


def report(results: dict, out: str) -> str:
  """The side-by-side table, the 7B projection and the transformers comparison."""
  torch_runs = {}
  for path in sorted(glob.glob(os.path.join(out, "transformers_*.json"))):
    with open(path) as fh:
      torch_runs[os.path.basename(path)[len("transformers_"):-len(".json")]] = json.load(fh)
  lines = [f"LPES fitness, {results['device']} x {results['num_devices']}, jax {results['jax']}",
           "| case | tokens/row | before | fused | x before | transformers | x transformers |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  rate = lambda r: r["candidate_examples_per_s"] if r else None
  cell = lambda x: "-" if x is None else f"{x:.2f}"
  for name, r in results["cases"].items():
    before, fused = rate(r.get("before")), rate(r["fused"])
    theirs = rate(torch_runs.get(name.replace("llama", ""), torch_runs.get(name.split("_")[0])))
    lines.append(f"| {name} | {r['tokens_per_row']} | {cell(before)} | {cell(fused)} | "
                 f"{cell(before and fused / before)} | {cell(theirs)} | "
                 f"{cell(theirs and fused / theirs)} |")
  lines += [f"{name}: {r['what']}" for name, r in results["cases"].items()]
  n = PAPER_SEARCH[0] * PAPER_SEARCH[1]
  for name, r in results["cases"].items():
    if name.startswith("llama7b"):
      hours = {k: n / r[k]["candidate_examples_per_s"] / 3600 * results["num_devices"]
               for k in ("before", "fused") if k in r}
      before = f", before {hours['before']:.2f} h" if "before" in hours else ""
      lines.append(f"projected 7B search, {name}: {PAPER_SEARCH[0]} candidates x "
                   f"{PAPER_SEARCH[1]} examples on one device: {hours['fused']:.2f} h{before} "
                   f"(paper: {PAPER_HOURS})")
  smol = results["cases"].get("smollm2_kv")
  if smol:
    ours = np.asarray(smol["fused"]["counts"])
    ref = np.asarray(smol["before"]["counts"])
    lines.append(f"SmolLM2 counts ({smol['what']}), fused bf16 vs before (xla float32): "
                 f"subset counts differ by {int(np.abs(ours - ref).sum())} in all, of "
                 f"{len(ours) * smol['examples']} "
                 f"candidate-examples (per candidate: fused {ours.sum(1).tolist()}, before "
                 f"{ref.sum(1).tolist()})")
    random = "random weights"
    if "smollm2" in torch_runs and random in smol["what"] + torch_runs["smollm2"]["source"]:
      lines.append("SmolLM2 counts vs transformers: not compared (random weights, drawn apart)")
    elif "smollm2" in torch_runs:
      theirs = np.asarray(torch_runs["smollm2"]["counts"])
      same = "the same" if np.array_equal(ours, theirs) else "differing"
      lines.append(f"SmolLM2 counts, fused bf16 vs transformers {torch_runs['smollm2']['dtype']}:"
                   f" {same} (subset counts differ by {int(np.abs(ours - theirs).sum())} in all; "
                   f"per candidate transformers {theirs.sum(1).tolist()})")
  return "\n".join(lines)


def main(argv=None) -> None:
  p = common.make_parser("bench_lpes", __doc__, PRESET_HELP)
  p.add_argument("--preset", choices=tuple(PRESETS), default="h100",
                 help="cases and sizes (see presets below)")
  p.add_argument("--out", default="runs/bench_lpes",
                 help="folder for results.json, the SmolLM2 export and transformers' JSON")
  p.add_argument("--reps", type=common.positive_int, default=2,
                 help="timed calls per setting after the compiling one (median reported)")
  p.add_argument("--skip-7b", action="store_true", help="leave out the 7B-shape cases")
  p.add_argument("--smollm2", default=".cache/smollm2_set",
                 help="folder of the SmolLM2 case, written by --export-smollm2")
  p.add_argument("--export-smollm2", metavar="DIR",
                 help="write the SmolLM2 search set (the preset's size) and config to DIR for "
                      "--smollm2 (needs the GGUF; smoke: a tiny model), measure nothing")
  p.add_argument("--export-size", type=common.positive_int, nargs=2,
                 metavar=("EXAMPLES", "CANDIDATES"), help="--export-smollm2: this size instead")
  p.add_argument("--with-weights", action="store_true",
                 help="--export-smollm2: also the float32 weights, which --smollm2 then uses "
                      "instead of random ones")
  p.add_argument("--report", action="store_true",
                 help="print the tables of the results already in --out, measure nothing")
  args = p.parse_args(argv)
  path = os.path.join(args.out, "results.json")
  if args.export_smollm2:
    case = next(c for c in PRESETS[args.preset] if c.name == "smollm2_kv")
    examples, candidates = args.export_size or (case.examples, case.candidates)
    export_smollm2(args.export_smollm2, args.preset == "smoke", examples, candidates,
                   args.with_weights)
    print(f"wrote {args.export_smollm2}: {examples} examples x {candidates} candidates")
    return
  if args.report:
    if not os.path.exists(path):
      p.error(f"--report: no {path}; run without --report first")
    with open(path) as fh:
      results = json.load(fh)
  else:
    if not os.path.exists(os.path.join(args.smollm2, "search_set.npz")):
      p.error(f"--smollm2: no {args.smollm2}/search_set.npz; write it with --export-smollm2 "
              f"{args.smollm2} (on a machine with the SmolLM2 GGUF)")
    os.makedirs(args.out, exist_ok=True)
    with common.locked(p, args.out):
      results = run(args)
  text = report(results, args.out)
  print(text)
  with open(os.path.join(args.out, "report.md"), "w") as fh:
    fh.write(text + "\n")


if __name__ == "__main__":
  main()
