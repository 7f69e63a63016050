"""Prefill and decode throughput of lpes_jax Llama models, side by side with PyTorch+transformers.

    python -m experiments.bench_llama                # gpu suite on a GPU, else cpu
    python -m experiments.bench_llama --suite cpu    # real SmolLM2 GGUF, runs/bench_llama/cpu.json
    python -m experiments.bench_llama --suite gpu    # H200: SmolLM2-shaped and 7B-shaped, bf16

Prefill: one forward over [B, T] tokens, logits of the last position only (transformers:
`logits_to_keep=1`, no cache). Decode: greedy generation of G tokens after a P-token prompt with a
KV cache; decode tokens/s = B·(G−1) / (time(generate) − time(prefill with cache)). Each timing is
the median of `--reps` runs after one warm-up (compilation) run. transformers runs with sdpa
attention in the same dtype when torch is importable; otherwise its columns are absent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from lpes_jax.config import LlamaConfig
from lpes_jax.generate import greedy_decode
from lpes_jax.llama import Llama, init_kv_cache, init_params

SMOLLM2_SHAPE = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, max_position_embeddings=8192)
LLAMA_7B_SHAPE = LlamaConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
    num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, max_position_embeddings=4096)


def _median_time(fn, reps: int) -> float:
  fn()  # Warm-up / compilation.
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def bench_jax(config: LlamaConfig, params, *, prefill_len: int, prefill_batch: int,
              decode_batch: int, prompt_len: int, new_tokens: int, reps: int) -> dict:
  model = Llama(config)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(3, config.vocab_size, (prefill_batch, prefill_len)), jnp.int32)
  prefill = jax.jit(lambda p, t: model.apply({"params": p}, t, logits_to_keep=1))
  t_prefill = _median_time(lambda: prefill(params, x).block_until_ready(), reps)

  prompts = jnp.asarray(rng.integers(3, config.vocab_size, (decode_batch, prompt_len)), jnp.int32)
  mask = jnp.ones(prompts.shape, bool)
  cache_len = prompt_len + new_tokens

  @jax.jit
  def prefill_cached(p, t, m):
    logits, cache = model.apply({"params": p}, t, attention_mask=m, logits_to_keep=1,
                                kv_cache=init_kv_cache(config, t.shape[0], cache_len))
    return logits, cache["k"][-1]

  decode = jax.jit(lambda p, t, m: greedy_decode(
      config, p, t, m, max_new_tokens=new_tokens, eos_ids=jnp.zeros((0,), jnp.int32),
      cache_len=cache_len))
  t_pc = _median_time(lambda: jax.block_until_ready(prefill_cached(params, prompts, mask)), reps)
  t_gen = _median_time(lambda: jax.block_until_ready(decode(params, prompts, mask)), reps)
  return {"prefill_s": t_prefill, "prefill_tok_s": prefill_batch * prefill_len / t_prefill,
          "decode_prefill_s": t_pc, "generate_s": t_gen,
          "decode_tok_s": decode_batch * (new_tokens - 1) / max(t_gen - t_pc, 1e-9)}


def bench_torch(config: LlamaConfig, *, dtype: str, device: str, prefill_len: int,
                prefill_batch: int, decode_batch: int, prompt_len: int, new_tokens: int,
                reps: int, state_dict=None) -> dict:
  import torch
  import transformers

  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  hf_cfg = transformers.LlamaConfig(
      vocab_size=config.vocab_size, hidden_size=config.hidden_size,
      intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
      head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
      tie_word_embeddings=config.tie_word_embeddings,
      max_position_embeddings=config.max_position_embeddings)
  with torch.device(device):
    model = transformers.LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa",
                                                        dtype=tdtype).eval()
  if state_dict is not None:
    model.load_state_dict(state_dict, strict=False)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  gen = torch.Generator().manual_seed(0)
  x = torch.randint(3, config.vocab_size, (prefill_batch, prefill_len), generator=gen).to(device)
  prompts = torch.randint(3, config.vocab_size, (decode_batch, prompt_len), generator=gen).to(device)
  mask = torch.ones_like(prompts)

  def run_prefill():
    with torch.no_grad():
      model(input_ids=x, use_cache=False, logits_to_keep=1)
    sync()

  def run_prefill_cached():
    with torch.no_grad():
      model(input_ids=prompts, attention_mask=mask, use_cache=True, logits_to_keep=1)
    sync()

  def run_generate():
    with torch.no_grad():
      model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=new_tokens,
                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync()

  t_prefill = _median_time(run_prefill, reps)
  t_pc = _median_time(run_prefill_cached, reps)
  t_gen = _median_time(run_generate, reps)
  out = {"prefill_s": t_prefill, "prefill_tok_s": prefill_batch * prefill_len / t_prefill,
         "decode_prefill_s": t_pc, "generate_s": t_gen,
         "decode_tok_s": decode_batch * (new_tokens - 1) / max(t_gen - t_pc, 1e-9),
         "torch": torch.__version__, "transformers": transformers.__version__}
  del model
  if device == "cuda":
    torch.cuda.empty_cache()
  return out


def _torch_available() -> bool:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    return True
  except ImportError:
    return False


def run_case(name: str, config: LlamaConfig, params, *, torch_device: str | None, implementations,
             **shape) -> dict:
  result = {"case": name, "config": dataclasses.asdict(config), "shape": shape, "jax": {}}
  for impl in implementations:
    cfg = dataclasses.replace(config, attention_implementation=impl)
    label = impl or "auto"  # None: cuDNN for plain prefill, "xla" for cached decoding
    result["jax"][label] = bench_jax(cfg, params, **shape)
    print(name, "jax", label, json.dumps(result["jax"][label]), flush=True)
  if torch_device is not None:
    result["transformers_sdpa"] = bench_torch(config, dtype=config.dtype, device=torch_device,
                                              **shape)
    print(name, "transformers", json.dumps(result["transformers_sdpa"]), flush=True)
  return result


SUITES = {"cpu": "the real SmolLM2-135M GGUF in float32, lpes_jax's xla attention",
          "gpu": "SmolLM2-135M-shaped and Llama-7B-shaped random weights in bfloat16"}


def main(argv=None) -> None:
  parser = common.make_parser("bench_llama", __doc__, SUITES)
  parser.add_argument("--suite", choices=tuple(SUITES),
                      help="cases to run, see suites below (default: gpu on a GPU, else cpu)")
  parser.add_argument("--out", help="results JSON file (default: runs/bench_llama/SUITE.json)")
  parser.add_argument("--reps", type=common.positive_int, default=3,
                      help="timed runs per measurement after the warm-up (median reported)")
  parser.add_argument("--skip-7b", action="store_true", help="gpu suite: leave out the 7B shape")
  args = parser.parse_args(argv)
  args.suite = args.suite or ("gpu" if jax.default_backend() == "gpu" else "cpu")
  args.out = args.out or f"runs/bench_llama/{args.suite}.json"
  if os.path.isdir(args.out):
    parser.error(f"--out {args.out} is a folder; give a .json file")
  try:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  except OSError as e:
    parser.error(f"--out {args.out}: cannot create its folder ({e})")
  torch_ok = _torch_available()
  results = {"suite": args.suite, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
             "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
             "platform": platform.platform(), "cases": []}
  if args.suite == "cpu":
    from lpes_jax import load_pretrained
    from lpes_jax.assets import smollm2_gguf
    _, params, config = load_pretrained(smollm2_gguf())
    shape = dict(prefill_len=256, prefill_batch=1, decode_batch=1, prompt_len=32, new_tokens=17,
                 reps=args.reps)
    results["cases"].append(run_case("smollm2_135m_gguf_f32_cpu", config, params,
                                      torch_device="cpu" if torch_ok else None,
                                      implementations=("xla",), **shape))
  else:
    shape = dict(prefill_len=4096, prefill_batch=1, decode_batch=8, prompt_len=512,
                 new_tokens=129, reps=args.reps)
    cases = [("smollm2_135m_shape_bf16", SMOLLM2_SHAPE)]
    if not args.skip_7b:
      cases.append(("llama_7b_shape_bf16", LLAMA_7B_SHAPE))
    for name, base in cases:
      config = dataclasses.replace(base, dtype="bfloat16")
      params = init_params(config, jax.random.key(0))
      results["cases"].append(run_case(name, config, params, torch_device="cuda" if torch_ok
                                       else None, implementations=(None, "xla"), **shape))
      del params
      with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
  with open(args.out, "w") as fh:
    json.dump(results, fh, indent=1)


if __name__ == "__main__":
  main()
