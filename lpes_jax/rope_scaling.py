"""RoPE frequencies of pretrained Llama-family checkpoints: plain, linear (PI) and llama3 scaling.

One place for the checkpoint's *built-in* frequency scaling; LPES multipliers are applied on top of
these at run time (`pope_jax.encodings.scale_frequencies`). Shape letters: H head dim.

Sources:
  RoPE: RoFormer (arXiv 2104.09864) Eq. 15, θ_i = base^(-2i/H).
  linear: Chen et al., "Extending Context Window ... via Positional Interpolation", arXiv
    2306.15595: θ_i / factor (Hugging Face `_compute_linear_scaling_rope_parameters`).
  llama3: Meta's Llama 3.1 frequency schedule, exactly Hugging Face transformers'
    `modeling_rope_utils._compute_llama3_parameters`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """A checkpoint's RoPE scaling (Hugging Face `rope_scaling` / `rope_parameters`).

  Attributes:
    rope_type: "linear" or "llama3" ("default" means no scaling and is stored as None instead).
    factor: scale factor s (> 0); linear divides every frequency by it.
    low_freq_factor, high_freq_factor, original_max_position_embeddings: llama3 only.
  """
  rope_type: str
  factor: float
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  original_max_position_embeddings: int | None = None

  def __post_init__(self):
    if self.rope_type not in ("linear", "llama3"):
      raise ValueError(f"RopeScaling.rope_type must be 'linear' or 'llama3', got "
                       f"{self.rope_type!r}")
    if not self.factor > 0:
      raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
    if self.rope_type == "llama3":
      for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if getattr(self, name) is None:
          raise ValueError(f"RopeScaling.{name} is required for rope_type='llama3'")
      if not self.high_freq_factor > self.low_freq_factor:
        raise ValueError(f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                         f"low_freq_factor ({self.low_freq_factor})")

  @classmethod
  def from_dict(cls, d: dict, *, where: str = "rope_scaling") -> RopeScaling | None:
    """Parses a Hugging Face rope dict; accepts the legacy `type` key beside `rope_type`.

    Returns None for no scaling ("default" or a dict without a type).

    Raises:
      ValueError: unsupported type (dynamic, yarn, longrope, ...) or missing fields.
    """
    rope_type = d.get("rope_type", d.get("type"))
    if rope_type in (None, "default"):
      return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"{where}: rope type {rope_type!r} is not supported; supported: "
                       f"{SUPPORTED_ROPE_TYPES}")
    if "factor" not in d:
      raise ValueError(f"{where}: rope type {rope_type!r} needs 'factor'")
    omp = d.get("original_max_position_embeddings")
    return cls(
        rope_type=rope_type, factor=float(d["factor"]),
        low_freq_factor=None if d.get("low_freq_factor") is None else float(d["low_freq_factor"]),
        high_freq_factor=(None if d.get("high_freq_factor") is None
                          else float(d["high_freq_factor"])),
        original_max_position_embeddings=None if omp is None else int(omp))


def rope_inverse_frequencies(head_dim: int, base: float) -> np.ndarray:
  """θ_i = 1 / base^(2i/H) in float32, computed as Hugging Face does (RoFormer Eq. 15).

  Returns:
    [H/2] float32.

  Raises:
    ValueError: odd or non-positive head_dim, base <= 1.
  """
  if head_dim <= 0 or head_dim % 2:
    raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
  if not base > 1.0:
    raise ValueError(f"rope base must be > 1, got {base}")
  exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  return (np.float32(1.0) / np.power(np.float32(base), exponent)).astype(np.float32)


def llama3_frequencies(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
  """Llama 3.1 scaling: long wavelengths divided by factor, short kept, a smooth band between.

  wavelen = 2π/θ; θ/factor where wavelen > L_orig/low_freq_factor; θ where wavelen <
  L_orig/high_freq_factor; else (1 - a)·θ/factor + a·θ with a = (L_orig/wavelen - low) / (high -
  low). Exactly transformers' `_compute_llama3_parameters`.

  Args:
    inv_freq: [H/2] float32 unscaled frequencies.
    scaling: a "llama3" RopeScaling.

  Returns:
    [H/2] float32.
  """
  factor = scaling.factor
  low, high = scaling.low_freq_factor, scaling.high_freq_factor
  old_len = scaling.original_max_position_embeddings
  low_freq_wavelen = old_len / low
  high_freq_wavelen = old_len / high
  inv_freq = inv_freq.astype(np.float32)
  wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
  out = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
  smooth = ((np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low))
  smoothed = (1 - smooth) * out / np.float32(factor) + smooth * out
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, out).astype(np.float32)


def scaled_rope_frequencies(head_dim: int, base: float,
                            scaling: RopeScaling | None) -> np.ndarray:
  """The checkpoint's RoPE frequencies, for `pope_jax.encodings.apply_rope(frequencies=...)`.

  Args:
    head_dim: H.
    base: rope_theta.
    scaling: None, or a linear / llama3 RopeScaling.

  Returns:
    [H/2] float32 numpy array (a constant: no tracing, computed once per model).
  """
  inv_freq = rope_inverse_frequencies(head_dim, base)
  if scaling is None:
    return inv_freq
  if scaling.rope_type == "linear":
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
  return llama3_frequencies(inv_freq, scaling)
