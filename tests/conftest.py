"""Test set-up: the repository root on sys.path, float32 matmuls at full precision on CPU, and
XLA:CPU's concurrency-optimised scheduler off: with it, the Mosaic GPU interpreter can start one
warpgroup's blocking barrier waits before the others on a 2-core machine and hang (see
pallas_kernels/pope_attention_fwd.py)."""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()

import jax  # noqa: E402  (after XLA_FLAGS)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
jax.config.update("jax_default_matmul_precision", "highest")
