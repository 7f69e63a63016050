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
esac
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.txt"
ls -la "$OUT"
