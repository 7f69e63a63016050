"""PoPE and RoPE positional encodings, attention and Transformers in JAX.

Public API: encodings (`apply_rope`, `pope_cartesian`, frequencies), attention ops
(`pope_attention`, `rope_attention`, `dot_product_attention_reference`), positions and masks
(`pope_jax.positions`), the Flax layer `PositionalAttention`, the `Transformer` model and its
configs, its KV cache (`init_cache`) and generation (`generate`, `Sampling`: `pope_jax.generation`).
"""

from pope_jax.attention import dot_product_attention_reference, pope_attention, rope_attention
from pope_jax.config import MODEL_PRESETS, ModelConfig, TrainConfig, YarnConfig
from pope_jax.encodings import (
    apply_rope, clamp_phase_bias, init_phase_bias, layer_multipliers, pope_cartesian,
    pope_frequencies,
    rope_frequencies, scale_frequencies, yarn_attention_factor, yarn_frequencies)
from pope_jax.generation import Sampling, generate
from pope_jax.layers import PositionalAttention
from pope_jax.model import Transformer, init_cache

__all__ = [
    "MODEL_PRESETS", "ModelConfig", "PositionalAttention", "Sampling", "TrainConfig",
    "Transformer", "generate", "init_cache",
    "apply_rope", "clamp_phase_bias", "dot_product_attention_reference", "init_phase_bias",
    "layer_multipliers", "pope_attention", "pope_cartesian", "pope_frequencies",
    "rope_attention", "rope_frequencies", "scale_frequencies", "YarnConfig",
    "yarn_attention_factor", "yarn_frequencies",
]
