"""Sample text from a language model trained by `python -m experiments.language_model`.

    python -m experiments.language_model --preset smoke --out runs/lm_smoke     # train first
    python -m experiments.sample_text --run runs/lm_smoke/pope --prompt "ROMEO:" \\
        --max-new-tokens 64 --temperature 0.8 --top-k 40 --seed 0
    python -m experiments.sample_text --run runs/language_model/rope --num-samples 4 --top-p 0.9

--run is one model's folder, OUT/<encoding>/ (result.json with the model config,
params.msgpack); the tokenizer is the one its data folder holds (OUT/data/tokenizer.json).
Decoding uses the KV cache of `pope_jax.generation` (RoPE and PoPE alike); temperature 0 is
greedy. Sampling stops at the end-of-text token. Prints each sample and returns them.
"""

from __future__ import annotations

import jax
from tqdm import tqdm

from experiments import common
from pope_jax import generation
from pope_jax.data import text
from pope_jax.tasks import language_model as lm


def _encode(tokenizer, prompt: str) -> list[int]:
  if isinstance(tokenizer, text.CharTokenizer):
    return tokenizer.encode_ids(prompt)
  return tokenizer.encode(prompt).ids


def main(argv: list[str] | None = None) -> list[str]:
  parser = common.make_parser("sample_text", __doc__)
  parser.add_argument("--run", type=common.existing_dir, required=True,
                      help="a trained model's folder, OUT/<encoding> of experiments.language_model")
  parser.add_argument("--prompt", default="\n", help="text to continue")
  parser.add_argument("--num-samples", type=common.positive_int, default=1,
                      help="samples drawn as one batch")
  parser.add_argument("--max-new-tokens", type=common.positive_int, default=100,
                      help="tokens to sample per sample")
  common.add_sampling_flags(parser, temperature=0.8)
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  args = parser.parse_args(argv)
  try:
    config, params, tokenizer = lm.load_run(args.run)
    ids = _encode(tokenizer, args.prompt)
    sampling = generation.Sampling(temperature=args.temperature, top_k=args.top_k,
                                   top_p=args.top_p)
  except (FileNotFoundError, KeyError, ValueError) as e:
    parser.error(str(e))
  if not ids:
    parser.error("--prompt encodes to no tokens")
  eot = None if isinstance(tokenizer, text.CharTokenizer) else tokenizer.token_to_id(text.EOT)
  bar = tqdm(total=args.max_new_tokens, desc="tokens", disable=args.no_progress)
  new = generation.generate(
      config, params, [ids] * args.num_samples, max_new_tokens=args.max_new_tokens,
      temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
      key=jax.random.key(args.seed), stop_ids=() if eot is None else (eot,),
      on_token=lambda i: bar.update(1))
  bar.close()
  samples = [args.prompt + tokenizer.decode([t for t in row if t != eot]) for row in new]
  for i, sample in enumerate(samples):
    print(f"--- sample {i} ---\n{sample}", flush=True)
  return samples


if __name__ == "__main__":
  main()
