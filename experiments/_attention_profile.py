"""Device time per op of the PoPE attention paths (a helper, no CLI; `experiments.bench_attention
--profile`)."""

from __future__ import annotations

import traceback

import jax

from experiments import _attention_paths as paths_lib, _profiling
from pallas_kernels.shapes import SHAPES, random_inputs


def profile_attention(shape_name: str, with_tokamax: bool) -> dict:
  """Device time per op of forward and forward+backward: our kernel, the expansion baselines and
  RoPE on cuDNN (plain attention at the same head dim)."""
  args = random_inputs(SHAPES[shape_name])
  paths = paths_lib.fused_paths(SHAPES[shape_name].head_dim)
  paths.update((name, fn) for name, (fn, tk) in paths_lib.BASELINES.items()
               if not name.startswith("concat") and (with_tokamax or not tk))
  paths[paths_lib.ROPE] = paths_lib.rope_cudnn
  out = {}
  for name, fn in paths.items():
    for mode, jitted in (("fwd", jax.jit(fn)), ("fwd+bwd", paths_lib.fwd_bwd(fn))):
      title = f"{shape_name} {name} {mode}"
      try:
        rows = _profiling.op_times(jitted, *args)
        out[title] = {"summary": _profiling.summarize(rows, title), "ops": rows[:40]}
      except Exception as e:  # Reported, never hidden.
        out[title] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        traceback.print_exc()
  return out
