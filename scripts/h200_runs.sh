#!/usr/bin/env bash
# The GPU runs recorded in docs/results/, on one host with two H200s: one queue of jobs per GPU.
#
#   GPU 0: indirect indexing, paper preset, PoPE (float32, GPT-2 init, seeds 0, 1, 2 vmapped);
#          then GPT-2-124M-shaped language models on Shakespeare and zero-shot length
#          extrapolation to 10x their context (h200 presets).
#   GPU 1: the attention-kernel benchmark (check and GPT-2-124M train step: PoPE kernel vs RoPE
#          on cuDNN), the Llama prefill/decode benchmark against transformers; then indirect
#          indexing, paper preset, RoPE (same settings as PoPE) and the summary of both encodings.
#
# Usage: bash scripts/h200_runs.sh [OUT]   (default runs/h200). Expects wheels, when the machine
# lacks the packages: .whl_ii (grain, array-record, portpicker), .whl_kernel (tokamax and what it
# imports that the machine lacks); the Shakespeare token files in .lm_data (experiments.
# language_model's format). Each job logs to
# OUT/<job>.log and appends "<job> <exit status>" to OUT/status; OUT/<queue>.done marks a queue
# that has run all its jobs. Training jobs pass --resume, so running the script again continues
# unfinished runs. Jobs run in the background (setsid), so the queues outlive the shell that
# starts them. Inputs are copied to /tmp first: a later sync of the working tree may remove
# untracked folders the queues still need.
set -u
W=${1:-runs/h200}
mkdir -p "$W"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
site() {  # site DIR WHEEL_DIR: install the wheels once into DIR.
  [ -d "$1" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$1" "$2"/*.whl
}
copy_inputs() { for d in .lm_data; do [ -d "$d" ] && rm -rf "/tmp/$d" && cp -r "$d" "/tmp/$d"; done; }
job() {  # job NAME COMMAND...: run, log to OUT/NAME.log, record the exit status.
  local name=$1; shift
  "$@" > "$W/$name.log" 2>&1
  echo "$name $?" >> "$W/status"
}
ii() {
  python3 -m experiments.indirect_indexing --preset paper --seeds 0,1,2 --dtype float32 \
    --attention-implementation xla --data-workers 3 --out "$W/ii" --no-progress "$@"
}
[ -d .whl_ii ] && site /tmp/site_ii .whl_ii
[ -d .whl_kernel ] && site /tmp/site_kernel .whl_kernel
copy_inputs
export PYTHONPATH=/tmp/site_ii

queue0() {
  export CUDA_VISIBLE_DEVICES=0
  job ii_pope ii --encodings pope --resume
  job lm python3 -m experiments.length_extrapolation --preset h200 --data-dir /tmp/.lm_data \
    --out "$W/lm" --no-progress --resume
  touch "$W/queue0.done"
}

queue1() {
  export CUDA_VISIBLE_DEVICES=1
  PYTHONPATH=/tmp/site_ii:/tmp/site_kernel job bench_attention python3 -m \
    experiments.bench_attention --check --train-step --iters 10 --out "$W/bench_attention.json"
  job bench_llama python3 -m experiments.bench_llama --suite gpu --out "$W/bench_llama.json"
  job ii_rope ii --encodings rope --resume
  # Both encodings' runs end by summarising OUT/ii; summarise once more after both are done.
  for _ in $(seq 240); do [ -f "$W/ii/pope/result.json" ] && break; sleep 5; done
  job ii_summary ii --summarize
  touch "$W/queue1.done"
}

export -f queue0 queue1 site copy_inputs job ii
export W
setsid bash -c queue0 > "$W/queue0.log" 2>&1 < /dev/null &
setsid bash -c queue1 > "$W/queue1.log" 2>&1 < /dev/null &
echo "started queues in $W"
