"""The project's command-line entry points, all run as `python -m experiments.NAME` (the one
place they are listed). Each parses flags, builds a config from a preset plus overrides, calls the
library (`pope_jax`, `lpes_jax`, `pallas_kernels`) and writes its results; none imports another.

One convention (`experiments.common`):
- `--seed INT` where a command runs one seed (per model); `--seeds 0,1,2` (comma-separated ints)
  where it trains several seeds side by side in one program (`indirect_indexing`, `jsb`) or one
  after another, one run folder per model and seed (`language_model`, `length_extrapolation`,
  `frequency_usage`).
- Every flag is checked before any work starts (no model loads, no step runs): a bad value is a
  usage error (exit status 2) that names the flag.
- `--out` is the run folder, locked while the run writes it (`pope_jax.run_lock`): a second run
  on it refuses at start and names the holder; `--resume` locks too and takes over the lock of a
  killed run with a warning. `indirect_indexing` locks OUT/<encoding>, so encodings may run in
  separate processes on one --out.
- `--help` shows `python -m experiments.NAME`, each flag's default and the presets.

PoPE (`pope_jax`):
  language_model       — train RoPE and PoPE Transformers on real text; validation perplexity.
  length_extrapolation — zero-shot perplexity vs evaluation context length (PoPE Figure 2).
  frequency_usage      — per (layer, frequency) mean q/k magnitude of RoPE and PoPE (PoPE §5).
  indirect_indexing    — train RoPE and PoPE on indirect indexing; test accuracy (PoPE §4).
  jsb                  — JSB Chorales benchmark; test NLL per token over seeds (PoPE App. A).
  sample_text          — sample text from a trained language model (KV cache, top-k/top-p).
  sample_chorale       — sample a chorale from a trained JSB model into a MIDI file.
  bench_decode         — KV-cache decode tokens/s, PoPE against RoPE, against the bandwidth limit.
  score_bounds         — how many query tiles the fused kernel's magnitude bound covers.
Kernel (`pallas_kernels`, GPU):
  bench_attention      — the fused Pallas PoPE attention kernel against the best XLA/cuDNN paths.
  bench_attention_torch — (optional, torch) pope-pytorch's Triton kernel and torch expansion +
                         SDPA on the same shapes.
  trace_attention      — where the fused forward kernel spends its time, per warpgroup.
  bench_dq_reduce      — the float32 dq adds of a fused backward, timed alone.
  bench_masked         — the fused kernel with padding, packing and multipliers against unmasked.
LPES (`lpes_jax`):
  lpes_generate        — greedy generation with a Llama-family model (HF folder or GGUF).
  lpes_search          — Bézier-constrained genetic search of per-layer RoPE scales.
  lpes_eval            — lost-in-the-middle accuracy per gold position (base, PI, Ms-PoE,
                         Attention Buckets, LPES, MoICE).
  lpes_ablations       — Bézier / linear / free / global searches over seeds under one budget,
                         held out with base and Ms-PoE at two difficulties, 95 % intervals.
  moice_train          — trains the MoICE routers of a frozen model (for lpes_eval --method moice).
  moice_sweep          — MoICE router budget x learning rate, chosen on held-out router data.
  lpes_latency         — generation latency of those methods on one model.
  bench_llama          — Llama prefill and decode throughput beside PyTorch + transformers.
  lpes_h200.sh         — (bash script) the LPES search, evaluation and latency run on one H200.
"""
