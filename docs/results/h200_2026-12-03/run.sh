#!/usr/bin/env bash
# The GPU calls of run 22 (docs/results/attention_kernel.md): bash run.sh CALL, from the
# repository root on the H200, with tokamax's and grain's wheels in .whl_kernel/ and .whl_ii/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl_kernel/*.whl .whl_ii/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
bench="python3 -m experiments.bench_attention"
sha1sum pallas_kernels/*.py pope_jax/*.py experiments/bench_attention.py > "$OUT/tree_sha.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
case "$1" in
  A)
    timeout 60 python3 docs/results/h200_2026-12-03/hlo_fwd.py > "$OUT/hlo_fwd_h64.txt" 2>&1
    timeout 200 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    timeout 240 $bench --skip-bench --profile --iters 10 --out "$OUT/profile.json" \
      > "$OUT/profile.log" 2>&1
    ;;
  B)
    timeout 200 $bench --check --skip-bench --iters 2 --out "$OUT/check.json" > "$OUT/check.log" 2>&1
    timeout 120 $bench --skip-bench --train-step --train-batch 16 --iters 10 \
      --out "$OUT/train.json" > "$OUT/train.log" 2>&1
    timeout 240 $bench --dtypes bfloat16,float16 --iters 10 --out "$OUT/main.json" \
      > "$OUT/main.log" 2>&1
    ;;
esac
ls -la "$OUT"
