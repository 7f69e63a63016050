"""Device time per op from a profiler trace (on CPU: XLA:CPU thunk times)."""

import jax
import jax.numpy as jnp

from experiments import _profiling as profiling


def test_op_times_finds_the_matmul_of_a_jitted_function():
  fn = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  rows = profiling.op_times(fn, jnp.ones((256, 256), jnp.float32), iters=2)
  assert rows, "the profiler recorded no XLA ops"
  assert all(r["ms"] >= 0 and r["count"] > 0 for r in rows)
  assert rows == sorted(rows, key=lambda r: -r["ms"])
  summary = profiling.summarize(rows, "tanh(x @ x)")
  assert summary["total_ms"] > 0
  assert abs(sum(summary["by_category_ms"].values()) - summary["total_ms"]) < 1e-9


def test_categories():
  assert profiling.category("sm90_xmma_gemm_bf16bf16 dot.3") == "matmul"
  assert profiling.category("cudnn_generated_fort_native_sdpa custom-call") == "attention (cuDNN)"
  assert profiling.category("mosaic_gpu_kernel custom-call.1") == "attention (Pallas)"
  assert profiling.category("flash_attention_sm90_mosaic_gpu_kernel") == "attention (Pallas)"
  assert profiling.category("nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN") == "matmul"
  assert profiling.category("loop_multiply_fusion multiply_fusion") == "elementwise fusion"
  assert profiling.category("input_reduce_fusion reduce.1") == "reduction fusion"
