#!/usr/bin/env bash
# The GPU calls of run 24 (docs/results/attention_kernel.md): bash run.sh CALL, from the
# repository root on the H200, with tokamax's and grain's wheels in .whl_kernel/ and .whl_ii/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl_kernel/*.whl .whl_ii/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
bench="python3 -m experiments.bench_attention"
lo="python3 docs/results/h200_2026-12-03b/launch_overhead.py"
two=docs/results/h200_2026-12-03b/two_kernel_forward.diff
sha1sum pallas_kernels/*.py pope_jax/*.py experiments/bench_attention.py > "$OUT/tree_sha.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
case "$1" in
  A)  # the three-kernel forward (this tree), then the two-kernel one (two_kernel_forward.diff)
    timeout 130 $lo > "$OUT/launch_three.log" 2>&1
    git apply "$two" || patch -p1 < "$two"
    sha1sum pallas_kernels/*.py > "$OUT/tree_sha_two.txt"
    timeout 50 python3 docs/results/h200_2026-12-03/hlo_fwd.py > "$OUT/hlo_fwd_h64_two.txt" 2>&1
    timeout 100 $lo ours tokamax > "$OUT/launch_two.log" 2>&1
    timeout 90 $bench --check --skip-bench --iters 2 --check-shapes check_h64,check_h128,check_h32_gqa \
      --out "$OUT/check_two.json" > "$OUT/check_two.log" 2>&1
    timeout 170 $bench --iters 10 --out "$OUT/main_two.json" > "$OUT/main_two.log" 2>&1
    ;;
  B)  # the packed 16-bit exp2 of the forward's softmax (BlockSizes.packed_exp2, with
      # experiments.bench_attention.VARIANTS timing it against the default): check, A/B.
      # The patch is against 6c9425c (run from a checkout of it: D changed VARIANTS since)
    git apply docs/results/h200_2026-12-03c/packed_exp2.diff
    pk='{"packed_exp2": true}'
    timeout 150 $bench --check --skip-bench --iters 2 --check-blocks "$pk" \
      --check-shapes check_h64,check_h128,check_h32_gqa,check_h64_decode \
      --out "$OUT/check_packed.json" > "$OUT/check_packed.log" 2>&1
    timeout 80 $bench --check --skip-bench --iters 2 --check-blocks "$pk" --check-dtypes float16 \
      --check-shapes check_h64,check_h128 \
      --out "$OUT/check_packed_fp16.json" > "$OUT/check_packed_fp16.log" 2>&1
    timeout 330 $bench --skip-bench --variants --iters 10 --out "$OUT/variants.json" \
      > "$OUT/variants.log" 2>&1
    git apply -R docs/results/h200_2026-12-03c/packed_exp2.diff
    ;;
  C)  # this tree: the GPT-2-124M train step, then the main tables
    timeout 220 $bench --skip-bench --train-step --train-batch 16 --iters 10 \
      --out "$OUT/train.json" > "$OUT/train.log" 2>&1
    timeout 230 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    ;;
  D)  # this tree: the H64 forward's row sums on the tensor cores and the overlapped schedule,
      # against the default, three times in turn (experiments.bench_attention.VARIANTS)
    timeout 330 $bench --skip-bench --variants --iters 10 --out "$OUT/variants.json" \
      > "$OUT/variants.log" 2>&1
    ;;
  E)  # with softplus_polynomial.diff (log1p as a polynomial in _streaming.softplus): the key
      # map's pass, old and new softplus in turn; the main tables; the GPU check
      # (E's tree_sha.txt in E_softplus_polynomial/ was written after the patch was applied, by an
      # earlier form of this script: its sums are of the patched files)
    git apply docs/results/h200_2026-12-03c/softplus_polynomial.diff
    timeout 60 python3 docs/results/h200_2026-12-03c/key_map_softplus.py > "$OUT/key_map.log" 2>&1
    timeout 170 $bench --iters 10 --out "$OUT/main.json" > "$OUT/main.log" 2>&1
    timeout 90 $bench --check --skip-bench --iters 2 --check-shapes check_h64,check_h128,check_h32_gqa \
      --out "$OUT/check.json" > "$OUT/check.log" 2>&1
    git apply -R docs/results/h200_2026-12-03c/softplus_polynomial.diff
    ;;
  F)  # not run (no device time left): E's key-map comparison by device time; run 25 A
      # (h200_2026-12-03d/key_map_variants.py) measured it instead
    git apply docs/results/h200_2026-12-03c/softplus_polynomial.diff
    timeout 120 python3 docs/results/h200_2026-12-03c/key_map_softplus.py --device-time \
      > "$OUT/key_map_device.log" 2>&1
    git apply -R docs/results/h200_2026-12-03c/softplus_polynomial.diff
    ;;
esac
ls -la "$OUT"
