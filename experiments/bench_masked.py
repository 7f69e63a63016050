"""Masked calls of the fused PoPE kernel against its unmasked call, and memory against XLA.

Times forward+backward of the kernel on one shape, unmasked and with each masking of
`pallas_kernels.shapes.mask_inputs` (ragged right padding, left padding, four packed documents
per row, a per-head frequency multiplier), in one process on one GPU, and prints each as a
ratio to the unmasked call. Padding and packing also skip the tiles no query sees, so their
time can fall below the unmasked one. Then prints the peak temporary device memory of
forward+backward (XLA's compiled memory analysis) of the XLA reference and of the kernel at
each --memory-lengths, the reference's growing with T·S and the kernel's with S.

  python -m experiments.bench_masked --shapes bench_h64,bench_h128
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp

from experiments import _timing, common
from pallas_kernels import pope_attention as kernel
from pallas_kernels.shapes import MASK_KINDS, SHAPES, AttentionShape, mask_inputs, random_inputs
from pope_jax import attention, encodings, positions

TIMING_WINDOWS = 5
MIN_WINDOW_MS = 100.0


def _kernel(q, k, v, delta, *, is_causal, multiplier=None, **masks):
  """The kernel as `pope_attention(implementation="pallas")` calls it (default positions, θ
  times `multiplier`, the clamped δ), with key_mask / segment ids passed through."""
  q_pos, k_pos, _ = positions.resolve(q.shape[0], q.shape[1], k.shape[1], None, None, None,
                                      keep_numpy=True)
  with jax.ensure_compile_time_eval():
    freqs = encodings.scale_frequencies(encodings.pope_frequencies(q.shape[-1]), multiplier)
  return kernel.pope_attention(
      q, k, v, encodings.clamp_phase_bias(delta), frequencies=freqs, q_positions=q_pos,
      k_positions=k_pos, is_causal=is_causal, cartesian_map=encodings.polar_to_cartesian, **masks)


def time_masked(shape: AttentionShape, iters: int) -> dict:
  """ms of forward+backward per masking ("unmasked" first) and the ratio to the unmasked call.
  The masks are arguments of the jitted step (traced, as in training), so their visit tables
  are computed in each call."""
  def loss(q, k, v, delta, masks):
    return _kernel(q, k, v, delta, is_causal=shape.is_causal, **masks).astype(jnp.float32).sum()

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  args = random_inputs(shape)
  rows = {}
  for kind in ("unmasked", *MASK_KINDS):
    masks = {} if kind == "unmasked" else mask_inputs(shape, kind, seed=1)
    ms = _timing.wall_ms(step, *args, masks, iters=iters, windows=TIMING_WINDOWS,
                         min_window_ms=MIN_WINDOW_MS)
    rows[kind] = {"ms": ms, "ratio": ms / rows["unmasked"]["ms"] if rows else 1.0}
    print(f"  {kind:<14} {ms:8.3f} ms  {rows[kind]['ratio']:.3f}x unmasked", flush=True)
  return rows


def peak_memory(shape: AttentionShape) -> dict:
  """Temporary device bytes of forward+backward, compiled (not run), of the XLA reference and
  the kernel, with right-padded keys (a key_mask); a path that fails to compile (e.g. out of
  memory while autotuning) gives its error instead."""
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.eval_shape(
      lambda: random_inputs(shape))]
  key_mask = jax.ShapeDtypeStruct((shape.batch, shape.k_len), jnp.bool_)
  paths = {
      "xla": lambda q, k, v, d, m: attention.pope_attention(
          q, k, v, d, is_causal=shape.is_causal, key_mask=m, implementation="xla"),
      "fused": lambda q, k, v, d, m: _kernel(q, k, v, d, is_causal=shape.is_causal, key_mask=m),
  }
  result = {}
  for name, fn in paths.items():
    grad = jax.jit(jax.grad(lambda q, k, v, d, m: fn(q, k, v, d, m).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2, 3)))
    try:
      result[name] = int(grad.lower(*args, key_mask).compile().memory_analysis()
                         .temp_size_in_bytes)
    except Exception as e:  # reported in the table, the other path still measured
      result[name] = f"{type(e).__name__}: {str(e)[:300]}"
  return result


def main():
  global MIN_WINDOW_MS
  parser = common.make_parser("bench_masked", __doc__)
  parser.add_argument("--out", default="bench_masked.json", help="JSON results file")
  parser.add_argument("--shapes", default="bench_h64,bench_h128",
                      help="shapes of pallas_kernels.shapes to time, comma-separated")
  parser.add_argument("--iters", type=common.positive_int, default=20,
                      help="least timed calls per window (`_timing.wall_ms`)")
  parser.add_argument("--min-window-ms", type=common.nonnegative_float, default=MIN_WINDOW_MS,
                      help="least length of a timing window; 0: --iters calls")
  parser.add_argument("--memory-lengths", default="8192,32768",
                      help="T = S of the memory comparison (B1 N16 H64, causal), comma-separated")
  args = parser.parse_args()
  MIN_WINDOW_MS = args.min_window_ms
  shapes = [n.strip() for n in args.shapes.split(",") if n.strip()]
  if not shapes or (unknown := [n for n in shapes if n not in SHAPES]):
    parser.error(f"--shapes {args.shapes!r}: give some of {sorted(SHAPES)}")
  try:
    lengths = [int(n) for n in args.memory_lengths.split(",") if n.strip()]
  except ValueError:
    parser.error(f"--memory-lengths {args.memory_lengths!r}: give positive integers")
  if any(n <= 0 for n in lengths):
    parser.error(f"--memory-lengths {args.memory_lengths!r}: give positive integers")
  if reason := kernel.platform_reason():
    parser.error(f"needs an NVIDIA Hopper GPU: {reason}")

  results = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
             "date": time.strftime("%Y-%m-%d %H:%M:%S"), "iters": args.iters,
             "min_window_ms": args.min_window_ms, "times": {}, "memory": {}}
  print({k: v for k, v in results.items() if not isinstance(v, dict)}, flush=True)
  for name in shapes:
    print(f"{name}: forward+backward, fused kernel", flush=True)
    results["times"][name] = time_masked(SHAPES[name], args.iters)
  print("peak temporary memory of forward+backward (compiled), key_mask given:")
  for length in lengths:
    shape = AttentionShape(batch=1, q_len=length, k_len=length, num_heads=16, num_kv_heads=16,
                           head_dim=64, value_dim=64)
    mem = peak_memory(shape)
    results["memory"][str(length)] = mem
    gib = lambda x: f"{x / 2**30:9.3f} GiB" if isinstance(x, int) else x
    print(f"  S = {length:>6}: xla {gib(mem['xla'])}   fused {gib(mem['fused'])}", flush=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
