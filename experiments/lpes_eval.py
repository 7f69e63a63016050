"""Lost-in-the-middle evaluation of a Llama-family model: accuracy per gold position.

    python -m experiments.lpes_eval --model PATH --task kv|mdqa \
        --method base|pi|ms_poe|buckets|lpes [--scales results.json] [--num-examples 500]

Held-out KV examples come from `--seed` (default 1; the search uses seed 0); MDQA examples from
`--mdqa-file` with the gold document moved to each position. Greedy decoding (KV cache); KV is
scored by case-insensitive substring on the whole output, MDQA by best_subspan_em on the first line.
Writes `<out>/eval_<task>_<method>.json` (accuracies, config, timing, versions) and a
lost-in-the-middle PNG, and prints a table with the median generation time per batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from lpes_jax import baselines, search
from lpes_jax.checkpoints import load_checkpoint
from lpes_jax.llama import Llama
from lpes_jax.tasks import (KVConfig, best_subspan_em, kv_match, make_kv_examples,
                            position_indices, read_mdqa)
from lpes_jax.tokenizer import load_tokenizer

METHODS = ("base", "pi", "ms_poe", "buckets", "lpes")


def add_task_flags(p: argparse.ArgumentParser) -> None:
  """Flags shared by evaluation and search."""
  p.add_argument("--model", required=True, help="GGUF file or Hugging Face folder")
  p.add_argument("--task", choices=("kv", "mdqa"), default="kv")
  p.add_argument("--num-pairs", type=int, default=140, help="KV records per prompt")
  p.add_argument("--key-length", type=int, default=None, help="KV key length (default UUID)")
  p.add_argument("--value-length", type=int, default=None, help="KV value length (default UUID)")
  p.add_argument("--alphabet", default="0123456789abcdef")
  p.add_argument("--mdqa-file", default=None, help="LitM multi-document QA .jsonl(.gz)")
  p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--out", default="runs/lpes")


def load_model(args):
  """(model, params, config, tokenizer) from --model."""
  cfg, params = load_checkpoint(args.model, dtype=args.dtype)
  return Llama(cfg), params, cfg, load_tokenizer(args.model)


def encode_prompt(tok, prompt: str, chat: bool) -> list[int]:
  if chat:
    return tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
  return tok.encode(prompt)


def task_examples(args, gold: int, n: int, seed: int):
  """n examples with the gold item at `gold`: KV from the seed, MDQA from the file."""
  if args.task == "kv":
    kvc = KVConfig(num_pairs=args.num_pairs, key_length=args.key_length,
                   value_length=args.value_length, alphabet=args.alphabet)
    return make_kv_examples(seed, n, kvc, gold)
  if not args.mdqa_file:
    raise ValueError("--task mdqa needs --mdqa-file")
  exs = read_mdqa(args.mdqa_file)
  rng = np.random.default_rng(seed)
  idx = rng.permutation(len(exs))[:n]
  return [exs[i].with_gold_at(gold) for i in idx]


def num_items(args) -> int:
  if args.task == "kv":
    return args.num_pairs
  return len(read_mdqa(args.mdqa_file, limit=1)[0].documents)


def score(args, output: str, example) -> float:
  if args.task == "kv":
    return kv_match(output, example.value)
  return best_subspan_em(output, example.answers)


def make_generator(method: str, model, params, cfg, args):
  """A function (tokens [B, T], mask [B, T], num_new) → tokens [B, num_new] for the method."""
  greedy = search.llama_greedy(model)
  if method in ("base", "pi", "lpes"):
    if method == "base":
      mult = None
    elif method == "pi":
      mult = jnp.asarray(baselines.pi_multipliers(args.pi_scale))
    else:
      if not args.scales:
        raise ValueError("--method lpes needs --scales results.json")
      mult = search.load_multipliers(args.scales)
      if mult.shape != (cfg.num_layers,):
        raise ValueError(f"{args.scales}: {mult.shape[0]} scales, but the model has "
                         f"{cfg.num_layers} layers")
      mult = jnp.asarray(mult)
    fn = jax.jit(lambda p, t, m, n: greedy(p, t, m, mult, n), static_argnums=3)
  elif method == "ms_poe":
    ms = baselines.MsPoEConfig(official_indexing=args.ms_poe_official)

    def ms_poe(p, t, m, n):
      mults = baselines.ms_poe_multipliers(model, p, t, m, ms)                 # [B, L, N]
      row = lambda ti, mi, mu: greedy(p, ti[None], mi[None], mu, n)[0]
      return jax.vmap(row)(t, m, mults)
    fn = jax.jit(ms_poe, static_argnums=3)
  elif method == "buckets":
    bases = baselines.bucket_bases(cfg.rope_theta, relative=not args.buckets_absolute)
    fn = jax.jit(lambda p, t, m, n: baselines.buckets_greedy(cfg, bases, p, t, m, n),
                 static_argnums=3)
  else:
    raise ValueError(f"--method must be one of {METHODS}, got {method!r}")
  return lambda t, m, n: fn(params, t, m, n)


def pad_left(ids: list[list[int]], pad_id: int, length: int | None = None):
  T = length or max(map(len, ids))
  t = np.full((len(ids), T), pad_id, np.int32)
  m = np.zeros((len(ids), T), bool)
  for i, x in enumerate(ids):
    t[i, T - len(x):] = x
    m[i, T - len(x):] = True
  return t, m


def evaluate(args) -> dict:
  """Accuracy per gold position for one method; returns the JSON-able record."""
  model, params, cfg, tok = load_model(args)
  gen = make_generator(args.method, model, params, cfg, args)
  n_items = num_items(args)
  positions = args.positions or position_indices(n_items, 5)
  pad_id = cfg.pad_token_id or 0
  eos = set(cfg.eos_token_ids)
  acc, timing, samples = {}, [], {}
  for gold in positions:
    exs = task_examples(args, gold, args.num_examples, args.seed)
    ids = [encode_prompt(tok, e.prompt, args.chat) for e in exs]
    longest = max(map(len, ids))
    if longest + args.max_new_tokens > cfg.max_position_embeddings:
      raise ValueError(f"prompt of {longest} tokens + {args.max_new_tokens} new tokens exceeds the "
                       f"model's context of {cfg.max_position_embeddings}: use fewer pairs")
    length = -(-longest // 32) * 32                      # one compiled shape per position
    scores = []
    for b in range(0, len(ids), args.batch_size):
      chunk = ids[b:b + args.batch_size]
      chunk = chunk + [chunk[0]] * (args.batch_size - len(chunk))          # fixed batch shape
      t, m = pad_left(chunk, pad_id, length)
      t0 = time.perf_counter()
      out = np.asarray(jax.block_until_ready(gen(t, m, args.max_new_tokens)))
      timing.append({"gold": gold, "batch": b, "seconds": time.perf_counter() - t0,
                     "prompt_len": length})
      for e, o in zip(exs[b:b + args.batch_size], out):
        o = list(o)
        stop = next((i for i, x in enumerate(o) if x in eos), len(o))
        text = tok.decode(o[:stop])
        scores.append(score(args, text, e))
        samples.setdefault(str(gold), []).append(text) if len(samples.get(str(gold), [])) < 3 else None
    acc[str(gold)] = float(np.mean(scores))
    print(f"  {args.method:8s} gold {gold:4d}: {acc[str(gold)]:.3f}  ({len(scores)} examples)",
          flush=True)
  steady = [x["seconds"] for x in timing[1:]] or [timing[0]["seconds"]]
  return {
      "method": args.method, "task": args.task, "accuracy": acc, "num_examples": args.num_examples,
      "positions": positions, "num_items": n_items, "samples": samples,
      "seconds_per_batch_median": float(np.median(steady)), "batch_size": args.batch_size,
      "first_batch_seconds_with_compile": timing[0]["seconds"],
      "args": {k: v for k, v in vars(args).items()},
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count(),
  }


def plot(records: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for r in records:
    xs = [int(g) for g in r["accuracy"]]
    ax.plot(xs, list(r["accuracy"].values()), "o-", label=r["method"])
  ax.set_xlabel("gold position")
  ax.set_ylabel("accuracy")
  ax.set_ylim(-0.02, 1.02)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  add_task_flags(p)
  p.add_argument("--method", choices=METHODS, default="base")
  p.add_argument("--scales", default=None, help="results.json of an LPES search")
  p.add_argument("--num-examples", type=int, default=500, help="held-out examples per position")
  p.add_argument("--positions", type=lambda s: [int(x) for x in s.split(",")], default=None)
  p.add_argument("--seed", type=int, default=1, help="held-out seed (the search uses 0)")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--max-new-tokens", type=int, default=48,
                 help="tokens generated per example (a quoted UUID value takes ~27)")
  p.add_argument("--pi-scale", type=float, default=1.5)
  p.add_argument("--ms-poe-official", action="store_true",
                 help="Ms-PoE: index the ratio table with the argsort (released code)")
  p.add_argument("--buckets-absolute", action="store_true",
                 help="Attention Buckets: use the RAG bases as is, not scaled to the model's base")
  args = p.parse_args(argv)
  if args.num_examples < 1:
    p.error("--num-examples must be >= 1")
  if args.method == "lpes":
    if not args.scales:
      p.error("--method lpes needs --scales results.json")
    try:  # Bad files fail here, before the slow model load.
      search.load_scales(args.scales)
    except (OSError, ValueError) as e:
      p.error(f"--scales: {e}")
  os.makedirs(args.out, exist_ok=True)
  record = evaluate(args)
  path = os.path.join(args.out, f"eval_{args.task}_{args.method}.json")
  common.write_json(path, record)
  plot([record], os.path.join(args.out, f"eval_{args.task}_{args.method}.png"))
  print("gold  " + "  ".join(f"{g:>6s}" for g in record["accuracy"]))
  print(f"{args.method:5s} " + "  ".join(f"{a:6.3f}" for a in record["accuracy"].values()))
  print(f"median seconds per batch of {args.batch_size}: {record['seconds_per_batch_median']:.4f}")


if __name__ == "__main__":
  main()
