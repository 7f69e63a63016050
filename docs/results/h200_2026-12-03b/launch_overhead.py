"""Run 23 D: where the H64 forward's wall clock exceeds its device time. Per path (ours, the
tokamax baseline, RoPE on cuDNN), with XLA's default command-buffer threshold and with
`xla_gpu_graph_min_graph_size` = 1 (every run of kernels one CUDA graph): the host's time to
enqueue a call (dispatch) and the wall clock per call, the median of five windows of 200 calls.

  PYTHONPATH=. python3 docs/results/h200_2026-12-03b/launch_overhead.py [PATH ...]

PATH: "ours", "tokamax", "rope" (default all three).
"""
import sys
import time

import jax
import numpy as np

from experiments import bench_attention as bench
from pallas_kernels.shapes import SHAPES

PATHS = {"ours": bench._pope_pallas, "tokamax": bench._pope_tokamax, "rope": bench._rope_cudnn}
OPTIONS = {"default": None, "graph_min_size_1": {"xla_gpu_graph_min_graph_size": 1}}


def per_call_ms(fn, args, calls=200, windows=5):
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  dispatch, total = [], []
  for _ in range(windows):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    enqueued = time.perf_counter()
    jax.block_until_ready(out)
    end = time.perf_counter()
    dispatch.append((enqueued - start) / calls * 1e3)
    total.append((end - start) / calls * 1e3)
  return float(np.median(dispatch)), float(np.median(total))


def main():
  args = bench._inputs(SHAPES["bench_h64"])
  print(f"{'path':8s} {'options':18s} {'dispatch ms':>12s} {'wall ms':>9s}")
  for name in sys.argv[1:] or PATHS:
    fn = PATHS[name]
    for label, options in OPTIONS.items():
      try:
        d, t = per_call_ms(jax.jit(fn, compiler_options=options), args)
        print(f"{name:8s} {label:18s} {d:12.4f} {t:9.4f}", flush=True)
      except Exception as e:  # reported, not hidden
        print(f"{name:8s} {label:18s} error {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
  main()
