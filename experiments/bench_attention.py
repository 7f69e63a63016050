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
      [--check [--check-dtypes bfloat16,float16] [--check-shapes A,B]]
      [--train-step [--train-batch N] [--logits-dtype compute] [--train-breakdown]]

--dtypes: the main tables' input dtypes (default bfloat16, the speed target's).
--check compares the kernel's output and gradients with the float32 XLA reference on small
shapes (the check_* shapes of `pallas_kernels.shapes`, or those of --check-shapes), in each
dtype of --check-dtypes (default bfloat16), and exits 1 (after writing the JSON) if any is off
by more than --check-tol.
--power runs our kernel and RoPE on cuDNN (bf16, at each of --shapes) back to back for a few
seconds each from an idle GPU (`experiments._gpu_power`) and gives the time per call of the first
window (burst) and of the sustained windows, the SM clock and the board power from nvidia-smi:
under sustained load the GPU lowers its clock at its power limit.
--profile adds device time per op (`experiments._profiling`) of the forward and forward+backward
of the PoPE paths and of RoPE on cuDNN at head dims 64 and 128 and, with --train-step, of both
train steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import pope_attention as kernel
from pallas_kernels.pope_attention_config import BlockSizes, default_block_sizes
from pallas_kernels.shapes import CHECK_TOLERANCES, SHAPES, random_inputs
from experiments import _gpu_power, _profiling, _timing, common
from pope_jax import attention, encodings, positions

PEAK_TFLOPS = 790.0  # measured bf16 dense matmul peak on the H200 (issue text)
SPEC_PEAK_TFLOPS = 989.4  # H200 SXM datasheet bf16 dense peak: the usual MFU denominator


TIMING_WINDOWS = 5
MIN_WINDOW_MS = 100.0  # each window runs at least this long, so its one sync is amortised


def _time_ms(fn, *args, iters: int, min_window_ms: float | None = None) -> float:
  """`_timing.wall_ms` over `TIMING_WINDOWS` windows; `min_window_ms` None: the module's
  MIN_WINDOW_MS (--min-window-ms)."""
  return _timing.wall_ms(fn, *args, iters=iters, windows=TIMING_WINDOWS,
                         min_window_ms=MIN_WINDOW_MS if min_window_ms is None else min_window_ms)


def _concat_cartesian(x, positions, base, phase=None):
  """The issue's expansion: softplus, then [μ cos φ, μ sin φ] joined by a concatenation (XLA
  writes μ in float32 before the concatenation; `encodings.pope_cartesian` is one pass)."""
  ang = encodings.angles(positions, encodings.pope_frequencies(x.shape[-1], base))
  ang = ang if phase is None else ang + phase
  mag = encodings.pope_magnitudes(x)
  return jnp.concatenate([mag * jnp.cos(ang), mag * jnp.sin(ang)], axis=-1)


def _expand(q, k, delta, base=10000.0, cartesian=encodings.pope_cartesian):
  """Cartesian PoPE q', k' (δ on the query side, as the reference), 2H wide, input dtype."""
  t_len, s_len = q.shape[1], k.shape[1]
  q_pos, k_pos = positions.default_positions(t_len, s_len)
  qe = cartesian(q, q_pos, base=base, phase=-encodings.clamp_phase_bias(delta))
  ke = cartesian(k, k_pos, base=base)
  return qe.astype(q.dtype), ke.astype(k.dtype)


def _pope_cudnn(q, k, v, delta, cartesian=encodings.pope_cartesian):
  h = q.shape[-1]
  qe, ke = _expand(q, k, delta, cartesian=cartesian)
  vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 2 * h - v.shape[-1])))
  out = jax.nn.dot_product_attention(qe, ke, vp, scale=1 / math.sqrt(h), is_causal=True,
                                     implementation="cudnn")
  return out[..., :v.shape[-1]]


def _pope_tokamax(q, k, v, delta, cartesian=encodings.pope_cartesian):
  import tokamax  # Only on machines where it is installed.
  qe, ke = _expand(q, k, delta, cartesian=cartesian)
  return tokamax.dot_product_attention(qe, ke, v, scale=1 / math.sqrt(q.shape[-1]),
                                       is_causal=True, implementation="mosaic")


BASELINES = {  # name: (function, needs tokamax); every row's /best is to the fastest of these.
    "expand + cuDNN": (_pope_cudnn, False),
    "expand + tokamax mosaic": (_pope_tokamax, True),
    "concat expand + cuDNN": (functools.partial(_pope_cudnn, cartesian=_concat_cartesian), False),
    "concat expand + tokamax": (functools.partial(_pope_tokamax, cartesian=_concat_cartesian),
                                True),
}


def _pope_xla(q, k, v, delta):
  return attention.pope_attention(q, k, v, delta, is_causal=True, implementation="xla")


def _kernel(q, k, v, delta, *, q_positions=None, k_positions=None, **kw):
  """The kernel entry point as `attention.pope_attention(implementation="pallas")` calls it
  (positions defaulted, θ, the clamped δ), with the kernel's own keywords (`block_sizes`)."""
  q_pos, k_pos, _ = positions.resolve(q.shape[0], q.shape[1], k.shape[1], q_positions,
                                      k_positions, None, keep_numpy=True)
  with jax.ensure_compile_time_eval():
    freqs = encodings.pope_frequencies(q.shape[-1])
  return kernel.pope_attention(
      q, k, v, encodings.clamp_phase_bias(delta.astype(jnp.float32)), frequencies=freqs,
      q_positions=q_pos, k_positions=k_pos, cartesian_map=encodings.polar_to_cartesian, **kw)


def _pope_pallas(q, k, v, delta, blocks: BlockSizes | None = None,
                 traced_positions: bool = False):
  """Our kernel; `traced_positions` passes the default positions as arrays traced with the call
  (as `jnp.arange` under jit gives), so the kernels' position tables run in every call instead
  of at trace time."""
  if traced_positions:  # jnp.asarray inside jit traces them
    q_pos, k_pos = map(jnp.asarray, positions.default_positions(q.shape[1], k.shape[1]))
    return _kernel(q, k, v, delta, is_causal=True, block_sizes=blocks,
                                 q_positions=q_pos, k_positions=k_pos)
  if blocks is None:
    return attention.pope_attention(q, k, v, delta, is_causal=True, implementation="pallas")
  return _kernel(q, k, v, delta, is_causal=True, block_sizes=blocks)


def _rope_cudnn(q, k, v, delta):
  del delta
  t_len, s_len = q.shape[1], k.shape[1]
  q_pos, k_pos = positions.default_positions(t_len, s_len)
  qr = encodings.apply_rope(q, q_pos)
  kr = encodings.apply_rope(k, k_pos)
  return jax.nn.dot_product_attention(qr, kr, v, is_causal=True, implementation="cudnn")


@functools.cache  # One jitted gradient per function: a second call reuses its compilation.
def _fwd_bwd(fn):
  def loss(q, k, v, delta):
    return fn(q, k, v, delta).astype(jnp.float32).sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _measure(name, fn, args, flops, iters, contexts=(None, None)):
  """Times fn's forward and forward+backward, each inside its context of `contexts` (None:
  none); a failure becomes the row's "error"."""
  row = {"name": name}
  try:
    with contexts[0] or contextlib.nullcontext():
      row["fwd_ms"] = _time_ms(jax.jit(fn), *args, iters=iters)
    with contexts[1] or contextlib.nullcontext():
      row["fwd_bwd_ms"] = _time_ms(_fwd_bwd(fn), *args, iters=iters)
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


TOKAMAX = "expand + tokamax mosaic"
TOKAMAX_AUTOTUNED = "expand + tokamax (autotuned)"


def _measure_autotuned(args, flops, iters) -> dict:
  """The tokamax baseline after `tokamax.autotune` of its jitted forward and of its
  forward+backward on `args`, each timed under its result (an overlay of tokamax's cache)."""
  import tokamax  # Only on machines where it is installed.
  fn = functools.partial(BASELINES[TOKAMAX][0])  # its own jitted forms, traced under the result
  try:
    tuned = (tokamax.autotune(jax.jit(fn), *args), tokamax.autotune(_fwd_bwd(fn), *args))
  except Exception as e:  # A failing row is reported in the table, never hidden.
    traceback.print_exc()
    return {"name": TOKAMAX_AUTOTUNED, "error": f"{type(e).__name__}: {str(e)[:300]}"}
  return _measure(TOKAMAX_AUTOTUNED, fn, args, flops, iters, contexts=tuned)


def _ratio(ms: float, ref_ms: float | None) -> str:
  return f"{'-':>6s}" if ref_ms is None else f"{ms / ref_ms:6.2f}"


def _fused_paths(head_dim: int) -> dict:
  """Our kernel with its default blocks and with `bounded_softmax`, by table row name."""
  bounded = dataclasses.replace(default_block_sizes(head_dim), bounded_softmax=True)
  return {"fused PoPE (ours)": _pope_pallas,
          "fused PoPE (bounded_softmax)": functools.partial(_pope_pallas, blocks=bounded)}


ROWS = ("xla reference", *BASELINES, TOKAMAX_AUTOTUNED, "fused PoPE (ours)",
        "fused PoPE (bounded_softmax)", "RoPE cuDNN (scale)")


def bench_head_dim(shape_name: str, iters: int, with_tokamax: bool, dtype=jnp.bfloat16,
                   tokamax_autotune: bool = False, rows_wanted=ROWS) -> dict:
  """The main table of one shape: the fwd and fwd+bwd ms, TFLOP/s and ratios to the fastest
  baseline (/best), to untuned tokamax (/tk) and to autotuned tokamax (/tk at, with
  `tokamax_autotune`) of each row of `rows_wanted` (names in ROWS)."""
  shape = SHAPES[shape_name]
  args = random_inputs(shape, jnp.dtype(dtype))
  flops = shape.forward_flops()
  paths = {"xla reference": _pope_xla,
           **{name: fn for name, (fn, tk) in BASELINES.items() if with_tokamax or not tk},
           **_fused_paths(shape.head_dim), "RoPE cuDNN (scale)": _rope_cudnn}
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


def _tile_scale(t_len: int, rows: int, factor: float = 5.0) -> jax.Array:
  """[1, T, 1, 1] bf16: `factor` on every other block of `rows` query rows (the forward's query
  tile, `pope_attention.forward_tile_rows`), else 1. At N(0, 1) inputs the unscaled tiles'
  magnitude bound holds and the scaled ones' fails, so a check with `bounded_softmax` mixes
  bounded and online-softmax items in one CTA."""
  scale = jnp.where(jnp.arange(t_len) // rows % 2 == 1, factor, 1.0)
  return scale.astype(jnp.bfloat16)[None, :, None, None]


def check(names, changes=({},), dtypes=(jnp.bfloat16,)) -> list[dict]:
  """Fused kernel vs the XLA reference on the GPU: max |error| of the output and every grad.

  Each entry of `changes` (BlockSizes fields) is applied to the shape's default block sizes and
  checked as its own row, for each input dtype of `dtypes` (rows other than bfloat16 name their
  dtype; `bounded_softmax` is bfloat16 only, so under float16 it runs the online softmax); {} is
  the default path of `pope_attention(implementation="pallas")`. The queries of shapes with
  `input_scale` 1 are scaled by `_tile_scale`.
  """
  results = []
  for name, change, dtype in itertools.product(names, changes, dtypes):
    shape = SHAPES[name]
    q, k, v, delta = random_inputs(shape, jnp.dtype(dtype), seed=1)
    rows = kernel.forward_tile_rows(default_block_sizes(shape.head_dim), shape.head_dim,
                                    shape.value_dim, q.dtype)
    if shape.input_scale == 1.0:
      q = q * _tile_scale(q.shape[1], rows).astype(q.dtype)
    cot = jax.random.normal(jax.random.key(2), q.shape[:3] + (shape.value_dim,), jnp.float32)

    def run(impl):
      def loss(q, k, v, delta):
        if impl == "pallas" and change:  # Invalid changes raise here: an error row.
          blocks = dataclasses.replace(default_block_sizes(shape.head_dim), **change)
          out = _kernel(q, k, v, delta, is_causal=shape.is_causal,
                                      block_sizes=blocks)
        else:
          out = attention.pope_attention(q, k, v, delta, is_causal=shape.is_causal,
                                         implementation=impl)
        return (out.astype(jnp.float32) * cot).sum(), out
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, delta)

    dtype_name = jnp.dtype(dtype).name
    row = {"name": " ".join([name] + ([str(change)] if change else [])
                            + ([dtype_name] if dtype_name != "bfloat16" else [])),
           "dtype": dtype_name, "shape": name}
    try:
      (_, out), grads = run("pallas")
      (_, ref), ref_grads = run("xla")
      for key, x, y in zip(("out", "dq", "dk", "dv", "ddelta"), (out, *grads), (ref, *ref_grads)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        row[key] = float(np.abs(x - y).max() / (np.abs(y).max() + 1e-6))
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
      traceback.print_exc()
    print("check", row, flush=True)
    results.append(row)
  return results


def check_failures(rows: list[dict], tol: float) -> list[str]:
  """Names of the `check` rows that errored or whose output or a gradient is off by more than
  `tol` (max |error| / max |reference|; a shape's `CHECK_TOLERANCES` where larger) or not a
  number."""
  keys = ("out", "dq", "dk", "dv", "ddelta")
  return [row["name"] for row in rows
          if "error" in row or not all(
              row[k] <= max(tol, CHECK_TOLERANCES.get(row.get("shape"), 0.0)) for k in keys)]


# (shape, query scale, changes to the head dim's `default_block_sizes`; {} is the default; the
# key "traced_positions" is `_pope_pallas`' argument, not a block size). At query scale 8
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
    scale = (_tile_scale(q.shape[1], rows) if q_scale == "tiles"
             else jnp.asarray(q_scale, q.dtype))
    args = (q * scale, *rest)
    default_out = np.asarray(jax.jit(_pope_pallas)(*args), np.float32)
    default_grads = [np.asarray(g, np.float32) for g in _fwd_bwd(_pope_pallas)(*args)]
    for change in changes:
      change = dict(change)
      traced = change.pop("traced_positions", False)
      blocks = dataclasses.replace(default_block_sizes(shape.head_dim), **change)
      fn = functools.partial(_pope_pallas, blocks=blocks, traced_positions=traced)
      label = f"{name} q×{q_scale} {blocks}" + (" traced positions" if traced else "")
      row = _measure(label, fn, args, shape.forward_flops(), iters)
      if "error" not in row:  # The same results as the default schedule, up to bf16 rounding.
        got = np.asarray(jax.jit(fn)(*args), np.float32)
        row["fwd_max_diff_vs_default"] = float(np.abs(got - default_out).max())
        grads = [np.asarray(g, np.float32) for g in _fwd_bwd(fn)(*args)]
        row["grad_max_rel_diff_vs_default"] = max(  # over dq, dk, dv, dδ
            float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(grads, default_grads))
      print("variant", row, flush=True)
      out.append(row)
  return out


def profile_attention(shape_name: str, with_tokamax: bool) -> dict:
  """Device time per op of forward and forward+backward: our kernel, the expansion baselines and
  RoPE on cuDNN (plain attention at the same head dim)."""
  args = random_inputs(SHAPES[shape_name])
  paths = _fused_paths(SHAPES[shape_name].head_dim)
  paths.update((name, fn) for name, (fn, tk) in BASELINES.items()
               if not name.startswith("concat") and (with_tokamax or not tk))
  paths["RoPE cuDNN (scale)"] = _rope_cudnn
  out = {}
  for name, fn in paths.items():
    for mode, jitted in (("fwd", jax.jit(fn)), ("fwd+bwd", _fwd_bwd(fn))):
      title = f"{shape_name} {name} {mode}"
      try:
        rows = _profiling.op_times(jitted, *args)
        out[title] = {"summary": _profiling.summarize(rows, title), "ops": rows[:40]}
      except Exception as e:  # Reported, never hidden.
        out[title] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        traceback.print_exc()
  return out


def power_attention(shape_name: str, seconds: float = 4.0) -> dict:
  """Our kernel and RoPE on cuDNN, forward and forward+backward, each run back to back from an
  idle GPU (`_gpu_power.sustained_run`): burst and sustained ms per call, SM clock and board
  power. Ratios ours / RoPE, burst and sustained, per mode."""
  args = random_inputs(SHAPES[shape_name])
  out = {}
  for mode, wrap in (("fwd", jax.jit), ("fwd+bwd", _fwd_bwd)):
    for name, fn in (("fused PoPE (ours)", _pope_pallas), ("RoPE cuDNN (scale)", _rope_cudnn)):
      try:
        r = out[f"{name} {mode}"] = _gpu_power.sustained_run(wrap(fn), *args, seconds=seconds)
      except Exception as e:  # Reported, never hidden.
        out[f"{name} {mode}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        traceback.print_exc()
        continue
      print(f"{shape_name} {name:20s} {mode:8s} burst {r['burst_ms']:.3f} ms, sustained "
            f"{r['sustained_ms']:.3f} ms; SM clock median {r['sm_mhz_median']:.0f} MHz (min "
            f"{r['sm_mhz_min']:.0f}); power median {r['power_w_median']:.0f} W (max "
            f"{r['power_w_max']:.0f}); power-capped in {r['power_capped_share']:.0%} of samples",
            flush=True)
    ours, rope = out[f"fused PoPE (ours) {mode}"], out[f"RoPE cuDNN (scale) {mode}"]
    if "error" in ours or "error" in rope:
      continue
    out[f"ours / RoPE {mode}"] = {k: ours[k] / rope[k] for k in ("burst_ms", "sustained_ms")}
    print(f"{shape_name} ours / RoPE {mode}: burst {ours['burst_ms'] / rope['burst_ms']:.3f}x, "
          f"sustained {ours['sustained_ms'] / rope['sustained_ms']:.3f}x", flush=True)
  return out


def train_step_ratio(iters: int, batch: int, *, preset: str = "gpt2_124m", seq_len: int = 1024,
                     breakdown: bool = False, profile: bool = False,
                     logits_dtype: str = "float32") -> dict:
  """Train step of a model preset (default GPT-2-124M; value_and_grad + AdamW), [batch, seq_len]
  tokens, bf16 (logits in `logits_dtype`, see `ModelConfig`): PoPE vs RoPE.

  MFU counts 6·params·tokens plus causal attention (12·L·B·T²·d_model / 2: only the unmasked
  half) against the datasheet peak (SPEC_PEAK_TFLOPS); "mfu_palm" uses the PaLM convention
  (Chowdhery et al. 2022, App. B; nanoGPT's `estimate_mfu`): 6·params + 12·L·d_model·T per
  token, the full attention matrix. Both count RoPE's attention width for PoPE too (PoPE's q'k'
  are 2H wide), so the MFU ratio is the inverse time ratio. "mfu_of_measured_peak" uses the
  measured matmul peak instead of the datasheet's. With
  `breakdown`, also times the forward loss alone ("loss_ms"), the forward and backward
  ("grad_ms"; the optimizer is step - grad) and, once, the tied head and cross-entropy alone,
  forward and backward, on random final hidden states ("head_and_loss_ms").
  """
  import optax
  from pope_jax import config as config_lib
  from pope_jax.model import Transformer
  result = {}
  base = config_lib.MODEL_PRESETS[preset]
  for enc in ("rope", "pope"):
    cfg = dataclasses.replace(base, pos_encoding=enc, dtype="bfloat16", logits_dtype=logits_dtype)
    model = Transformer(cfg)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, cfg.vocab_size)
    params = model.init(jax.random.key(1), tokens[:, :-1])["params"]
    opt = optax.adamw(1e-4)
    opt_state = opt.init(params)

    def loss_fn(p, tokens):
      return _next_token_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    @jax.jit
    def step(p, s, tokens):
      loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
      updates, s = opt.update(grads, s, p)
      return optax.apply_updates(p, updates), s, loss

    ms = _time_ms(step, params, opt_state, tokens, iters=iters)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    attention_flops = 12 * cfg.num_layers * batch * seq_len**2 * cfg.d_model
    flops = 6 * n_params * batch * seq_len + attention_flops / 2
    flops_palm = 6 * n_params * batch * seq_len + attention_flops
    result[enc] = {"ms": ms, "mfu": flops / (ms * 1e-3) / (SPEC_PEAK_TFLOPS * 1e12),
                   "mfu_palm": flops_palm / (ms * 1e-3) / (SPEC_PEAK_TFLOPS * 1e12),
                   "mfu_of_measured_peak": flops / (ms * 1e-3) / (PEAK_TFLOPS * 1e12),
                   "batch": batch,
                   "tokens_per_second": batch * seq_len / (ms * 1e-3)}
    result[enc]["logits_dtype"] = logits_dtype
    print(f"train step {preset} {enc} batch {batch} logits {logits_dtype}: {ms:.2f} ms, MFU "
          f"{result[enc]['mfu']:.3f} (PaLM convention {result[enc]['mfu_palm']:.3f}) of "
          f"{SPEC_PEAK_TFLOPS} TFLOP/s", flush=True)
    if breakdown:
      result[enc]["loss_ms"] = _time_ms(jax.jit(loss_fn), params, tokens, iters=iters)
      result[enc]["grad_ms"] = _time_ms(jax.jit(jax.value_and_grad(loss_fn)), params, tokens,
                                        iters=iters)
      print(f"  {enc}: forward loss {result[enc]['loss_ms']:.2f} ms, forward+backward "
            f"{result[enc]['grad_ms']:.2f} ms, optimizer {ms - result[enc]['grad_ms']:.2f} ms",
            flush=True)
    if profile:
      rows = _profiling.op_times(step, params, opt_state, tokens, iters=3)
      result[enc]["profile"] = {
          "summary": _profiling.summarize(rows, f"{preset} {enc} train step, batch {batch}",
                                           top=25),
          "ops": rows[:60]}
  result["pope_over_rope"] = result["pope"]["ms"] / result["rope"]["ms"]
  print(f"PoPE/RoPE train-step time ratio: {result['pope_over_rope']:.3f}")
  if breakdown:
    result["head_and_loss_ms"] = _head_and_loss_ms(base, batch, seq_len, iters, logits_dtype)
    print(f"tied head + cross-entropy alone, forward+backward: {result['head_and_loss_ms']:.2f} ms")
  return result


def _next_token_loss(logits, labels):
  """Mean cross-entropy (the training loop's) of logits [B, T, V] against int labels [B, T]."""
  from pope_jax.train import cross_entropy_with_integer_labels
  return cross_entropy_with_integer_labels(logits, labels).mean()


def _head_and_loss_ms(cfg, batch: int, seq_len: int, iters: int,
                      logits_dtype: str = "float32") -> float:
  """Forward+backward time of the model's tied head (`nn.Embed.attend` in bf16, logits then
  cast to float32 unless `logits_dtype` is "compute", as the model does) and the training
  loop's cross-entropy, on random final hidden states [batch, seq_len, d_model], isolated."""
  from flax import linen as nn
  keys = jax.random.split(jax.random.key(3), 3)
  head = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.bfloat16)
  hidden = jax.random.normal(keys[0], (batch, seq_len, cfg.d_model), jnp.bfloat16)
  params = head.init(keys[1], jnp.zeros((1,), jnp.int32))
  labels = jax.random.randint(keys[2], (batch, seq_len), 0, cfg.vocab_size)

  def loss(hidden, params):
    logits = head.apply(params, hidden, method=nn.Embed.attend)
    return _next_token_loss(logits if logits_dtype == "compute" else logits.astype(jnp.float32),
                            labels)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  return _time_ms(grad, hidden, params, iters=iters)


def main():
  global MIN_WINDOW_MS
  parser = common.make_parser("bench_attention", __doc__)
  parser.add_argument("--out", default="bench_attention.json", help="JSON results file")
  parser.add_argument("--iters", type=common.positive_int, default=20,
                      help="least timed calls per window (`_time_ms`)")
  parser.add_argument("--min-window-ms", type=common.nonnegative_float, default=MIN_WINDOW_MS,
                      help="least length of a timing window (`_time_ms`); 0: --iters calls")
  parser.add_argument("--check", action="store_true", help="kernel vs reference first")
  parser.add_argument("--check-tol", type=common.positive_float, default=2e-2,
                      help="--check fails (exit 1) above this max |error| / max |reference|")
  parser.add_argument("--check-blocks", action="append", default=[], metavar="JSON",
                      help='--check also runs these BlockSizes changes, e.g. '
                           '\'{"overlap_bwd": true, "row_sum_mma": false}\'')
  parser.add_argument("--check-dtypes", default="bfloat16",
                      help="--check input dtypes, comma-separated (bfloat16, float16)")
  parser.add_argument("--check-shapes", default="",
                      help="--check only these shapes of pallas_kernels.shapes, comma-separated; "
                           "empty: every check_* shape")
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
  parser.add_argument("--train-batch", type=common.positive_int, default=16, help="--train-step batch size")
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
                      help="skip the main tables (e.g. with --check or --variants)")
  args = parser.parse_args()
  MIN_WINDOW_MS = args.min_window_ms
  supported = [d.name for d in kernel.SUPPORTED_DTYPES]

  def dtype_list(flag, value):
    names = [d.strip() for d in value.split(",") if d.strip()]
    if not names or any(d not in supported for d in names):
      parser.error(f"{flag} {value!r}: give some of {supported}")
    return names

  dtypes = dtype_list("--check-dtypes", args.check_dtypes)
  check_shapes = [n.strip() for n in args.check_shapes.split(",") if n.strip()] or [
      n for n in SHAPES if n.startswith("check")]
  if unknown := [n for n in check_shapes if n not in SHAPES]:
    parser.error(f"--check-shapes: unknown {unknown}; known: {sorted(SHAPES)}")
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
  if args.check:
    changes = [{}] + [json.loads(c) for c in args.check_blocks]
    results["check"] = check(check_shapes, changes, dtypes)
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
    results["profile"] = {n: profile_attention(n, with_tokamax)
                          for n in ("bench_h64", "bench_h128")}
  if args.power:
    results["power"] = {"power_limit_w": power_limit_w,
                        **{n: power_attention(n) for n in bench_shapes}}
  if args.train_step:
    results["train_step"] = train_step_ratio(args.iters, args.train_batch,
                                             breakdown=args.train_breakdown, profile=args.profile,
                                             logits_dtype=args.logits_dtype)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1, default=str)
  if failed := check_failures(results.get("check", []), args.check_tol):
    sys.exit(f"check failed (tolerance {args.check_tol}): {', '.join(failed)}")


if __name__ == "__main__":
  main()
