#!/usr/bin/env bash
# The GPU calls of run 29 (docs/results/attention_kernel.md): bash run.sh CALL, from the
# repository root on the H200, with tokamax's and grain's wheels in .whl_kernel/ and .whl_ii/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl_kernel/*.whl .whl_ii/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
bench="python3 -m experiments.bench_attention"
sha1sum pallas_kernels/*.py pope_jax/*.py experiments/bench_attention.py > "$OUT/tree_sha.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
case "$1" in
  A)  # the GPU check of three forward warpgroups (BlockSizes.forward_warpgroups, the ring
      # schedule), then three of them against the default on one machine (VARIANTS), with
      # ptxas' register and spill report
    timeout 170 $bench --check --skip-bench --iters 2 \
      --check-shapes check_h64,check_h64_persistent,check_h32_gqa,check_h64_decode,check_h32_persistent \
      --check-blocks '{"forward_warpgroups": 3}' \
      --out "$OUT/check.json" > "$OUT/check.log" 2>&1
    rc=$?
    echo "check rc $rc" >> "$OUT/check.log"
    if [ $rc -ne 124 ]; then
      MOSAIC_GPU_DUMP_PTXAS=1 timeout 380 $bench --skip-bench --variants --iters 10 \
        --out "$OUT/variants.json" > "$OUT/variants.log" 2>&1
    fi
    ;;
  B)  # the new defaults (three forward warpgroups at H = 64, with the ring): bf16 main
      # tables, the GPT-2-124M train step, the fp16 check and the bf16 check shapes A left out
    timeout 190 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    timeout 200 $bench --skip-bench --train-step --train-batch 16 --iters 10 \
      --out "$OUT/train.json" > "$OUT/train.log" 2>&1
    timeout 130 $bench --check --skip-bench --iters 2 --check-dtypes bfloat16,float16 \
      --check-shapes check_h64_noncausal,check_h32_v96_gqa,check_h64,check_h64_persistent \
      --out "$OUT/check.json" > "$OUT/check.log" 2>&1
    ;;
  C)  # the default (three warpgroups, ring) against three without the ring and two with
      # ping-pong, in turn on one machine (VARIANTS), then device time per op (--profile)
    timeout 300 $bench --skip-bench --variants --iters 10 --out "$OUT/variants.json" \
      > "$OUT/variants.log" 2>&1
    timeout 150 $bench --skip-bench --profile --iters 10 --out "$OUT/profile.json" \
      > "$OUT/profile.log" 2>&1
    ;;
  D)  # the final defaults (three forward warpgroups at H = 64 without the ring): the GPU
      # check of every check shape, then the bf16 main tables
    timeout 170 $bench --check --skip-bench --iters 2 --out "$OUT/check.json" \
      > "$OUT/check.log" 2>&1
    timeout 190 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    ;;
  E)  # with D's defaults: the GPT-2-124M train step, then (the same machine, a second call)
      # the fp16 check on three shapes. Both ran inline as below.
    timeout 110 $bench --skip-bench --train-step --train-batch 16 --iters 10 \
      --out "$OUT/train.json" > "$OUT/train.log" 2>&1
    timeout 100 $bench --check --skip-bench --iters 2 --check-dtypes float16 \
      --check-shapes check_h64,check_h64_decode,check_h32_gqa --out "$OUT/check_fp16.json" \
      > "$OUT/check_fp16.log" 2>&1
    ;;
esac
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.txt"
ls -la "$OUT"
