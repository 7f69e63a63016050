#!/usr/bin/env bash
# The GPU runs recorded in docs/results/, on one host with one or two H200s: one queue of named
# jobs per GPU.
#
# Usage: bash scripts/h200_runs.sh OUT "JOBS FOR GPU 0" ["JOBS FOR GPU 1"]
#   e.g. bash scripts/h200_runs.sh runs/h200 "ii_pope lm" "bench_attention bench_llama ii_rope ii_summary"
#
# Jobs (see `job_*` below):
#   ii_pope, ii_rope   indirect indexing, paper preset, float32, GPT-2 init, seeds 0, 1, 2 vmapped
#   ii_summary         the table and plot of both (waits for ii_pope's result)
#   ii_pope_bf16       the same PoPE run in bfloat16, seeds 0, 1 (separates precision from init)
#   lm                 GPT-2-124M-shaped language models on Shakespeare, then zero-shot length
#                      extrapolation to 10x their context with the YaRN baselines (h200 presets)
#   freq               frequency usage of the lm job's models
#   lm_summary         validation-perplexity table of the lm job's models
#   jsb                JSB chorales, the paper's configuration
#   bench_attention    kernel check and benchmark, GPT-2-124M train step (PoPE kernel vs RoPE cuDNN)
#   bench_llama        Llama prefill/decode against transformers
#
# Expects wheels, when the machine lacks the packages: .whl_ii (grain, array-record, portpicker),
# .whl_kernel (tokamax and what it imports that the machine lacks), .whl_jsb (music21 and its
# imports); the Shakespeare token files in .lm_data (experiments.language_model's format). Each job
# logs to OUT/<job>.log and appends "<job> <exit status>" to OUT/status; OUT/queue<i>.done marks a
# queue that has run all its jobs. Training jobs pass --resume, so running the script again
# continues unfinished runs. Jobs run in the background (setsid), so the queues outlive the shell
# that starts them. Inputs are copied to /tmp first: a later sync of the working tree may remove
# untracked folders the queues still need.
set -u
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache POPE_JAX_CACHE=/tmp/pope_cache
site() {  # site DIR WHEEL_DIR: install the wheels once into DIR.
  [ -d "$1" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$1" "$2"/*.whl
}
ii() {
  python3 -m experiments.indirect_indexing --preset paper --attention-implementation xla \
    --data-workers 3 --no-progress "$@"
}
job_ii_pope() { ii --encodings pope --seeds 0,1,2 --dtype float32 --out "$W/ii" --resume; }
job_ii_rope() { ii --encodings rope --seeds 0,1,2 --dtype float32 --out "$W/ii" --resume; }
job_ii_summary() {  # Waits up to an hour for both encodings' runs (in other queues).
  for _ in $(seq 720); do
    [ -f "$W/ii/pope/result.json" ] && [ -f "$W/ii/rope/result.json" ] && break
    sleep 5
  done
  ii --seeds 0,1,2 --out "$W/ii" --summarize
}
job_ii_pope_bf16() {
  ii --encodings pope --seeds 0,1 --dtype bfloat16 --out "$W/ii_bf16" --resume
}
lm_flags() { echo --preset h200 --data-dir /tmp/.lm_data --out "$W/lm" --no-progress --resume; }
job_lm() { python3 -m experiments.length_extrapolation $(lm_flags); }
job_freq() { python3 -m experiments.frequency_usage $(lm_flags); }
job_lm_summary() { python3 -m experiments.language_model $(lm_flags); }
job_jsb() { python3 -m experiments.jsb --preset paper --out "$W/jsb" --no-progress --resume; }
job_bench_attention() {
  PYTHONPATH=$PYTHONPATH:/tmp/site_kernel python3 -m experiments.bench_attention --check \
    --train-step --iters 10 --out "$W/bench_attention.json"
}
job_bench_llama() { python3 -m experiments.bench_llama --suite gpu --out "$W/bench_llama.json"; }

queue() {  # queue GPU JOB...: run the jobs one after another on one GPU.
  export CUDA_VISIBLE_DEVICES=$1; shift
  for name in "$@"; do
    "job_$name" > "$W/$name.log" 2>&1
    echo "$name $?" >> "$W/status"
  done
  touch "$W/queue$CUDA_VISIBLE_DEVICES.done"
}

JOBS=$(compgen -A function job_ | sed "s/^job_//" | tr "\n" " ")
if [ $# -lt 2 ]; then
  echo "usage: bash scripts/h200_runs.sh OUT \"JOBS FOR GPU 0\" [\"JOBS FOR GPU 1\" ...]" >&2
  echo "jobs: $JOBS" >&2
  exit 2
fi
for jobs in "${@:2}"; do
  for name in $jobs; do
    declare -F "job_$name" > /dev/null || { echo "unknown job '$name'; jobs: $JOBS" >&2; exit 2; }
  done
done
W=$1
mkdir -p "$W"
[ -d .whl_ii ] && site /tmp/site_ii .whl_ii
[ -d .whl_kernel ] && site /tmp/site_kernel .whl_kernel
[ -d .whl_jsb ] && site /tmp/site_jsb .whl_jsb
[ -d .lm_data ] && rm -rf /tmp/.lm_data && cp -r .lm_data /tmp/.lm_data
export PYTHONPATH=/tmp/site_ii:/tmp/site_jsb

export -f queue ii lm_flags $(compgen -A function job_)
export W
gpu=0
for jobs in "${@:2}"; do
  # Job names (checked above) travel as arguments, never through a command string.
  setsid bash -c 'queue "$@"' _ "$gpu" $jobs > "$W/queue$gpu.log" 2>&1 < /dev/null &
  gpu=$((gpu + 1))
done
echo "started $gpu queue(s) in $W"
