"""Decode throughput of `pope_jax.Transformer`, PoPE against RoPE: KV cache against recomputing.

    python -m experiments.bench_decode --preset h200 --out runs/bench_decode   # GPT-2-124M shape
    python -m experiments.bench_decode --preset smoke                          # CPU, seconds

Random weights of the preset's shape. For each encoding, context C and batch B:
  cached     `pope_jax.generation.decode` (the one generation loop, greedy) from a cache holding
             C − 1 prompt tokens, fed the last one: G single-token calls, tokens/s = B·G / time.
  recompute  one forward over the whole C-token prefix per new token (logits of the last position
             only): tokens/s = B / time(forward).
Each timing is the median of the preset's `reps` runs after one warm-up (compilation) run. The cached path
masks unwritten cache slots (`key_mask`), so PoPE runs the XLA reference there; the recomputing
forward takes `attention_implementation` (None: the fused kernel on Hopper). Writes
OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from experiments import common

from pope_jax import reporting
from pope_jax.config import MODEL_PRESETS, ModelConfig
from pope_jax.generation import decode, transformer_step
from pope_jax.model import Transformer, init_cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
  model: ModelConfig
  contexts: tuple[int, ...]
  batches: tuple[int, ...]
  new_tokens: int                     # G of the cached timing
  reps: int = 3


PRESETS = {
    "h200": Preset(model=dataclasses.replace(MODEL_PRESETS["gpt2_124m"], dtype="bfloat16"),
                   contexts=(1024, 8192), batches=(1, 8), new_tokens=128),
    "smoke": Preset(model=dataclasses.replace(MODEL_PRESETS["gpt2_124m"], num_layers=2,
                                              d_model=64, num_heads=4, vocab_size=256),
                    contexts=(32, 64), batches=(1, 2), new_tokens=8, reps=2),
}


def _median_seconds(fn, reps: int) -> float:
  jax.block_until_ready(fn())                                        # warm-up: compiles
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def bench_one(config: ModelConfig, context: int, batch: int, new_tokens: int,
              reps: int) -> dict[str, float]:
  """{"cached", "recompute"} decode tokens/s of one model at one context and batch size."""
  model = Transformer(config)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  tokens = jax.random.randint(jax.random.key(1), (batch, context), 0, config.vocab_size)
  mask = jnp.ones((batch, context), bool)

  step = transformer_step(config, params)
  _, cache = jax.jit(step)(tokens[:, :-1], mask[:, :-1], init_cache(config, batch,
                                                                    context + new_tokens))

  @jax.jit
  def generate(params, cache, last):
    return decode(transformer_step(config, params), cache, last, mask[:, -1:],
                  max_new_tokens=new_tokens)[0]

  @jax.jit
  def forward(params, tokens):
    return model.apply({"params": params}, tokens, logits_to_keep=1)

  t_gen = _median_seconds(lambda: generate(params, cache, tokens[:, -1:]), reps)
  t_fwd = _median_seconds(lambda: forward(params, tokens), reps)
  return {"cached": batch * new_tokens / t_gen, "recompute": batch / t_fwd}


def main(argv: list[str] | None = None) -> dict:
  parser = common.make_parser("bench_decode", __doc__, {
      "h200": "GPT-2-124M shape in bf16, contexts 1k and 8k, batches 1 and 8 (GPU)",
      "smoke": "a 2-layer, 64-wide model, contexts 32 and 64 (CPU, seconds)"})
  parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke",
                      help="configuration to time (see presets below)")
  parser.add_argument("--encodings", default="rope,pope", help="comma-separated rope,pope")
  parser.add_argument("--implementation", choices=["xla", "pallas"],
                      help="attention_implementation of the model (default: best available)")
  parser.add_argument("--out", type=Path, default=Path("runs/bench_decode"),
                      help="folder for results.json and results.md")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  args = parser.parse_args(argv)
  encodings = common.encodings_list(parser, args.encodings, ("rope", "pope"))
  preset = PRESETS[args.preset]
  cases = [(enc, c, b) for enc in encodings for c in preset.contexts for b in preset.batches]
  rows, results = [], []
  with common.locked(parser, args.out):
    for enc, context, batch in tqdm(cases, desc="cases", disable=args.no_progress):
      config = dataclasses.replace(preset.model, pos_encoding=enc,
                                   attention_implementation=args.implementation)
      r = bench_one(config, context, batch, preset.new_tokens, preset.reps)
      results.append({"encoding": enc, "context": context, "batch": batch, **r})
      rows.append([enc, context, batch, f"{r['cached']:.0f}", f"{r['recompute']:.0f}",
                   f"{r['cached'] / r['recompute']:.1f}x"])
      print(" | ".join(map(str, rows[-1])), flush=True)
  table = reporting.markdown_table(
      ["encoding", "context", "batch", "cached tokens/s", "recompute tokens/s", "speed-up"], rows)
  print(table)
  record = {"preset": args.preset, "model": preset.model, "new_tokens": preset.new_tokens,
            "implementation": args.implementation, "results": results,
            "metadata": reporting.run_metadata()}
  reporting.write_json(args.out / "results.json", record)
  (args.out / "results.md").write_text(f"# Decode throughput ({args.preset} preset, "
                                       f"{jax.devices()[0].device_kind})\n\n{table}\n")
  return record


if __name__ == "__main__":
  main()
