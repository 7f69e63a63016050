"""Wall-clock time per call of a jitted function (a helper, no CLI)."""

from __future__ import annotations

import math
import time

import jax
import numpy as np


def wall_ms(fn, *args, iters: int, windows: int, min_window_ms: float) -> float:
  """Wall-clock ms per call of fn(*args): the median over `windows` windows of back-to-back
  calls each (the mean within a window), after two warm-up calls. A window has at least `iters`
  calls and enough to last `min_window_ms` (0: exactly `iters`): a window pays one dispatch
  latency and one host sync, which longer windows amortise."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  estimate_ms = (time.perf_counter() - start) * 1e3
  calls = max(iters, math.ceil(min_window_ms / max(estimate_ms, 1e-3)))
  per_call = []
  for _ in range(windows):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - start) / calls * 1e3)
  return float(np.median(per_call))
