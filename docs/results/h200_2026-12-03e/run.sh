#!/usr/bin/env bash
# The GPU calls of run 26 (docs/results/attention_kernel.md): bash run.sh CALL, from the
# repository root on the H200, with tokamax's and grain's wheels in .whl_kernel/ and .whl_ii/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl_kernel/*.whl .whl_ii/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
bench="python3 -m experiments.bench_attention"
sha1sum pallas_kernels/*.py pope_jax/*.py experiments/bench_attention.py > "$OUT/tree_sha.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
case "$1" in
  A)  # conditional rescaling (rescale_threshold 8, the tree's default) against the classic
      # online softmax (0): every bf16 check shape at both, then the A/B variants
    timeout 260 $bench --check --skip-bench --iters 2 --check-blocks '{"rescale_threshold": 0.0}' \
      --out "$OUT/check.json" > "$OUT/check.log" 2>&1
    timeout 300 $bench --skip-bench --variants --iters 10 --out "$OUT/variants.json" \
      > "$OUT/variants.log" 2>&1
    ;;
  B)  # the main tables and device time with the default
    timeout 260 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    timeout 200 $bench --skip-bench --profile --iters 10 --out "$OUT/profile.json" \
      > "$OUT/profile.log" 2>&1
    ;;
  C)  # on B's machine right after it: the main tables in bf16 and fp16, the train step
    timeout 330 $bench --dtypes bfloat16,float16 --iters 10 --out "$OUT/main.json" \
      > "$OUT/main.log" 2>&1
    timeout 200 $bench --skip-bench --train-step --train-batch 16 --iters 10 \
      --out "$OUT/train.json" > "$OUT/train.log" 2>&1
    ;;
  D)  # the final tree (classic rescale at H = 64, rescale_threshold 8 at H = 128): bf16 tables
    timeout 150 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    ;;
esac
ls -la "$OUT"
