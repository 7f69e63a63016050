"""Generation latency of base, LPES, PI, Ms-PoE, Attention Buckets and MoICE on one Llama model.

    python -m experiments.lpes_latency --preset llama-7b-shape [--model PATH] \\
        [--methods base,lpes,ms_poe]

A random-weight model of a named shape (or a real checkpoint with --model) greedily generates
`--new-tokens` tokens after a `--prompt-len` prompt for `--batch` rows. Each method is compiled
once, then timed `--repeats` times (median reported); LPES uses an arbitrary per-layer scale curve,
which costs exactly what any curve costs; MoICE uses random routers with the released experts
(E = 7, top-7), which cost what trained ones do. Writes `<out>/latency.json` and
`<out>/latency.png`.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from lpes_jax import baselines, generate, moice
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import Llama, init_params

PRESETS = {
    "llama-7b-shape": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                           num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                           rope_theta=10000.0, max_position_embeddings=4096),
    "smollm2-135m-shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                               rope_theta=100000.0, max_position_embeddings=8192,
                               tie_word_embeddings=True),
}


PRESET_HELP = {name: f"random weights, {p['num_layers']} layers x {p['hidden_size']}, "
                     f"{p['num_heads']} heads ({p['num_kv_heads']} kv), vocab {p['vocab_size']}"
               for name, p in PRESETS.items()}
METHODS = ("base", "lpes", "pi", "ms_poe", "buckets", "moice")


def main(argv=None) -> None:
  p = common.make_parser("lpes_latency", __doc__, PRESET_HELP)
  p.add_argument("--preset", choices=tuple(PRESETS), default="llama-7b-shape",
                 help="model shape with random weights (see presets below)")
  p.add_argument("--model", default=None, type=common.existing_path,
                 help="real checkpoint instead of random weights (default: none, the preset)")
  p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                 help="weights and compute dtype")
  p.add_argument("--methods", default=",".join(METHODS),
                 help=f"comma-separated methods to time, of {', '.join(METHODS)}")
  p.add_argument("--batch", type=common.positive_int, default=1, help="rows per generation")
  p.add_argument("--prompt-len", type=common.positive_int, default=2048,
                 help="prompt tokens per row")
  p.add_argument("--new-tokens", type=common.positive_int, default=32,
                 help="tokens generated per row")
  p.add_argument("--repeats", type=common.positive_int, default=5,
                 help="timed calls per method after the first (median reported)")
  p.add_argument("--attention", default="auto", choices=("auto", "xla", "cudnn"),
                 help="Llama attention implementation; auto picks cuDNN where it runs, else xla")
  p.add_argument("--out", default="runs/lpes_latency",
                 help="run folder for latency.json and latency.png")
  args = p.parse_args(argv)
  methods = [m.strip() for m in args.methods.split(",")]
  for m in methods:
    if m not in METHODS:
      p.error(f"--methods: unknown method {m!r} (choose from {', '.join(METHODS)})")
  with common.locked(p, args.out):
    time_methods(args, methods)


def time_methods(args: argparse.Namespace, methods: list[str]) -> None:
  """Builds the model, times each method and writes OUT/latency.{json,png}."""
  attention = None if args.attention == "auto" else args.attention
  if args.model:
    from lpes_jax.checkpoints import load_checkpoint
    cfg, params = load_checkpoint(args.model, dtype=args.dtype,
                                  attention_implementation=attention)
  else:
    cfg = LlamaConfig(**PRESETS[args.preset], dtype=args.dtype,
                      attention_implementation=attention)
    params = init_params(cfg, jax.random.key(0))
  model = Llama(cfg)
  greedy = functools.partial(generate.greedy_tokens, cfg)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (args.batch, args.prompt_len)), jnp.int32)
  mask = jnp.ones_like(tokens, bool)
  curve = jnp.asarray(1.0 / np.linspace(1.0, 2.0, cfg.num_layers), jnp.float32)
  n = args.new_tokens
  mcfg = moice.paper_config(cfg.rope_theta)
  routers = moice.init_routers(jax.random.key(1), cfg, mcfg)
  fns = {
      "base": jax.jit(lambda p, t, m: greedy(p, t, m, None, n)),
      "lpes": jax.jit(lambda p, t, m, c: greedy(p, t, m, c, n)),
      "pi": jax.jit(lambda p, t, m: greedy(p, t, m, jnp.float32(1 / 1.5), n)),
      "ms_poe": jax.jit(lambda p, t, m: jax.vmap(
          lambda ti, mi, mu: greedy(p, ti[None], mi[None], mu, n)[0])(
              t, m, baselines.ms_poe_multipliers(model, p, t, m))),
      "buckets": jax.jit(lambda p, t, m: baselines.buckets_greedy(
          cfg, baselines.bucket_bases(cfg.rope_theta), p, t, m, n)),
      "moice": jax.jit(lambda p, t, m, r: greedy(
          p, t, m, None, n, attention=moice.moice_attention(r, cfg, mcfg))),
  }
  results = {}
  for name in methods:
    extra = {"lpes": (curve,), "moice": (routers,)}.get(name, ())
    t0 = time.perf_counter()
    jax.block_until_ready(fns[name](params, tokens, mask, *extra))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fns[name](params, tokens, mask, *extra))
      times.append(time.perf_counter() - t0)
    results[name] = {"median_s": float(np.median(times)), "times_s": times,
                     "first_call_s": compile_s}
    print(f"{name:8s} median {np.median(times) * 1e3:9.2f} ms  (first call {compile_s:.1f} s)",
          flush=True)
  if "base" in results:
    for name, r in results.items():
      r["ratio_vs_base"] = r["median_s"] / results["base"]["median_s"]
      print(f"{name:8s} / base = {r['ratio_vs_base']:.3f}")
  common.write_json(os.path.join(args.out, "latency.json"), {
      "args": vars(args), "config": repr(cfg), "results": results,
      "device": str(jax.devices()[0].device_kind), "jax": jax.__version__})
  _plot(results, os.path.join(args.out, "latency.png"),
        f"{args.preset if args.model is None else args.model}, batch {args.batch}, "
        f"{args.prompt_len}-token prompt, {args.new_tokens} new tokens")


def _plot(results: dict, path: str, title: str) -> None:
  """Bar chart of the median generation latency per method."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  names = list(results)
  ax.bar(names, [results[n]["median_s"] * 1e3 for n in names], color="tab:blue")
  ax.set_ylabel("median latency (ms)")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
