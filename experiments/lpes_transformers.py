"""The LPES teacher-forced fitness as a PyTorch user writes it: transformers, candidates in turn.

    python experiments/lpes_transformers.py --model .cache/smollm2_set --random-weights \\
        --out runs/bench_lpes/transformers_smollm2.json
    python experiments/lpes_transformers.py --shape llama-7b --prompt-len 4000 --window 32 \\
        --num-examples 16 --num-candidates 2 --out runs/bench_lpes/transformers_7b_kv.json

`LlamaForCausalLM` (sdpa attention) from a Hugging Face folder (`--model`: `experiments.bench_lpes
--export-smollm2` writes SmolLM2's config and the search examples and candidates it scores, with
`--with-weights` the weights too; `--random-weights` takes random ones of the folder's config, as
`bench_lpes --smollm2` does without weights) or from a named shape with random weights (`--shape`,
random tokens). Each layer's RoPE frequencies are scaled by that layer's multiplier 1/s: a forward
pre-hook per decoder layer replaces the shared (cos, sin) with its own, from the model's `inv_freq`
times the multiplier. Candidates run one at a time; examples in batches of `--example-batch`,
right-padded (a causal model reads them as unpadded, so no mask is needed), the answer-position
logits gathered from the last hidden state. An example counts iff the argmax at every answer
position is the next gold token (as `lpes_jax.fitness`).

Prints candidate-examples/s (the first candidate, which warms up, is not timed) and writes the
per-candidate subset counts to `--out` (JSON), which `experiments.bench_lpes --report` compares
with the JAX fitness. Needs torch and transformers, which the project itself does not.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

SHAPES = {
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=4096, tie_word_embeddings=False),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                 rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False),
}


def patch_layer_rope(model, multipliers):
  """Per-layer RoPE scales: layer l's (cos, sin) come from `inv_freq · multipliers[l]`.

  Args:
    model: a transformers `LlamaForCausalLM` (one shared `model.model.rotary_emb`).
    multipliers: a float32 tensor [L] on the model's device, written in place per candidate.

  Returns:
    the hook handles.
  """
  import torch

  rotary = model.model.rotary_emb
  handles = []
  for i, layer in enumerate(model.model.layers):
    def hook(module, args, kwargs, i=i):
      hidden, pos = args[0], kwargs["position_ids"]
      inv_freq = rotary.inv_freq.float() * multipliers[i]
      freqs = pos[..., None].float() * inv_freq                                # [B, T, H/2]
      emb = torch.cat((freqs, freqs), dim=-1)
      scaling = rotary.attention_scaling
      kwargs["position_embeddings"] = ((emb.cos() * scaling).to(hidden.dtype),
                                       (emb.sin() * scaling).to(hidden.dtype))
      return args, kwargs
    handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
  return handles


def load_model(args, device, dtype):
  import torch
  import transformers

  if args.model and not args.random_weights:
    model = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                          attn_implementation="sdpa")
    return model.to(device).eval()
  cfg = (transformers.LlamaConfig.from_pretrained(args.model) if args.model
         else transformers.LlamaConfig(**SHAPES[args.shape]))
  torch.manual_seed(0)
  with torch.device(device):
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa",
                                                        dtype=dtype)
  return model.eval()


def synthetic_examples(args, vocab_size: int, num_layers: int) -> dict:
  """Random right-padded rows of `--prompt-len` + `--window` − 1 tokens and random candidates."""
  rng = np.random.default_rng(0)
  E, W = args.num_examples, args.window
  T = args.prompt_len + W - 1
  at = np.tile(np.arange(T - W, T, dtype=np.int32), (E, 1))
  return {"tokens": rng.integers(3, vocab_size, (E, T)).astype(np.int32), "at": at,
          "targets": rng.integers(3, vocab_size, (E, W)).astype(np.int32),
          "target_mask": np.ones((E, W), bool), "subset": np.arange(E) % 3,
          "multipliers": 1 / rng.uniform(1.0, 2.0, (args.num_candidates, num_layers))}


def fitness_counts(model, data: dict, multipliers, example_batch: int, device, sync):
  """[P, 3] correct counts per subset and the seconds of each candidate."""
  import torch

  tokens = torch.as_tensor(data["tokens"], device=device)
  at = torch.as_tensor(data["at"], dtype=torch.long, device=device)
  targets = torch.as_tensor(data["targets"], dtype=torch.long, device=device)
  tmask = torch.as_tensor(data["target_mask"], device=device)
  E = tokens.shape[0]
  counts, seconds = [], []
  for m in data["multipliers"]:
    multipliers.copy_(torch.as_tensor(m, dtype=torch.float32))
    t0 = time.perf_counter()
    correct = []
    with torch.inference_mode():
      for b in range(0, E, example_batch):
        hidden = model.model(input_ids=tokens[b:b + example_batch]).last_hidden_state
        rows = torch.arange(hidden.shape[0], device=device)[:, None]
        logits = model.lm_head(hidden[rows, at[b:b + example_batch]])          # [B, W, V]
        hit = (logits.argmax(-1) == targets[b:b + example_batch]) | ~tmask[b:b + example_batch]
        correct.append(hit.all(-1))
    ok = torch.cat(correct).cpu().numpy()
    sync()
    seconds.append(time.perf_counter() - t0)
    counts.append(np.bincount(np.asarray(data["subset"])[ok], minlength=3).tolist())
  return counts, seconds


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="lpes_transformers", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--model", help="Hugging Face Llama folder (e.g. exported by bench_lpes)")
  p.add_argument("--random-weights", action="store_true",
                 help="--model: random weights of its config.json instead of its weights")
  src.add_argument("--shape", choices=tuple(SHAPES), help="random weights of this shape")
  p.add_argument("--examples", help="with --model: the .npz of examples and candidates that "
                                    "bench_lpes wrote (default: the folder's search_set.npz)")
  p.add_argument("--prompt-len", type=int, default=4000, help="--shape: prompt tokens per row")
  p.add_argument("--window", type=int, default=32, help="--shape: answer tokens per row")
  p.add_argument("--num-examples", type=int, default=16, help="--shape: rows")
  p.add_argument("--num-candidates", type=int, default=3,
                 help="--shape: candidates (the first one warms up)")
  p.add_argument("--example-batch", type=int, default=8, help="rows per forward")
  p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                 help="default: bfloat16 on a GPU, float32 on the CPU")
  p.add_argument("--out", required=True, help="results JSON file")
  args = p.parse_args(argv)
  if args.random_weights and not args.model:
    p.error("--random-weights goes with --model (its config.json)")
  if args.model:
    args.examples = args.examples or os.path.join(args.model, "search_set.npz")
    if not os.path.exists(args.examples):
      p.error(f"--examples: no {args.examples} (experiments.bench_lpes --export-smollm2 writes "
              f"it)")
  for name in ("prompt_len", "window", "num_examples", "num_candidates", "example_batch"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  if args.num_candidates < 2 and args.shape:
    p.error("--num-candidates must be >= 2: the first one warms up and is not timed")

  import torch
  import transformers

  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype_name = args.dtype or ("bfloat16" if device == "cuda" else "float32")
  dtype = getattr(torch, dtype_name)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  model = load_model(args, device, dtype)
  L = model.config.num_hidden_layers
  if args.model:
    with np.load(args.examples) as f:
      data = dict(f)
  else:
    data = synthetic_examples(args, model.config.vocab_size, L)
  multipliers = torch.ones(L, dtype=torch.float32, device=device)
  patch_layer_rope(model, multipliers)
  counts, seconds = fitness_counts(model, data, multipliers, args.example_batch, device, sync)
  E = len(data["tokens"])
  timed = seconds[1:] or seconds
  throughput = len(timed) * E / sum(timed)
  source = args.shape or args.model + (" (random weights)" if args.random_weights else "")
  result = {"source": source, "device": str(
      torch.cuda.get_device_name() if device == "cuda" else "cpu"), "dtype": dtype_name,
            "examples": E, "tokens_per_row": int(data["tokens"].shape[1]),
            "example_batch": args.example_batch, "counts": counts, "seconds": seconds,
            "candidate_examples_per_s": throughput, "torch": torch.__version__,
            "transformers": transformers.__version__}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as fh:
    json.dump(result, fh, indent=1)
  print(f"transformers {result['source']}: {E} examples x {len(counts)} candidates, "
        f"{result['tokens_per_row']} tokens per row, {dtype_name} on {result['device']}: "
        f"{throughput:.2f} candidate-examples/s (first candidate untimed)")


if __name__ == "__main__":
  main()
