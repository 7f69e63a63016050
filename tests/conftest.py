"""Test set-up: the repository root on sys.path, float32 matmuls at full precision on CPU, and two
XLA:CPU settings that the Mosaic GPU interpreter needs on a machine with few cores:
- the concurrency-optimised scheduler off: with it, the interpreter can start one warpgroup's
  blocking barrier waits before the others and hang (see pallas_kernels/pope_attention_fwd.py);
- asynchronous dispatch off: the interpreter runs a kernel inside a host callback that itself
  dispatches JAX ops (`thread_map`). With dispatch asynchronous, the test's main thread can
  enqueue the next op (an eager op of an un-jitted backward pass), which waits for the kernel's
  outputs, ahead of the callback's own op, and both wait forever."""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

import jax  # noqa: E402  (after XLA_FLAGS)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_cpu_enable_async_dispatch", False)
