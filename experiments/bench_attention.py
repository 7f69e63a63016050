"""Benchmark PoPE attention on one GPU: the fused Pallas kernel against the best existing paths.

Rows per head dim (B=4, N=16, S=4096, bf16, causal): the XLA reference (materialised scores);
PoPE expansion to 2H-wide Cartesian q', k' + cuDNN (`jax.nn.dot_product_attention`, v zero-padded
to 2H); expansion + tokamax Mosaic GPU attention (when tokamax imports); both again with the
issue's concatenated expansion ("concat expand", softplus materialised first) next to this
library's one-pass `encodings.pope_cartesian`; our fused kernel (`pope_attention(...,
implementation="pallas")`) and the same with `BlockSizes.bounded_softmax` (opt-in; at the
bench's N(0, 1) inputs every query tile is bounded); plain RoPE attention with cuDNN for
scale; with --tokamax-autotune also "expand + tokamax (autotuned)", tokamax after its own
autotuning (`tokamax.autotune`) of the forward and of the forward+backward. FLOPs: PoPE forward
causal = 6·B·N·S²·H/2 (q'k'ᵀ over 2H plus PV over H); forward+backward is counted as 2.5×
forward (the usual FlashAttention convention). Ratios are to the fastest PoPE baseline row
(/best), to untuned tokamax (/tk) and to autotuned tokamax (/tk at). Times are wall clock per
call, the median of `TIMING_WINDOWS` windows of at least --iters calls and `MIN_WINDOW_MS` each
(`_time_ms`).

  python -m experiments.bench_attention --out results.json [--dtypes bfloat16,float16]
      [--tokamax-autotune] [--variants] [--profile] [--power]
      [--train-step [--train-batch N] [--logits-dtype compute] [--train-breakdown]]

--dtypes: the main tables' input dtypes (default bfloat16, the speed target's).
The compiled kernels' correctness checks against the float32 XLA reference are tests:
`python -m pytest -m gpu -n 0` (tests/gpu/) on a Hopper GPU.
--power runs our kernel and RoPE on cuDNN (bf16, at each of --shapes) back to back for a few
seconds each from an idle GPU (`experiments._attention_power`) and gives the time per call of
the first window (burst) and of the sustained windows, the SM clock and the board power from
nvidia-smi: under sustained load the GPU lowers its clock at its power limit.
--profile adds device time per op (`experiments._attention_profile`) of the forward and
forward+backward of the PoPE paths and of RoPE on cuDNN at head dims 64 and 128 and, with
--train-step, of both train steps (`experiments._train_step`).
The paths timed are in `experiments._attention_paths`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments import (_attention_power, _attention_profile, _gpu_power, _timing,
                         _train_step, common)
from experiments._attention_paths import (BASELINES, BOUNDED, OURS, PEAK_TFLOPS, ROPE, TOKAMAX,
                                          TOKAMAX_AUTOTUNED, fused_paths, fwd_bwd, pope_pallas,
                                          pope_xla, rope_cudnn, tile_scale)
from pallas_kernels import pope_attention as kernel
from pallas_kernels.pope_attention_config import default_block_sizes
from pallas_kernels.shapes import SHAPES, random_inputs

TIMING_WINDOWS = 5
MIN_WINDOW_MS = 100.0  # each window runs at least this long, so its one sync is amortised


def _time_ms(fn, *args, iters: int, min_window_ms: float | None = None) -> float:
  """`_timing.wall_ms` over `TIMING_WINDOWS` windows; `min_window_ms` None: the module's
  MIN_WINDOW_MS (--min-window-ms)."""
  return _timing.wall_ms(fn, *args, iters=iters, windows=TIMING_WINDOWS,
                         min_window_ms=MIN_WINDOW_MS if min_window_ms is None else min_window_ms)


def _measure(name, fn, args, flops, iters, contexts=(None, None)):
  """Times fn's forward and forward+backward, each inside its context of `contexts` (None:
  none); a failure becomes the row's "error"."""
  row = {"name": name}
  try:
    with contexts[0] or contextlib.nullcontext():
      row["fwd_ms"] = _time_ms(jax.jit(fn), *args, iters=iters)
    with contexts[1] or contextlib.nullcontext():
      row["fwd_bwd_ms"] = _time_ms(fwd_bwd(fn), *args, iters=iters)
    row["fwd_tflops"] = flops / row["fwd_ms"] * 1e-9
    row["fwd_bwd_tflops"] = 2.5 * flops / row["fwd_bwd_ms"] * 1e-9
    # The backward alone: fwd+bwd minus fwd, counted as 2.5x the forward's FLOPs (FA3's
    # convention), and its share of the measured peak.
    row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
    row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] * 1e-9
    row["bwd_peak_share"] = row["bwd_tflops"] / PEAK_TFLOPS
  except Exception as e:  # A failing row is reported in the table, never hidden.
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    traceback.print_exc()
  return row


def _measure_autotuned(args, flops, iters) -> dict:
  """The tokamax baseline after `tokamax.autotune` of its jitted forward and of its
  forward+backward on `args`, each timed under its result (an overlay of tokamax's cache)."""
  import tokamax  # Only on machines where it is installed.
  fn = functools.partial(BASELINES[TOKAMAX][0])  # its own jitted forms, traced under the result
  try:
    tuned = (tokamax.autotune(jax.jit(fn), *args), tokamax.autotune(fwd_bwd(fn), *args))
  except Exception as e:  # A failing row is reported in the table, never hidden.
    traceback.print_exc()
    return {"name": TOKAMAX_AUTOTUNED, "error": f"{type(e).__name__}: {str(e)[:300]}"}
  return _measure(TOKAMAX_AUTOTUNED, fn, args, flops, iters, contexts=tuned)


def _ratio(ms: float, ref_ms: float | None) -> str:
  return f"{'-':>6s}" if ref_ms is None else f"{ms / ref_ms:6.2f}"


ROWS = ("xla reference", *BASELINES, TOKAMAX_AUTOTUNED, OURS, BOUNDED, ROPE)


def bench_head_dim(shape_name: str, iters: int, with_tokamax: bool, dtype=jnp.bfloat16,
                   tokamax_autotune: bool = False, rows_wanted=ROWS) -> dict:
  """The main table of one shape: the fwd and fwd+bwd ms, TFLOP/s and ratios to the fastest
  baseline (/best), to untuned tokamax (/tk) and to autotuned tokamax (/tk at, with
  `tokamax_autotune`) of each row of `rows_wanted` (names in ROWS)."""
  shape = SHAPES[shape_name]
  args = random_inputs(shape, jnp.dtype(dtype))
  flops = shape.forward_flops()
  paths = {"xla reference": pope_xla,
           **{name: fn for name, (fn, tk) in BASELINES.items() if with_tokamax or not tk},
           **fused_paths(shape.head_dim), ROPE: rope_cudnn}
  measures = {name: functools.partial(_measure, name, fn) for name, fn in paths.items()}
  if with_tokamax and tokamax_autotune:
    measures[TOKAMAX_AUTOTUNED] = _measure_autotuned
  rows = [measures[n](args, flops, iters) for n in ROWS if n in rows_wanted and n in measures]
  baselines = [r for r in rows if r["name"] in (*BASELINES, TOKAMAX_AUTOTUNED)
               and "error" not in r]
  best = {key: min((r[key] for r in baselines), default=float("nan"))
          for key in ("fwd_ms", "fwd_bwd_ms")}
  named = {r["name"]: r for r in rows if "error" not in r}
  refs = {"tk": named.get(TOKAMAX), "tk at": named.get(TOKAMAX_AUTOTUNED)}
  print(f"\n== {shape_name} {jnp.dtype(dtype).name}: {shape} | FLOPs fwd {flops:.3e} "
        f"(fwd+bwd 2.5x) | peak {PEAK_TFLOPS} TFLOP/s")
  ratios = f"{'/best':>6s} {'/tk':>6s} {'/tk at':>6s}"
  print(f"{'implementation':28s} {'fwd ms':>8s} {'TFLOP/s':>8s} {ratios} "
        f"{'fwd+bwd ms':>10s} {'TFLOP/s':>8s} {ratios} {'bwd ms':>7s} {'TFLOP/s':>8s} "
        f"{'%peak':>6s}")
  for r in rows:
    if "error" in r:
      print(f"{r['name']:28s} FAILED {r['error']}")
      continue
    line = f"{r['name']:28s}"
    for key, width in (("fwd_ms", 8), ("fwd_bwd_ms", 10)):
      prefix = key[:-3]
      r[f"{prefix}_ratio"] = r[key] / best[key]
      for label, ref in refs.items():
        if ref is not None:
          r[f"{prefix}_ratio_{label.replace(' ', '_')}"] = r[key] / ref[key]
      line += (f" {r[key]:{width}.3f} {r[prefix + '_tflops']:8.1f} {r[prefix + '_ratio']:6.2f} "
               + " ".join(_ratio(r[key], None if ref is None else ref[key])
                          for ref in refs.values()))
    line += f" {r['bwd_ms']:7.3f} {r['bwd_tflops']:8.1f} {100 * r['bwd_peak_share']:6.1f}"
    print(line)
  return {"shape": dataclasses.asdict(shape), "flops_fwd": flops, "rows": rows, "best": best}


# (shape, query scale, changes to the head dim's `default_block_sizes`; {} is the default; the
# key "traced_positions" is `pope_pallas`' argument, not a block size). At query scale 8
# PoPE's magnitude bound fails on every tile (`bounded_softmax`'s miss case); "tiles" scales
# every other query tile by `_tile_scale`'s factor (half the items bounded).
VARIANTS = [
    ("bench_h128", 1.0, [{}, {"dkv_roles": False}]),
    ("bench_h64", 1.0, [{}, {"dkv_roles": True}]),
]


def variants(iters: int) -> list[dict]:
  out = []
  for name, q_scale, changes in VARIANTS:
    shape = SHAPES[name]
    q, *rest = random_inputs(shape)
    rows = kernel.forward_tile_rows(default_block_sizes(shape.head_dim), shape.head_dim,
                                    shape.value_dim, q.dtype)
    scale = (tile_scale(q.shape[1], rows) if q_scale == "tiles"
             else jnp.asarray(q_scale, q.dtype))
    args = (q * scale, *rest)
    default_out = np.asarray(jax.jit(pope_pallas)(*args), np.float32)
    default_grads = [np.asarray(g, np.float32) for g in fwd_bwd(pope_pallas)(*args)]
    for change in changes:
      change = dict(change)
      traced = change.pop("traced_positions", False)
      blocks = dataclasses.replace(default_block_sizes(shape.head_dim), **change)
      fn = functools.partial(pope_pallas, blocks=blocks, traced_positions=traced)
      label = f"{name} q×{q_scale} {blocks}" + (" traced positions" if traced else "")
      row = _measure(label, fn, args, shape.forward_flops(), iters)
      if "error" not in row:  # The same results as the default schedule, up to bf16 rounding.
        got = np.asarray(jax.jit(fn)(*args), np.float32)
        row["fwd_max_diff_vs_default"] = float(np.abs(got - default_out).max())
        grads = [np.asarray(g, np.float32) for g in fwd_bwd(fn)(*args)]
        row["grad_max_rel_diff_vs_default"] = max(  # over dq, dk, dv, dδ
            float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(grads, default_grads))
      print("variant", row, flush=True)
      out.append(row)
  return out


def main():
  global MIN_WINDOW_MS
  parser = common.make_parser("bench_attention", __doc__)
  parser.add_argument("--out", default="bench_attention.json", help="JSON results file")
  parser.add_argument("--iters", type=common.positive_int, default=20,
                      help="least timed calls per window (`_time_ms`)")
  parser.add_argument("--min-window-ms", type=common.nonnegative_float, default=MIN_WINDOW_MS,
                      help="least length of a timing window (`_time_ms`); 0: --iters calls")
  parser.add_argument("--shapes", default="bench_h64,bench_h128",
                      help="main tables' shapes of pallas_kernels.shapes, comma-separated")
  parser.add_argument("--dtypes", default="bfloat16",
                      help="main tables' input dtypes, comma-separated (bfloat16, float16)")
  parser.add_argument("--rows", default=",".join(ROWS),
                      help=f"main tables' rows, comma-separated, of: {', '.join(ROWS)}")
  parser.add_argument("--tokamax-autotune", action="store_true",
                      help="main tables also time tokamax after tokamax.autotune (slow)")
  parser.add_argument("--variants", action="store_true", help="time block-size variants")
  parser.add_argument("--train-step", action="store_true", help="GPT-2-124M PoPE/RoPE step")
  parser.add_argument("--train-batch", type=common.positive_int, default=16,
                      help="--train-step batch size")
  parser.add_argument("--logits-dtype", default="float32", choices=("float32", "compute"),
                      help="--train-step: ModelConfig.logits_dtype")
  parser.add_argument("--train-breakdown", action="store_true",
                      help="--train-step also times forward, backward, optimizer, head + loss")
  parser.add_argument("--profile", action="store_true",
                      help="device time per op of the attention paths and the train steps")
  parser.add_argument("--power", action="store_true",
                      help="SM clock, power and time per call, burst and sustained (nvidia-smi): "
                      "ours and RoPE on cuDNN in bf16 at each of --shapes")
  parser.add_argument("--skip-bench", action="store_true",
                      help="skip the main tables (e.g. with --variants)")
  args = parser.parse_args()
  MIN_WINDOW_MS = args.min_window_ms
  supported = [d.name for d in kernel.SUPPORTED_DTYPES]

  def dtype_list(flag, value):
    names = [d.strip() for d in value.split(",") if d.strip()]
    if not names or any(d not in supported for d in names):
      parser.error(f"{flag} {value!r}: give some of {supported}")
    return names

  bench_dtypes = dtype_list("--dtypes", args.dtypes)
  rows_wanted = [n.strip() for n in args.rows.split(",") if n.strip()]
  if not rows_wanted or (unknown := [n for n in rows_wanted if n not in ROWS]):
    parser.error(f"--rows {args.rows!r}: give some of {list(ROWS)}")
  bench_shapes = [n.strip() for n in args.shapes.split(",") if n.strip()]
  if not bench_shapes or (unknown := [n for n in bench_shapes if n not in SHAPES]):
    parser.error(f"--shapes {args.shapes!r}: give some of {sorted(SHAPES)}")
  if reason := kernel.platform_reason():
    parser.error(f"needs an NVIDIA Hopper GPU: {reason}")
  power_limit_w = None
  if args.power:
    try:  # nvidia-smi answers before any work starts
      power_limit_w = _gpu_power.power_limit_w()
    except RuntimeError as e:
      parser.error(str(e))
  try:
    import tokamax  # noqa: F401
    with_tokamax = True
  except ImportError as e:
    print(f"tokamax not importable ({e}); its row is left out")
    with_tokamax = False
  results = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
             "date": time.strftime("%Y-%m-%d %H:%M:%S"), "iters": args.iters,
             "min_window_ms": args.min_window_ms}
  print(results, flush=True)
  if not args.skip_bench:
    # Keys: the shape's name, followed by the dtype for dtypes other than bfloat16.
    results["bench"] = {n if d == "bfloat16" else f"{n} {d}":
                        bench_head_dim(n, args.iters, with_tokamax, d,
                                       tokamax_autotune=args.tokamax_autotune,
                                       rows_wanted=rows_wanted)
                        for d in bench_dtypes for n in bench_shapes}
  if args.variants:
    results["variants"] = variants(args.iters)
  if args.profile:
    results["profile"] = {n: _attention_profile.profile_attention(n, with_tokamax)
                          for n in ("bench_h64", "bench_h128")}
  if args.power:
    results["power"] = {"power_limit_w": power_limit_w,
                        **{n: _attention_power.power_attention(n) for n in bench_shapes}}
  if args.train_step:
    results["train_step"] = _train_step.train_step_ratio(
        functools.partial(_time_ms, iters=args.iters), args.train_batch,
        breakdown=args.train_breakdown, profile=args.profile, logits_dtype=args.logits_dtype)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  main()
