#!/usr/bin/env bash
# The LPES run on one H200 (SmolLM2-135M-Instruct, KV retrieval with 4-hex-digit keys/values).
# Expects the GGUF at $1 (default /tmp/smol.gguf), the gguf package importable, writes under $2.
set -u
M=${1:-/tmp/smol.gguf}
W=${2:-runs/lpes_h200}
K="--task kv --num-pairs 6 --key-length 4 --value-length 4"
N=${N_EVAL:-200}
mkdir -p "$W"
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 PYTHONUNBUFFERED=1
# Search (teacher-forced, 200 examples, seed 0) and the four baselines (held-out seed 1) together,
# each in its own run folder (a run folder has one writer at a time).
python3 -m experiments.lpes_search --model "$M" $K --out "$W/search" --example-batch 100 \
  > "$W/search.log" 2>&1 &
for m in base pi ms_poe buckets; do
  python3 -m experiments.lpes_eval --model "$M" $K --method $m --num-examples $N \
    --batch-size $N --max-new-tokens 8 --out "$W/eval_$m" > "$W/eval_$m.log" 2>&1 &
done
wait
python3 -m experiments.lpes_eval --model "$M" $K --method lpes --scales "$W/search/results.json" \
  --num-examples $N --batch-size $N --max-new-tokens 8 --out "$W/eval_lpes" > "$W/eval_lpes.log" 2>&1
# Latency, one process at a time, compiled programs from the cache: gold 0, two batches of $N.
for m in base lpes pi ms_poe buckets; do
  python3 -m experiments.lpes_eval --model "$M" $K --method $m --scales "$W/search/results.json" \
    --positions 0 --num-examples $((2 * N)) --batch-size $N --max-new-tokens 8 \
    --out "$W/latency_$m" > "$W/latency_$m.log" 2>&1
done
grep -h "gold\|^base\|^pi\|^ms_poe\|^buckets\|^lpes\|median\|best\|wall" "$W"/*.log
