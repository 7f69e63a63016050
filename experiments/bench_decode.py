"""KV-cache decode throughput of `pope_jax.Transformer`: RoPE and PoPE, fused and XLA attention,
against the bandwidth limit.

    python -m experiments.bench_decode --preset h200 --out runs/bench_decode   # GPT-2-124M shape
    python -m experiments.bench_decode --preset smoke                          # CPU, seconds

Random bf16 weights of the preset's shape. For each encoding, cache layout
(`ModelConfig.kv_cache_keys`: "mapped" keys, i.e. RoPE-rotated or PoPE-Cartesian, or "raw"
projections mapped again each step), attention implementation and (context C, batch B):
`pope_jax.generation.decode` (greedy) from a cache holding C − 1 prompt tokens, fed the last
one: G single-token steps, tokens/s = B·G / time (median of `reps` runs after a compiling one).

The bandwidth limit of a row: a step must read every weight once and every cached key and value
of the valid slots once (in the layout's width), so tokens/s ≤ B · HBM bandwidth / bytes per
step. The bandwidth is measured in the same run by a device-to-device copy (read + write). The
table prints each row's limit and its tokens/s as a percentage of it, with the cache's memory.
Writes OUT/results.json and OUT/results.md.
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
from pope_jax.generation import CACHE_BLOCK, decode, transformer_step
from pope_jax.model import Transformer, init_cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
  model: ModelConfig
  shapes: tuple[tuple[int, int], ...]   # (context C, batch B)
  new_tokens: int                       # G
  reps: int = 3
  copy_bytes: int = 1 << 30             # of the bandwidth-measuring copy
  # Prompt tokens per prefill call: the prefill attends through the XLA reference, whose float32
  # scores [B, N, chunk, S] take 3.3 GB at 8k x 8 (GPT-2-124M) with 1,024.
  prefill_chunk: int = 1024


PRESETS = {
    "h200": Preset(model=dataclasses.replace(MODEL_PRESETS["gpt2_124m"], dtype="bfloat16"),
                   shapes=((8192, 8), (8192, 1), (32768, 1)), new_tokens=128),
    "smoke": Preset(model=dataclasses.replace(MODEL_PRESETS["gpt2_124m"], num_layers=2,
                                              d_model=64, num_heads=4, vocab_size=256,
                                              dtype="bfloat16"),
                    shapes=((32, 2), (64, 1)), new_tokens=4, reps=1, copy_bytes=1 << 20,
                    prefill_chunk=24),
}

# The (encoding, kv_cache_keys) rows: PoPE in both layouts; RoPE's raw layout rotates the whole
# cache each step like PoPE's, so it is left out.
LAYOUTS = (("rope", "mapped"), ("pope", "mapped"), ("pope", "raw"))


def _median_seconds(fn, reps: int) -> float:
  jax.block_until_ready(fn())                                        # warm-up: compiles
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
  """Device-to-device copy bandwidth in bytes/s (bytes read plus written) of a `nbytes` array."""
  x = jnp.zeros((nbytes // 4,), jnp.uint32)
  copy = jax.jit(lambda x: x + jnp.uint32(1))
  return 2 * x.nbytes / _median_seconds(lambda: copy(x), reps)


def step_bytes(config: ModelConfig, params, context: int, batch: int, new_tokens: int) -> int:
  """Bytes a decode step must read: the weights once, and the cached keys (in the cache's
  width) and values of the valid slots (C − 1 + (G + 1) / 2 on average over the G steps)."""
  weights = sum(x.nbytes for x in jax.tree.leaves(params))
  cache = jax.eval_shape(lambda: init_cache(config, batch, 1))
  per_slot = sum(x.dtype.itemsize * x.size // batch for x in (*cache["k"], *cache["v"]))
  valid = context - 1 + (new_tokens + 1) / 2
  return int(weights + batch * valid * per_slot)


def bench_one(config: ModelConfig, context: int, batch: int, new_tokens: int, reps: int,
              prefill_chunk: int) -> dict[str, float]:
  """tokens/s of cached greedy decoding, bytes per step and cache bytes, at one context and
  batch."""
  model = Transformer(config)
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  params = jax.tree.map(lambda x: x.astype(config.dtype), params)
  tokens = jax.random.randint(jax.random.key(1), (batch, context), 0, config.vocab_size)
  mask = jnp.ones((batch, context), bool)
  slots = -(-(context + new_tokens) // CACHE_BLOCK) * CACHE_BLOCK
  prefill = jax.jit(transformer_step(config, params))
  cache = init_cache(config, batch, slots)
  for start in range(0, context - 1, prefill_chunk):
    stop = min(start + prefill_chunk, context - 1)
    _, cache = prefill(tokens[:, start:stop], mask[:, start:stop], cache)

  @jax.jit
  def generate(params, cache, last):
    return decode(transformer_step(config, params), cache, last, mask[:, -1:],
                  max_new_tokens=new_tokens)[0]

  seconds = _median_seconds(lambda: generate(params, cache, tokens[:, -1:]), reps)
  cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
  return {"tokens_per_s": batch * new_tokens / seconds,
          "step_bytes": step_bytes(config, params, context, batch, new_tokens),
          "cache_bytes": cache_bytes}


def main(argv: list[str] | None = None) -> dict:
  parser = common.make_parser("bench_decode", __doc__, {
      "h200": "GPT-2-124M shape in bf16 at 8k x 8, 8k x 1 and 32k x 1 (GPU)",
      "smoke": "a 2-layer, 64-wide bf16 model at tiny contexts (CPU, seconds)"})
  parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke",
                      help="configuration to time (see presets below)")
  parser.add_argument("--encodings", default="rope,pope", help="comma-separated rope,pope")
  parser.add_argument("--implementations", default="fused,xla",
                      help="comma-separated fused (attention_implementation None: the decoding "
                      "kernel on Hopper) and xla (the reference)")
  parser.add_argument("--out", type=Path, default=Path("runs/bench_decode"),
                      help="folder for results.json and results.md")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  args = parser.parse_args(argv)
  encodings = common.encodings_list(parser, args.encodings, ("rope", "pope"))
  impls = common.encodings_list(parser, args.implementations, ("fused", "xla"),
                                flag="--implementations")
  preset = PRESETS[args.preset]
  cases = [(enc, keys, impl, c, b) for enc, keys in LAYOUTS if enc in encodings
           for impl in impls for c, b in preset.shapes]
  rows, results = [], []
  with common.locked(parser, args.out):
    bandwidth = copy_bandwidth(preset.copy_bytes)
    print(f"device-to-device copy: {bandwidth / 1e12:.3f} TB/s", flush=True)
    for enc, keys, impl, context, batch in tqdm(cases, desc="cases", disable=args.no_progress):
      config = dataclasses.replace(preset.model, pos_encoding=enc, kv_cache_keys=keys,
                                   attention_implementation="xla" if impl == "xla" else None)
      r = bench_one(config, context, batch, preset.new_tokens, preset.reps,
                    preset.prefill_chunk)
      limit = batch * bandwidth / r["step_bytes"]
      results.append({"encoding": enc, "kv_cache_keys": keys, "implementation": impl,
                      "context": context, "batch": batch, "limit_tokens_per_s": limit, **r})
      rows.append([enc, keys, impl, context, batch, f"{r['tokens_per_s']:.0f}", f"{limit:.0f}",
                   f"{100 * r['tokens_per_s'] / limit:.0f} %", f"{r['step_bytes'] / 1e6:.0f}",
                   f"{r['cache_bytes'] / 1e6:.0f}"])
      print(" | ".join(map(str, rows[-1])), flush=True)
  table = reporting.markdown_table(
      ["encoding", "cache keys", "attention", "context", "batch", "tokens/s", "limit tokens/s",
       "of limit", "MB read / step", "cache MB"], rows)
  print(table)
  record = {"preset": args.preset, "model": preset.model, "new_tokens": preset.new_tokens,
            "copy_bandwidth_bytes_per_s": bandwidth, "results": results,
            "metadata": reporting.run_metadata()}
  reporting.write_json(args.out / "results.json", record)
  device = jax.devices()[0].device_kind
  (args.out / "results.md").write_text(
      f"# Decode throughput ({args.preset} preset, {device})\n\nHBM bandwidth by a "
      f"device-to-device copy: {bandwidth / 1e12:.3f} TB/s.\n\n{table}\n")
  return record


if __name__ == "__main__":
  main()
