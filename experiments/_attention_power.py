"""Our kernel and RoPE on cuDNN run back to back from an idle GPU: burst and sustained time per
call, SM clock and board power (a helper, no CLI; `experiments.bench_attention --power`)."""

from __future__ import annotations

import traceback

import jax

from experiments import _attention_paths as paths_lib, _gpu_power
from pallas_kernels.shapes import SHAPES, random_inputs


def power_attention(shape_name: str, seconds: float = 4.0) -> dict:
  """Our kernel and RoPE on cuDNN, forward and forward+backward, each run back to back from an
  idle GPU (`_gpu_power.sustained_run`): burst and sustained ms per call, SM clock and board
  power. Ratios ours / RoPE, burst and sustained, per mode."""
  args = random_inputs(SHAPES[shape_name])
  out = {}
  for mode, wrap in (("fwd", jax.jit), ("fwd+bwd", paths_lib.fwd_bwd)):
    for name, fn in ((paths_lib.OURS, paths_lib.pope_pallas),
                     (paths_lib.ROPE, paths_lib.rope_cudnn)):
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
    ours, rope = out[f"{paths_lib.OURS} {mode}"], out[f"{paths_lib.ROPE} {mode}"]
    if "error" in ours or "error" in rope:
      continue
    out[f"ours / RoPE {mode}"] = {k: ours[k] / rope[k] for k in ("burst_ms", "sustained_ms")}
    print(f"{shape_name} ours / RoPE {mode}: burst {ours['burst_ms'] / rope['burst_ms']:.3f}x, "
          f"sustained {ours['sustained_ms'] / rope['sustained_ms']:.3f}x", flush=True)
  return out
