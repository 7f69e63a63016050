#!/usr/bin/env bash
# The GPU calls of run 28 (docs/results/attention_kernel.md): bash run.sh CALL, from the
# repository root on the H200, with tokamax's and grain's wheels in .whl_kernel/ and .whl_ii/.
# Calls A-C ran commit 41a2bdf (D ran main after the patch was reverted): main with exp2_fma.diff applied (`git apply
# docs/results/h200_2026-12-04b/exp2_fma.diff`), whose BlockSizes.exp2_fma_cols is 0 by default
# (B and C thus ran main's kernels).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl_kernel/*.whl .whl_ii/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
bench="python3 -m experiments.bench_attention"
sha1sum pallas_kernels/*.py pope_jax/*.py experiments/bench_attention.py > "$OUT/tree_sha.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
case "$1" in
  A)  # the GPU check of the software exp2 (BlockSizes.exp2_fma_cols), then its share of the
      # columns against the SFU's exp2 on one machine (bench_attention.VARIANTS)
    timeout 150 $bench --check --skip-bench --iters 2 \
      --check-shapes check_h64,check_h128,check_h64_persistent,check_h32_gqa \
      --check-blocks '{"exp2_fma_cols": 32}' --check-blocks '{"exp2_fma_cols": 64}' \
      --out "$OUT/check.json" > "$OUT/check.log" 2>&1
    timeout 400 $bench --skip-bench --variants --iters 10 --out "$OUT/variants.json" \
      > "$OUT/variants.log" 2>&1
    ;;
  B)  # the bf16 main tables, then the GPT-2-124M train step
    timeout 200 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    timeout 250 $bench --skip-bench --train-step --train-batch 16 --iters 10 \
      --out "$OUT/train.json" > "$OUT/train.log" 2>&1
    ;;
  C)  # the fp16 main tables
    timeout 220 $bench --iters 10 --dtypes float16 --out "$OUT/main_fp16.json" \
      > "$OUT/main_fp16.log" 2>&1
    ;;
  D)  # the bf16 main tables again, on another machine (main, 8e67c0a or later: docs only)
    timeout 200 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    ;;
esac
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.txt"
ls -la "$OUT"
