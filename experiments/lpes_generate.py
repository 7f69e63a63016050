"""Greedy generation with a Llama-family model (Hugging Face folder or GGUF file).

    python -m experiments.lpes_generate --model PATH --prompt "The capital of France is"
        [--max-new-tokens 32] [--rope-multipliers 1.0,0.9,...|FILE.json] [--chat] [--dtype ...]

Prints each prompt's continuation (`lpes_jax.greedy_generate`, stops at EOS).
"""

from __future__ import annotations

import json
import sys
from typing import Sequence

import numpy as np

from experiments import common
from lpes_jax import greedy_generate, load_pretrained, load_tokenizer


def parse_multipliers(spec: str | None) -> np.ndarray | None:
  """"0.5" → [], "1,0.9,0.8" → [L], or a .json file holding a number, [L] or [L, N].

  Raises:
    ValueError: not numbers, or not all finite and > 0.
  """
  if spec is None:
    return None
  try:
    if spec.endswith(".json"):
      with open(spec) as fh:
        values = np.asarray(json.load(fh), np.float32)
    else:
      values = np.asarray([float(v) for v in spec.split(",")], np.float32)
  except (OSError, ValueError, TypeError) as e:
    raise ValueError(f"--rope-multipliers {spec!r}: expected a number, a comma-separated list or "
                     f"a .json file of numbers ({e})") from None
  if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
    raise ValueError(f"--rope-multipliers {spec!r}: multipliers must be finite and > 0")
  return values.reshape(()) if values.size == 1 and not spec.endswith(".json") else values


def main(argv: Sequence[str] | None = None) -> None:
  parser = common.make_parser("lpes_generate", __doc__)
  parser.add_argument("--model", required=True, type=common.existing_path,
                      help="Hugging Face folder or .gguf file")
  parser.add_argument("--prompt", required=True, action="append",
                      help="prompt text (repeat for a batch)")
  parser.add_argument("--max-new-tokens", type=common.positive_int, default=32,
                      help="tokens generated per prompt at most (stops at EOS)")
  parser.add_argument("--rope-multipliers", default=None,
                      help="RoPE frequency multipliers (1/scale): a scalar, a comma-separated "
                           "per-layer list, or a .json file ([L] or [L, N]) (default: 1, none)")
  parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="weights and compute dtype")
  args = parser.parse_args(argv)
  try:  # Bad input fails before the slow load.
    multipliers = parse_multipliers(args.rope_multipliers)
  except ValueError as e:
    parser.error(str(e))
  _, params, config = load_pretrained(args.model, dtype=args.dtype)
  tok = load_tokenizer(args.model)
  prompts = [tok.encode_chat([{"role": "user", "content": p}]) if args.chat else tok.encode(p)
             for p in args.prompt]
  eos = tuple(dict.fromkeys(config.eos_token_ids + tok.eos_ids))
  outs = greedy_generate(config, params, prompts, max_new_tokens=args.max_new_tokens, eos_ids=eos,
                         rope_multipliers=multipliers)
  for i, out in enumerate(outs):
    header = f"[{i}] " if len(outs) > 1 else ""
    sys.stdout.write(header + tok.decode(out) + "\n")


if __name__ == "__main__":
  main()
