#!/usr/bin/env bash
# The GPU calls of run 27 (docs/results/attention_kernel.md): bash run.sh CALL, from the
# repository root on the H200, with tokamax's and grain's wheels in .whl_kernel/ and .whl_ii/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl_kernel/*.whl .whl_ii/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
bench="python3 -m experiments.bench_attention"
sha1sum pallas_kernels/*.py pope_jax/*.py experiments/bench_attention.py > "$OUT/tree_sha.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
case "$1" in
  A)  # the fp16 GPU check (rescale_threshold 8 at H = 128 for the first time in fp16; the
      # timeout ended it after seven of the nine shapes), then rescale_threshold 8 against
      # None on one machine (bench_attention.VARIANTS; the timeout ended it after 11 of 12 rows)
    timeout 150 $bench --check --skip-bench --iters 2 --check-dtypes float16 \
      --out "$OUT/check_fp16.json" > "$OUT/check_fp16.log" 2>&1
    timeout 230 $bench --skip-bench --variants --iters 10 --out "$OUT/variants.json" \
      > "$OUT/variants.log" 2>&1
    ;;
  B)  # the bf16 main tables, then the two fp16 check shapes A did not reach
    timeout 170 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    timeout 90 $bench --check --skip-bench --iters 2 --check-dtypes float16 \
      --check-shapes check_h32_persistent,check_h64_decode --out "$OUT/check_fp16_rest.json" \
      > "$OUT/check_fp16_rest.log" 2>&1
    ;;
  C)  # device time per op of the final tree (ours, bounded_softmax, the expansion baselines)
    timeout 210 $bench --skip-bench --profile --iters 10 --out "$OUT/profile.json" \
      > "$OUT/profile.log" 2>&1
    ;;
esac
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.txt"
ls -la "$OUT"
