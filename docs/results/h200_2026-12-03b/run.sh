#!/usr/bin/env bash
# The GPU calls of run 23 (docs/results/attention_kernel.md): bash run.sh CALL, from the
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
    timeout 420 $bench --dtypes bfloat16,float16 --iters 10 --out "$OUT/main.json" \
      > "$OUT/main.log" 2>&1
    timeout 150 $bench --check --check-dtypes float16 --skip-bench --iters 2 \
      --check-shapes check_h64,check_h128,check_h32_v96_gqa,check_h64_decode \
      --out "$OUT/check_fp16.json" > "$OUT/check_fp16.log" 2>&1
    ;;
  B)
    timeout 170 $bench --check --skip-bench --iters 2 --out "$OUT/check.json" > "$OUT/check.log" 2>&1
    timeout 230 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    timeout 170 $bench --skip-bench --profile --iters 10 --out "$OUT/profile.json" \
      > "$OUT/profile.log" 2>&1
    ;;
  C)
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
      --format=csv -lms 200 > "$OUT/clocks.csv" &
    smi=$!
    timeout 200 $bench --iters 10 --min-window-ms 0 --out "$OUT/main_w0.json" \
      > "$OUT/main_w0.log" 2>&1
    timeout 200 $bench --iters 10 --min-window-ms 100 --out "$OUT/main_w100.json" \
      > "$OUT/main_w100.log" 2>&1
    kill $smi
    ;;
  D)  # not run (no device time left): the three-kernel forward (this tree), then with
      # two_kernel_forward.diff applied (δ clamped in the kernel), then this tree again
    lo="python3 docs/results/h200_2026-12-03b/launch_overhead.py"
    diff=docs/results/h200_2026-12-03b/two_kernel_forward.diff
    timeout 120 $lo > "$OUT/launch_three.log" 2>&1
    git apply "$diff" || patch -p1 < "$diff"
    timeout 60 python3 docs/results/h200_2026-12-03/hlo_fwd.py > "$OUT/hlo_fwd_h64_two.txt" 2>&1
    timeout 60 $lo ours > "$OUT/launch_two.log" 2>&1
    timeout 80 $bench --check --skip-bench --iters 2 --check-shapes check_h64,check_h128,check_h32_gqa \
      --out "$OUT/check_two.json" > "$OUT/check_two.log" 2>&1
    timeout 150 $bench --iters 10 --out "$OUT/main_two.json" > "$OUT/main_two.log" 2>&1
    git apply -R "$diff" || patch -R -p1 < "$diff"
    timeout 60 $lo ours > "$OUT/launch_three2.log" 2>&1
    ;;
esac
ls -la "$OUT"
