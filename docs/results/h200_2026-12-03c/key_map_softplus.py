"""Run 24 E: the key map's XLA pass (`pope_attention.key_map`) with the softplus of 43b819a
(max(x, 0) + log(1 + exp(-|x|))) against the tree's `_streaming.softplus` (with
softplus_polynomial.diff applied: log1p as a polynomial), at the benchmark's key shapes; wall
clock per call, the median of five windows of at least 100 ms, the two in turn three times.
With --device-time (added after E ran), the device time per call instead
(`experiments.profile_ops`, 20 profiled calls): a 0.03 ms kernel's wall clock includes the
host's share of each call.

  PYTHONPATH=. python3 docs/results/h200_2026-12-03c/key_map_softplus.py [--device-time]
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import profile_ops
from pallas_kernels import _streaming as st
from pallas_kernels import pope_attention as kernel

SOFTPLUS = {
    "log (43b819a)": lambda x: (jnp.maximum(x.astype(jnp.float32), 0.0)
                                + jnp.log(1.0 + jnp.exp(-jnp.abs(x.astype(jnp.float32))))),
    "polynomial": st.softplus,
}


def per_call_ms(fn, args, windows=5, min_ms=100.0):
  jax.block_until_ready(fn(*args))
  calls, times = 10, []
  while True:
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    if (time.perf_counter() - start) * 1e3 >= min_ms:
      break
    calls *= 2
  for _ in range(windows):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e3)
  return float(np.median(times))


def main():
  for h in (64, 128):
    k = jax.random.normal(jax.random.key(0), (4, 4096, 16, h), jnp.bfloat16)
    trig = kernel.key_table(jnp.arange(4096), 1.0 / 10000.0 ** (jnp.arange(h) / h))
    fns = {}
    for name, softplus in SOFTPLUS.items():
      st_softplus, st.softplus = st.softplus, softplus
      try:
        fns[name] = jax.jit(kernel.key_map).lower(k, trig).compile()
      finally:
        st.softplus = st_softplus
    ref = np.asarray(fns["log (43b819a)"](k, trig), np.float32)
    new = np.asarray(fns["polynomial"](k, trig), np.float32)
    print(f"H={h} max |difference| {np.abs(ref - new).max():.3e} (max |b| {np.abs(ref).max():.3f})")
    for r in range(3):
      for name, fn in fns.items():
        if "--device-time" in sys.argv:
          ms = sum(row["ms"] for row in profile_ops.op_times(fn, k, trig, iters=20))
          print(f"H={h} round {r} {name:14s} {ms:.4f} ms of device time", flush=True)
        else:
          print(f"H={h} round {r} {name:14s} {per_call_ms(fn, (k, trig)):.4f} ms", flush=True)


if __name__ == "__main__":
  main()
