"""LlamaConfig: the static description of a Llama-family decoder (llama, mistral, qwen2).

Built from a Hugging Face `config.json` (`LlamaConfig.from_hf_dict`) or from GGUF metadata
(`LlamaConfig.from_gguf_metadata`). Shapes and RoPE settings only: LPES multipliers are run-time
inputs of the model, never config fields.

Shape letters: D model width, N query heads, K kv heads, H head dim, L layers, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lpes_jax.rope_scaling import RopeScaling

MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn", "pallas")  # `pope_jax.rope_attention`'s


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """A Llama-family decoder: RMSNorm, SwiGLU MLP, GQA attention with half-split RoPE.

  Attributes:
    model_type: "llama", "mistral" or "qwen2".
    vocab_size, hidden_size, intermediate_size, num_layers: V, D, MLP width, L.
    num_heads, num_kv_heads, head_dim: N, K (N % K == 0), H (even).
    rms_norm_eps: RMSNorm epsilon.
    rope_theta: RoPE base.
    rope_scaling: the checkpoint's built-in scaling (linear / llama3) or None.
    max_position_embeddings: trained context length (informational).
    tie_word_embeddings: the LM head is the transposed token embedding.
    qkv_bias: q/k/v projections have biases (qwen2; llama `attention_bias`).
    o_bias: output projection has a bias (llama `attention_bias`; never qwen2).
    sliding_window: attend only to the last `sliding_window` positions (mistral), or None.
    dtype: parameter and activation dtype: "float32", "bfloat16" or "float16". Norms, RoPE
      angles, softmax and logits are float32 regardless.
    attention_implementation: `pope_jax.rope_attention`'s implementation, per call: "xla"
      (reference, float32 scores), "cudnn" (NVIDIA GPUs: cuDNN flash attention; runs calls
      without cache, padding, explicit positions or sliding window, i.e. plain prefill and
      scoring, and raises NotImplementedError on the others), None (per call the first that
      runs: cuDNN where it can, else "xla"); "pallas" has no RoPE kernel and raises.
    bos_token_id, eos_token_ids, pad_token_id: special ids from the checkpoint (may be None/empty).
  """
  model_type: str = "llama"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  sliding_window: int | None = None
  dtype: str = "float32"
  attention_implementation: str | None = "xla"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __post_init__(self):
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"LlamaConfig.model_type must be one of {MODEL_TYPES}, got "
                       f"{self.model_type!r}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
        raise ValueError(f"LlamaConfig.{name} must be a positive int, got {getattr(self, name)!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"LlamaConfig.num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if not self.rms_norm_eps > 0:
      raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
    if not self.rope_theta > 1:
      raise ValueError(f"LlamaConfig.rope_theta must be > 1, got {self.rope_theta}")
    if self.dtype not in DTYPES:
      raise ValueError(f"LlamaConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
    if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"LlamaConfig.attention_implementation must be one of "
                       f"{ATTENTION_IMPLEMENTATIONS}, got {self.attention_implementation!r}")
    if self.attention_implementation == "cudnn" and self.dtype not in ("bfloat16", "float16"):
      raise ValueError(f"LlamaConfig.attention_implementation='cudnn' needs dtype bfloat16 or "
                       f"float16 (cuDNN flash attention), got dtype={self.dtype!r}")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"LlamaConfig.sliding_window must be positive or None, got "
                       f"{self.sliding_window}")

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], *, dtype: str = "float32",
                   where: str = "config.json") -> LlamaConfig:
    """From a Hugging Face `config.json` dict (transformers 4.x and 5.x layouts).

    RoPE: either `rope_theta` + `rope_scaling` (4.x; `type` or `rope_type`) or `rope_parameters`
    (5.x, holding `rope_theta` and the scaling fields).

    Raises:
      ValueError: unknown model_type, unsupported activation / rope type / mlp_bias, naming the
        field and `where`.
    """
    if "model_type" not in d:
      raise ValueError(f"{where}: missing required field 'model_type' (one of {MODEL_TYPES})")
    model_type = d["model_type"]
    if model_type not in MODEL_TYPES:
      raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported: "
                       f"{MODEL_TYPES}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
    if d.get("mlp_bias", False):
      raise ValueError(f"{where}: mlp_bias=true is not supported")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
      if d.get(key) is None:
        raise ValueError(f"{where}: missing required field {key!r}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings"):
      value = d.get(key)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value <= 0):
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    rope_params = d.get("rope_parameters")
    if rope_params is not None:
      if "rope_theta" not in rope_params and all(isinstance(v, dict) for v in rope_params.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters are not supported")
      rope_theta = float(rope_params.get("rope_theta", d.get("rope_theta", 10000.0)))
      scaling = RopeScaling.from_dict(rope_params, where=f"{where}: rope_parameters")
    else:
      rope_theta = float(d.get("rope_theta", 10000.0))
      rs = d.get("rope_scaling")
      scaling = None if rs is None else RopeScaling.from_dict(rs, where=f"{where}: rope_scaling")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
    n = int(d["num_attention_heads"])
    head_dim = d.get("head_dim") or d["hidden_size"] // n
    if model_type == "qwen2":
      qkv_bias, o_bias = True, False
      window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    else:
      qkv_bias = o_bias = bool(d.get("attention_bias", False))
      window = d.get("sliding_window") if model_type == "mistral" else None
    eos = d.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    try:  # The dataclass checks combinations (e.g. heads); name the file.
      return cls(
          model_type=model_type, vocab_size=int(d["vocab_size"]),
          hidden_size=int(d["hidden_size"]), intermediate_size=int(d["intermediate_size"]),
          num_layers=int(d["num_hidden_layers"]), num_heads=n,
          num_kv_heads=int(d.get("num_key_value_heads") or n), head_dim=int(head_dim),
          rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
          rope_scaling=scaling,
          max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
          tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
          o_bias=o_bias, sliding_window=window, dtype=dtype, bos_token_id=d.get("bos_token_id"),
          eos_token_ids=eos_ids, pad_token_id=d.get("pad_token_id"))
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None

  @classmethod
  def from_gguf_metadata(cls, meta: dict[str, Any], *, tied: bool, dtype: str = "float32",
                         where: str = "GGUF") -> LlamaConfig:
    """From GGUF key/value metadata (`general.architecture` = llama, mistral or qwen2).

    Args:
      meta: field name → value (e.g. "llama.block_count" → 30).
      tied: whether the file lacks an `output.weight` tensor (tied LM head).

    Raises:
      ValueError: unknown architecture, missing key, or unsupported rope scaling.
    """
    arch = meta.get("general.architecture")
    if arch not in MODEL_TYPES:
      raise ValueError(f"{where}: general.architecture {arch!r} is not supported; supported: "
                       f"{MODEL_TYPES}")

    def get(key, default=None, required=True):
      full = f"{arch}.{key}"
      if full not in meta:
        if required and default is None:
          raise ValueError(f"{where}: missing metadata key {full!r}")
        return default
      return meta[full]

    d = int(get("embedding_length"))
    n = int(get("attention.head_count"))
    kv = int(get("attention.head_count_kv", n))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", d // n)))
    if head_dim != int(get("rope.dimension_count", head_dim)):
      raise ValueError(f"{where}: partial rotary embedding (rope.dimension_count != head dim) is "
                       f"not supported")
    scaling = None
    rtype = get("rope.scaling.type", required=False)
    if rtype not in (None, "none"):
      if rtype != "linear":
        raise ValueError(f"{where}: {arch}.rope.scaling.type {rtype!r} is not supported")
      scaling = RopeScaling(rope_type="linear", factor=float(get("rope.scaling.factor")))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
      vocab = len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return cls(
        model_type=arch, vocab_size=int(vocab), hidden_size=d,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=n, num_kv_heads=kv, head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096)), tie_word_embeddings=tied,
        qkv_bias=arch == "qwen2", o_bias=False, dtype=dtype,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
