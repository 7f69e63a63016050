"""Model and training configuration: frozen dataclasses, validated on construction, and presets.

Presets are built from a base with `dataclasses.replace` and live in `MODEL_PRESETS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

from pope_jax.attention import check_implementation
from pope_jax.dtypes import canonical_dtype

PosEncoding = Literal["rope", "pope", "none"]
POS_ENCODINGS = ("rope", "pope", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnConfig:
  """YaRN RoPE scaling (Peng et al., arXiv 2309.00071); see `encodings.yarn_frequencies`.

  Attributes:
    factor: context extension factor s.
    original_max_position: the training context length the ramp is computed from.
    beta_fast, beta_slow: ramp bounds in rotations over the original context (32 and 1).
    attention_factor: None (0.1·ln(s) + 1) or an explicit value used verbatim; q and k are each
      scaled by it (logits by its square), as Hugging Face scales cos and sin.
  """
  factor: float
  original_max_position: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None

  def __post_init__(self):
    if not self.factor > 0:
      raise ValueError(f"YarnConfig.factor must be positive, got {self.factor}")
    if self.original_max_position <= 0:
      raise ValueError(f"YarnConfig.original_max_position must be positive, got "
                       f"{self.original_max_position}")
    if not self.beta_fast > self.beta_slow > 0:
      raise ValueError(f"YarnConfig needs beta_fast > beta_slow > 0, got {self.beta_fast} and "
                       f"{self.beta_slow}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """A decoder-only Transformer with pre-norm RMSNorm blocks.

  Attributes:
    vocab_size: number of token ids.
    num_layers, d_model, num_heads: L, D, N.
    num_kv_heads: K for grouped-query attention (default: num_heads).
    head_dim: H (default: d_model // num_heads).
    mlp_dim: hidden width of the GELU MLP (default 4·D).
    pos_encoding: "rope", "pope" or "none".
    rope_base, pope_base: frequency bases (PoPE App. A uses 10 000 for both).
    delta_init: PoPE phase-bias init, "uniform" (U(-2π, 0)) or "zeros".
    dropout_rate: dropout after attention and MLP (and on embeddings).
    attention_dropout: dropout on the attention probabilities in training (0 = none). It runs
      only in the XLA reference attention: with a rate above 0, training takes that path
      (`attention_implementation` None or "xla"; a named fused path refuses it), and evaluation
      without dropout keeps the fused ones.
    tie_embeddings: share the token embedding with the output head.
    dtype: compute dtype, float32 or bfloat16 as JAX users write it (`jnp.bfloat16`,
      `np.dtype("float32")`, "bf16", ...); stored as its canonical name. Params stay float32.
    logits_dtype: dtype of the returned logits: float32 (any spelling, stored "float32"), or
      "compute" (`dtype`). The head
      multiplies in `dtype` either way, so "compute" loses nothing; it only skips the float32
      copy of the [B, T, V] logits (3.3 GB for GPT-2-124M at 16 × 1024 tokens). Take the loss
      with `pope_jax.train.cross_entropy_with_integer_labels`, which upcasts inside.
    attention_implementation: None (per call the best available: for PoPE the Pallas kernel on
      Hopper, else cuDNN on NVIDIA GPUs sm80+, else the XLA reference; for RoPE cuDNN, else the
      reference; decoding steps take the split-K decoding kernel on Hopper) or one of
      `pope_jax.attention.IMPLEMENTATIONS` ("xla", "cudnn", "pallas"), passed to every
      attention call as it is: a call it cannot run raises NotImplementedError saying why (e.g.
      "pallas" with a RoPE prefill). Only the name is checked here.
    kv_cache_keys: what the KV cache (`pope_jax.model.init_cache`) holds as keys, for RoPE and
      PoPE: "mapped" (default) the keys as attention reads them, rotated by RoPE or in PoPE's
      Cartesian form [B, S, K, 2H] (twice the raw keys' memory), written once per token; "raw"
      the projections [B, S, K, H], mapped again over the whole cache at every step (valid for
      any multiplier passed per call). experiments.bench_decode times both.
    rope_layout: "half" (Hugging Face) or "interleaved".
    rope_yarn: None, or YaRN frequency interpolation and attention temperature (RoPE only).
    init_std: None keeps Flax's default initialisers (LeCun-normal projections, embedding std
      1/sqrt(D)); a float gives the GPT-2/nanoGPT scheme: every projection and the embedding
      ~ N(0, init_std²), the two residual output projections per block (attention out, MLP out)
      ~ N(0, (init_std/sqrt(2L))²). The PoPE paper does not state its initialisation; its
      hyper-parameters are nanoGPT's, so 0.02 is the documented assumption (overridable).
  """
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int | None = None
  mlp_dim: int | None = None
  pos_encoding: PosEncoding = "pope"
  rope_base: float = 10000.0
  pope_base: float = 10000.0
  delta_init: str = "uniform"
  dropout_rate: float = 0.0
  attention_dropout: float = 0.0
  tie_embeddings: bool = True
  dtype: Any = "float32"
  logits_dtype: Any = "float32"
  attention_implementation: str | None = None
  kv_cache_keys: str = "mapped"
  rope_layout: str = "half"
  rope_yarn: YarnConfig | None = None
  init_std: float | None = 0.02

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
                 "mlp_dim"):
      value = getattr(self, name)
      if value is None and name in ("num_kv_heads", "head_dim", "mlp_dim"):
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
    for name in ("rope_base", "pope_base"):
      if not getattr(self, name) > 1.0:
        raise ValueError(f"ModelConfig.{name} must be > 1, got {getattr(self, name)!r}")
    check_implementation(self.attention_implementation, "ModelConfig.attention_implementation")
    if self.kv_cache_keys not in ("mapped", "raw"):
      raise ValueError(f"ModelConfig.kv_cache_keys must be 'mapped' or 'raw', got "
                       f"{self.kv_cache_keys!r}")
    if self.pos_encoding not in POS_ENCODINGS:
      raise ValueError(
          f"ModelConfig.pos_encoding must be one of {POS_ENCODINGS}, got {self.pos_encoding!r}")
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(f"ModelConfig.d_model={self.d_model} is not divisible by "
                       f"num_heads={self.num_heads}; set head_dim explicitly")
    if self.kv_heads <= 0 or self.num_heads % self.kv_heads:
      raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.kv_heads}")
    if self.pos_encoding == "rope" and self.head_size % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_size}")
    if self.delta_init not in ("uniform", "zeros"):
      raise ValueError(f"ModelConfig.delta_init must be 'uniform' or 'zeros', got "
                       f"{self.delta_init!r}")
    # Frozen: store the canonical names (hashable, JSON-friendly, equal to saved configs).
    object.__setattr__(self, "dtype", canonical_dtype(
        self.dtype, argument="ModelConfig.dtype", allowed=("float32", "bfloat16")))
    if not (isinstance(self.logits_dtype, str) and self.logits_dtype == "compute"):
      try:
        logits_dtype = canonical_dtype(self.logits_dtype, argument="ModelConfig.logits_dtype",
                                       allowed=("float32",))
      except (TypeError, ValueError):
        raise ValueError(f"ModelConfig.logits_dtype must be float32 or 'compute', got "
                         f"{self.logits_dtype!r}") from None
      object.__setattr__(self, "logits_dtype", logits_dtype)
    if self.rope_layout not in ("half", "interleaved"):
      raise ValueError(f"ModelConfig.rope_layout must be 'half' or 'interleaved', got "
                       f"{self.rope_layout!r}")
    if self.rope_yarn is not None and self.pos_encoding != "rope":
      raise ValueError(f"ModelConfig.rope_yarn needs pos_encoding='rope', got "
                       f"{self.pos_encoding!r}")
    if self.init_std is not None and not (
        isinstance(self.init_std, (int, float)) and not isinstance(self.init_std, bool)
        and 0 < self.init_std < float("inf")):
      raise ValueError(f"ModelConfig.init_std must be None or > 0, got {self.init_std!r}")
    for name in ("dropout_rate", "attention_dropout"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"ModelConfig.{name} must be in [0, 1), got {getattr(self, name)}")

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def head_size(self) -> int:
    return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

  @property
  def mlp_size(self) -> int:
    return 4 * self.d_model if self.mlp_dim is None else self.mlp_dim


_BASE = ModelConfig(vocab_size=256, num_layers=8, d_model=512, num_heads=8)

MODEL_PRESETS: dict[str, ModelConfig] = {
    # PoPE App. A: indirect indexing, 8 layers, d_model 512, 8 heads, δ ~ U(-2π, 0), no dropout.
    "indirect_indexing": _BASE,
    # PoPE App. A: JSB chorales, 6 layers, d_model 256, 8 heads, dropout 0.2.
    "jsb": dataclasses.replace(_BASE, num_layers=6, d_model=256, dropout_rate=0.2),
    # GPT-2 shapes of the OpenWebText runs (head dim 64, δ init zeros, vocab 50 304).
    "gpt2_124m": dataclasses.replace(_BASE, vocab_size=50304, num_layers=12, d_model=768,
                                     num_heads=12, delta_init="zeros"),
    "gpt2_253m": dataclasses.replace(_BASE, vocab_size=50304, num_layers=16, d_model=1024,
                                     num_heads=16, delta_init="zeros"),
    "gpt2_774m": dataclasses.replace(_BASE, vocab_size=50304, num_layers=36, d_model=1280,
                                     num_heads=20, delta_init="zeros"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """Optimisation and bookkeeping for `pope_jax.train.train_and_evaluate`.

  Attributes:
    steps: optimiser steps.
    batch_size: global batch (split over all devices; must divide evenly).
    learning_rate, min_learning_rate: peak lr and the floor of the cosine decay.
    warmup_steps: linear warm-up from 0 to the peak.
    b1, b2, weight_decay, grad_clip: AdamW and global-norm clipping.
    eval_every: evaluate every this many steps (and at the end).
    eval_batches: batches per periodic evaluation of each split (None = the whole split); the
      final evaluation always reads whole splits.
    checkpoint_every: save an orbax checkpoint every this many steps (and at the end).
    log_every: write a metrics line every this many steps.
    seed: model init, dropout and data order.
    steps_per_call: optimiser steps fused into one jitted call with `lax.scan` (amortises dispatch).
    data_workers: grain worker processes (0 = in-process).
    fsdp: shard parameters and optimiser state over the devices (FSDP) instead of replicating.
    select_split: None, or the name of an evaluation split (e.g. "valid") that selects a
      checkpoint: at each periodic evaluation (every `eval_every` steps and at the end, on
      `eval_batches` batches or the whole split) the parameters with the lowest loss on it so far
      are kept in the checkpointed state beside the latest ones, and the results report every
      split at that step as well as at the last.
  """
  steps: int
  batch_size: int
  learning_rate: float
  min_learning_rate: float
  warmup_steps: int
  b1: float = 0.9
  b2: float = 0.99
  weight_decay: float = 0.01
  grad_clip: float = 1.0
  eval_every: int = 1000
  eval_batches: int | None = None
  checkpoint_every: int = 1000
  log_every: int = 100
  seed: int = 0
  steps_per_call: int = 1
  data_workers: int = 0
  fsdp: bool = False
  select_split: str | None = None

  def __post_init__(self):
    if self.select_split is not None and not (isinstance(self.select_split, str)
                                              and self.select_split):
      raise ValueError(f"TrainConfig.select_split must be None or a split name, got "
                       f"{self.select_split!r}")
    for name in ("steps", "batch_size", "eval_every", "checkpoint_every", "log_every",
                 "steps_per_call"):
      if getattr(self, name) <= 0:
        raise ValueError(f"TrainConfig.{name} must be positive, got {getattr(self, name)}")
    if self.warmup_steps < 0 or self.data_workers < 0:
      raise ValueError("TrainConfig.warmup_steps and data_workers must be >= 0")
    if self.eval_batches is not None and self.eval_batches <= 0:
      raise ValueError(f"TrainConfig.eval_batches must be None (whole split) or positive, got "
                       f"{self.eval_batches}")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
    if not self.grad_clip > 0 or self.weight_decay < 0:
      raise ValueError(f"TrainConfig needs grad_clip > 0 and weight_decay >= 0, got "
                       f"{self.grad_clip} and {self.weight_decay}")
    if not 0 < self.min_learning_rate <= self.learning_rate:
      raise ValueError(f"TrainConfig needs 0 < min_learning_rate <= learning_rate, got "
                       f"{self.min_learning_rate} and {self.learning_rate}")
    for name in ("steps", "eval_every", "checkpoint_every", "log_every"):
      if getattr(self, name) % self.steps_per_call:
        raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be a multiple of "
                         f"steps_per_call={self.steps_per_call}")


def config_diff(saved: Any, new: Any, ignore: Sequence[str] = (), prefix: str = "") -> list[str]:
  """Dotted names of the fields in which two JSON configs differ (e.g. "train.batch_size"),
  leaving out the dotted names in `ignore`."""
  if prefix in ignore:
    return []
  if not (isinstance(saved, dict) and isinstance(new, dict)):
    return [] if saved == new else [prefix or "(whole file)"]
  return [d for k in sorted(set(saved) | set(new), key=str)
          for d in config_diff(saved.get(k), new.get(k), ignore, f"{prefix}.{k}".lstrip("."))]
