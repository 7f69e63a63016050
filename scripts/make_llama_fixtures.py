"""Reference fixtures for lpes_jax parity tests, computed with PyTorch + Hugging Face transformers.

Needs torch and transformers (not project dependencies); runs on CPU in about a minute:

    python scripts/make_llama_fixtures.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf

Writes into tests/fixtures/llama/:
  <name>/            small random checkpoints saved with `save_pretrained` (llama MHA + llama3 rope
                     scaling, llama GQA + tied head + linear scaling, qwen2 GQA with q/k/v biases);
  <name>.npz         input ids, left-padded attention mask, float32 logits, greedy continuation;
  smollm2.npz        SmolLM2-135M-Instruct GGUF: prompt ids, float32 logits, greedy tokens,
                     tokenisation of sample strings and a rendered chat template.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "llama")
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "llama_mha_llama3": transformers.LlamaConfig(
        **TINY, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64)),
    "llama_gqa_tied_linear": transformers.LlamaConfig(
        **TINY, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500.0,
        rope_scaling=dict(type="linear", factor=2.0)),
    "qwen2_bias": transformers.Qwen2Config(
        **TINY, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6),
}
SAMPLE_TEXTS = ["The capital of France is", "Hello world! 12345 numbers, café naïve.",
                "  leading spaces\nnew line\ttab", "<|im_start|>user\nhi<|im_end|>"]


def _positions(mask: torch.Tensor) -> torch.Tensor:
  return (mask.cumsum(-1) - 1).clamp(min=0)


def tiny_fixture(name: str, cfg) -> None:
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
  with torch.no_grad():  # Random norms and biases, so that their loading is tested too.
    for pname, p in model.named_parameters():
      if "norm" in pname:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif pname.endswith(".bias"):
        p.copy_(0.3 * torch.randn_like(p))
  model = model.float().eval()
  folder = os.path.join(OUT, name)
  model.save_pretrained(folder)
  gen = torch.Generator().manual_seed(1)
  ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=gen)
  mask = torch.ones_like(ids)
  mask[1, :4] = 0
  ids[1, :4] = 0
  with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
  np.savez_compressed(os.path.join(OUT, f"{name}.npz"), input_ids=ids.numpy(),
                      attention_mask=mask.numpy(), logits=logits.float().numpy(),
                      greedy=out[:, ids.shape[1]:].numpy())
  print(name, "logit scale", float(logits.abs().max()))


def smollm2_fixture(gguf_path: str) -> None:
  folder, fname = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=fname)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=fname, dtype=torch.float32, attn_implementation="eager").eval()
  ids = torch.tensor([tok("The capital of France is", add_special_tokens=False).input_ids])
  with torch.no_grad():
    logits = model(input_ids=ids).logits
    out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
  texts = {f"text_{i}": np.array(tok(t, add_special_tokens=False).input_ids)
           for i, t in enumerate(SAMPLE_TEXTS)}
  chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                 add_generation_prompt=True)
  np.savez_compressed(os.path.join(OUT, "smollm2.npz"), input_ids=ids.numpy(),
                      logits=logits.float().numpy(), greedy=out[:, ids.shape[1]:].numpy(),
                      sample_texts=np.array(json.dumps(SAMPLE_TEXTS)),
                      chat=np.array(chat), **texts)
  print("smollm2 greedy:", repr(tok.decode(out[0, ids.shape[1]:])))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
  args = parser.parse_args()
  os.makedirs(OUT, exist_ok=True)
  for name, cfg in CONFIGS.items():
    tiny_fixture(name, cfg)
  if args.gguf:
    smollm2_fixture(args.gguf)
  with open(os.path.join(OUT, "VERSIONS.json"), "w") as fh:
    json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, fh)


if __name__ == "__main__":
  main()
