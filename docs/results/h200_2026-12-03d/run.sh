#!/usr/bin/env bash
# The GPU calls of run 25 (docs/results/attention_kernel.md): bash run.sh CALL, from the
# repository root on the H200, with tokamax's and grain's wheels in .whl_kernel/ and .whl_ii/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl_kernel/*.whl .whl_ii/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
bench="python3 -m experiments.bench_attention"
sha1sum pallas_kernels/*.py pope_jax/*.py experiments/bench_attention.py > "$OUT/tree_sha.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
case "$1" in
  A)  # the key map's forms by device time (ran before this script, as the one command
      # `python3 docs/results/h200_2026-12-03d/key_map_variants.py`)
    timeout 240 python3 docs/results/h200_2026-12-03d/key_map_variants.py \
      > "$OUT/key_map_variants.log" 2>&1
    ;;
  B)  # the polynomial softplus on main: every bf16 check shape, the main tables, device time
    timeout 170 $bench --check --skip-bench --iters 2 --out "$OUT/check.json" \
      > "$OUT/check.log" 2>&1
    timeout 230 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    timeout 170 $bench --skip-bench --profile --iters 10 --out "$OUT/profile.json" \
      > "$OUT/profile.log" 2>&1
    ;;
  C)  # the main tables again (bf16, fp16) and the fp16 check
    timeout 330 $bench --dtypes bfloat16,float16 --iters 10 --out "$OUT/main.json" \
      > "$OUT/main.log" 2>&1
    timeout 120 $bench --check --check-dtypes float16 --skip-bench --iters 2 \
      --check-shapes check_h64,check_h128,check_h32_v96_gqa,check_h64_decode \
      --out "$OUT/check_fp16.json" > "$OUT/check_fp16.log" 2>&1
    ;;
  D)  # the GPT-2-124M train step with the polynomial softplus
    timeout 220 $bench --skip-bench --train-step --train-batch 16 --iters 10 \
      --out "$OUT/train.json" > "$OUT/train.log" 2>&1
    ;;
esac
ls -la "$OUT"
