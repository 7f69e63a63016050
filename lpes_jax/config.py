"""LlamaConfig: the static description of a Llama-family decoder (llama, mistral, qwen2).

Built from a Hugging Face `config.json` (`LlamaConfig.from_hf_dict`) or from GGUF metadata
(`LlamaConfig.from_gguf_metadata`). Shapes and RoPE settings only: LPES multipliers are run-time
inputs of the model, never config fields.

Shape letters: D model width, N query heads, K kv heads, H head dim, L layers, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

from lpes_jax.rope_scaling import SUPPORTED_ROPE_TYPES, RopeScaling
from pope_jax.attention import check_implementation
from pope_jax.dtypes import canonical_dtype

MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "bfloat16", "float16")


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
    dtype: parameter and activation dtype, as JAX users write it (`jnp.bfloat16`,
      `np.dtype("float16")`, "bf16", ...); stored as its canonical name "float32", "bfloat16" or
      "float16". Norms, RoPE angles, softmax and logits are float32 regardless.
    attention_implementation: `pope_jax.rope_attention`'s implementation, per call: None (the
      default: per call the best available: on Hopper the split-K decoding kernel for T <= 16
      queries over a longer cache, then cuDNN flash attention on NVIDIA GPUs sm80+ in
      bf16/fp16, else "xla"), "xla" (the bit-reproducible reference, float32 scores), "cudnn"
      (cuDNN for every call, padded, cached and windowed included; NotImplementedError where it
      cannot run, e.g. float32 or off NVIDIA GPUs) or "pallas" (Hopper: the split-K decoding
      kernel, for calls of T <= 16 queries over a longer cache; raises on the others). Only the
      name is checked here (`pope_jax.attention.check_implementation`).
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
  attention_implementation: str | None = None
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "dtype", canonical_dtype(self.dtype, argument="dtype",
                                                      allowed=DTYPES))
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
    check_implementation(self.attention_implementation, "LlamaConfig.attention_implementation")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"LlamaConfig.sliding_window must be positive or None, got "
                       f"{self.sliding_window}")

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], *, dtype: Any = "float32",
                   source: str = "config.json") -> LlamaConfig:
    """From a Hugging Face `config.json` dict (transformers 4.x and 5.x layouts).

    RoPE: either `rope_theta` + `rope_scaling` (4.x; `type` or `rope_type`) or `rope_parameters`
    (5.x, holding `rope_theta` and the scaling fields). Every field read is type-checked as JSON
    writes it: booleans are true/false (never "false" or 0), numbers are finite JSON numbers,
    integers are integers (not 4.0, not true). Fields that are not read are not checked.

    Args:
      d: the parsed config.json.
      dtype: parameter dtype.
      source: where `d` came from (the file path), named in every error.

    Raises:
      ValueError: naming `source` and the field: a missing required field; a field of the wrong
        type or out of range; unknown model_type; unsupported activation, rope type, mlp_bias or
        partial rotary factor; a combination the dataclass refuses.
    """
    f = _Fields(d, source)
    model_type = f.string("model_type")
    if model_type not in MODEL_TYPES:
      raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: "
                       f"{MODEL_TYPES}")
    act = f.string("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    if f.boolean("mlp_bias", False):
      raise ValueError(f"{source}: mlp_bias=true is not supported")
    sizes = {key: f.integer(key, positive=True) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads")}
    n = sizes["num_attention_heads"]
    kv = f.integer("num_key_value_heads", None, nullable=True, positive=True)
    head_dim = f.integer("head_dim", None, nullable=True, positive=True)
    max_pos = f.integer("max_position_embeddings", None, nullable=True, positive=True)
    rope_theta, scaling = _hf_rope(f)
    if f.number("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported")
    if model_type == "qwen2":
      qkv_bias, o_bias = True, False
      use_window = f.boolean("use_sliding_window", False)
    else:
      qkv_bias = o_bias = f.boolean("attention_bias", False)
      use_window = model_type == "mistral"
    window = (f.integer("sliding_window", None, nullable=True, positive=True) if use_window
              else None)
    fields = dict(
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        tie_word_embeddings=f.boolean("tie_word_embeddings", False),
        bos_token_id=f.integer("bos_token_id", None, nullable=True),
        eos_token_ids=f.integers("eos_token_id"),
        pad_token_id=f.integer("pad_token_id", None, nullable=True))
    try:  # The dataclass checks ranges and combinations (e.g. heads); name the file.
      return cls(
          model_type=model_type, vocab_size=sizes["vocab_size"],
          hidden_size=sizes["hidden_size"], intermediate_size=sizes["intermediate_size"],
          num_layers=sizes["num_hidden_layers"], num_heads=n, num_kv_heads=kv or n,
          head_dim=head_dim or sizes["hidden_size"] // n, rope_theta=rope_theta,
          rope_scaling=scaling, max_position_embeddings=max_pos or 4096, qkv_bias=qkv_bias,
          o_bias=o_bias, sliding_window=window, dtype=dtype, **fields)
    except ValueError as e:
      raise ValueError(f"{source}: {e}") from None

  @classmethod
  def from_gguf_metadata(cls, meta: dict[str, Any], *, tied: bool, dtype: Any = "float32",
                         source: str = "GGUF metadata") -> LlamaConfig:
    """From GGUF key/value metadata (`general.architecture` = llama, mistral or qwen2).

    GGUF values are typed; each key read must hold the kind meant (an integer for counts, a
    number for epsilons and bases, a string for types), so a file written with, e.g., a float or
    string block count is refused rather than rounded or parsed.

    Args:
      meta: field name → value (e.g. "llama.block_count" → 30).
      tied: whether the file lacks an `output.weight` tensor (tied LM head).
      dtype: parameter dtype.
      source: where `meta` came from (the file path), named in every error.

    Raises:
      ValueError: naming `source` and the key: unknown architecture, missing key, a value of the
        wrong type, unsupported rope scaling or partial rotary embedding, a combination the
        dataclass refuses.
    """
    arch = meta.get("general.architecture")
    if arch not in MODEL_TYPES:
      raise ValueError(f"{source}: general.architecture {arch!r} is not supported; supported: "
                       f"{MODEL_TYPES}")
    f = _Fields(meta, source, noun="metadata key")
    d = f.integer(f"{arch}.embedding_length", positive=True)
    n = f.integer(f"{arch}.attention.head_count", positive=True)
    rope_dim = f.integer(f"{arch}.rope.dimension_count", None, positive=True)
    head_dim = f.integer(f"{arch}.attention.key_length",
                         rope_dim if rope_dim is not None else d // n, positive=True)
    if rope_dim is not None and rope_dim != head_dim:
      raise ValueError(f"{source}: partial rotary embedding (rope.dimension_count != head dim) "
                       f"is not supported")
    rtype = f.string(f"{arch}.rope.scaling.type", None)
    if rtype not in (None, "none", "linear"):
      raise ValueError(f"{source}: {arch}.rope.scaling.type {rtype!r} is not supported")
    factor = f.number(f"{arch}.rope.scaling.factor") if rtype == "linear" else None
    vocab = f.integer(f"{arch}.vocab_size", None, positive=True)
    if vocab is None:
      if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{source}: missing required metadata key '{arch}.vocab_size' (and no "
                         f"tokenizer.ggml.tokens to count)")
      vocab = len(meta["tokenizer.ggml.tokens"])
    eos = f.integer("tokenizer.ggml.eos_token_id", None)
    fields = dict(
        intermediate_size=f.integer(f"{arch}.feed_forward_length", positive=True),
        num_layers=f.integer(f"{arch}.block_count", positive=True),
        num_kv_heads=f.integer(f"{arch}.attention.head_count_kv", n, positive=True),
        rms_norm_eps=f.number(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=f.number(f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=f.integer(f"{arch}.context_length", 4096, positive=True),
        bos_token_id=f.integer("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (eos,),
        pad_token_id=f.integer("tokenizer.ggml.padding_token_id", None))
    try:  # The dataclasses check ranges and combinations (e.g. heads); name the file.
      scaling = None if factor is None else RopeScaling(rope_type="linear", factor=factor)
      return cls(model_type=arch, vocab_size=vocab, hidden_size=d, num_heads=n,
                 head_dim=head_dim, rope_scaling=scaling, tie_word_embeddings=tied,
                 qkv_bias=arch == "qwen2", o_bias=False, dtype=dtype, **fields)
    except ValueError as e:
      raise ValueError(f"{source}: {e}") from None


_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class _Fields:
  """Typed reads of one config mapping; every error names the source file and the field.

  A field that is absent takes its default (absent with no default: "missing required"). JSON null
  is accepted only where `nullable` (it then reads as None); otherwise it is a type error.
  """
  values: Mapping[str, Any]
  source: str
  prefix: str = ""        # How nested fields are named, e.g. "rope_scaling.".
  noun: str = "field"

  def _raw(self, key: str, default: Any, nullable: bool) -> tuple[bool, Any]:
    """(present, value): present is False when the default (or None for null) applies."""
    if key not in self.values or (self.values[key] is None and default is _REQUIRED):
      if default is _REQUIRED:
        null = " (it is null)" if key in self.values else ""
        raise ValueError(f"{self.source}: missing required {self.noun} "
                         f"'{self.prefix}{key}'{null}")
      return False, default
    if self.values[key] is None and nullable:
      return False, None
    return True, self.values[key]

  def error(self, key: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{self.source}: {self.noun} '{self.prefix}{key}' must be {expected}, got "
                      f"{_show(value)}")

  def integer(self, key: str, default: Any = _REQUIRED, *, nullable: bool = False,
              positive: bool = False) -> int | None:
    present, value = self._raw(key, default, nullable)
    if not present:
      return value
    if not _is_int(value) or (positive and value <= 0):
      raise self.error(key, "a positive integer" if positive else "an integer", value)
    return int(value)

  def integers(self, key: str) -> tuple[int, ...]:
    """An integer or a list of integers (e.g. eos_token_id); absent or null: ()."""
    value = self.values.get(key)
    if value is None:
      return ()
    items = value if isinstance(value, list) else [value]
    if not all(_is_int(v) for v in items):
      raise self.error(key, "an integer or a list of integers", value)
    return tuple(int(v) for v in items)

  def number(self, key: str, default: Any = _REQUIRED, *, nullable: bool = False
             ) -> float | None:
    present, value = self._raw(key, default, nullable)
    if not present:
      return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise self.error(key, "a number", value)
    if not math.isfinite(value):
      raise self.error(key, "a finite number", value)
    return float(value)

  def boolean(self, key: str, default: Any = _REQUIRED) -> bool:
    present, value = self._raw(key, default, False)
    if present and not isinstance(value, bool):
      raise self.error(key, "a boolean (true or false)", value)
    return value

  def string(self, key: str, default: Any = _REQUIRED) -> str | None:
    present, value = self._raw(key, default, False)
    if present and not isinstance(value, str):
      raise self.error(key, "a string", value)
    return value

  def mapping(self, key: str) -> _Fields | None:
    """A nested object (absent or null: None), read with the same source and a dotted name."""
    present, value = self._raw(key, None, True)
    if not present:
      return None
    if not isinstance(value, Mapping):
      raise self.error(key, "an object", value)
    return _Fields(value, self.source, f"{self.prefix}{key}.", self.noun)


def _is_int(value: Any) -> bool:
  """An integer that is not a boolean (numpy integers from GGUF included)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _show(value: Any) -> str:
  """A value as its file wrote it: null / true / false for JSON's, repr otherwise."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "true" if value else "false"
  return repr(value)


def _hf_rope(f: _Fields) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` +
  `rope_scaling` (4.x), type-checked before `RopeScaling.from_dict` converts them."""
  params = f.mapping("rope_parameters")
  if params is not None:
    if "rope_theta" not in params.values and params.values and all(
        isinstance(v, Mapping) for v in params.values.values()):
      raise ValueError(f"{f.source}: per-layer-type rope_parameters are not supported")
    theta = params.number("rope_theta", None)
    rope = params
  else:
    theta, rope = None, f.mapping("rope_scaling")
  if theta is None:
    theta = f.number("rope_theta", 10000.0)
  if rope is None:
    return theta, None
  type_key = "rope_type" if "rope_type" in rope.values else "type"
  rope_type = rope.string(type_key, None)
  if rope_type in SUPPORTED_ROPE_TYPES and rope_type != "default":
    rope.number("factor", None)
    rope.number("low_freq_factor", None, nullable=True)
    rope.number("high_freq_factor", None, nullable=True)
    rope.integer("original_max_position_embeddings", None, nullable=True, positive=True)
  where = f"{f.source}: {rope.prefix[:-1]}"
  try:
    return theta, RopeScaling.from_dict(dict(rope.values), where=where)
  except ValueError as e:  # from_dict names `where`; RopeScaling's own range checks do not.
    message = str(e)
    raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None
