"""Frequency-usage analysis (PoPE §5 "frequency usage"): how strongly each layer uses each frequency.

For every layer and frequency, the mean magnitude of the query and key components that carry that
frequency, over the tokens of held-out text and averaged over heads:

* RoPE: frequency i (θ_i = base^(-2i/H), i < H/2) rotates the pair (x_i, x_{i+H/2}) (Hugging Face
  half-split layout) or (x_{2i}, x_{2i+1}) (interleaved); its magnitude is the pair's 2-norm, which
  the rotation leaves unchanged, so it is read from the raw projection.
* PoPE: frequency c (θ_c = base^(-c/H), c < H) belongs to component c alone; its magnitude is
  softplus(x_c) (PoPE Eq. 3).

Both lists run from the highest frequency (index 0, θ = 1 rad/token) to the lowest. q and k are
read from the attention layers' "query"/"key" projections with Flax's `capture_intermediates`.

Shape letters: B batch, T length, N heads, H head dim, F frequencies (H/2 RoPE, H PoPE), L layers.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from pope_jax import encodings
from pope_jax.config import ModelConfig
from pope_jax.model import Transformer

Array = jax.Array


def frequency_magnitudes(x: Array, pos_encoding: str, *, rope_layout: str = "half") -> Array:
  """Per-frequency magnitude of raw q or k projections.

  Args:
    x: [..., H] raw projections (before rotation / softplus).
    pos_encoding: "rope" or "pope".
    rope_layout: "half" (pairs i, i + H/2) or "interleaved" (pairs 2i, 2i + 1).

  Returns:
    [..., F] float32: RoPE pair 2-norms (F = H/2) or PoPE softplus magnitudes (F = H).

  Raises:
    ValueError: unknown encoding or layout.
  """
  x = x.astype(jnp.float32)
  if pos_encoding == "pope":
    return encodings.pope_magnitudes(x)
  if pos_encoding != "rope":
    raise ValueError(f"pos_encoding must be 'rope' or 'pope', got {pos_encoding!r}")
  if rope_layout == "half":
    a, b = jnp.split(x, 2, axis=-1)
  elif rope_layout == "interleaved":
    a, b = x[..., 0::2], x[..., 1::2]
  else:
    raise ValueError(f"rope_layout must be 'half' or 'interleaved', got {rope_layout!r}")
  return jnp.sqrt(a * a + b * b)


def frequencies(config: ModelConfig) -> np.ndarray:
  """[F] float32 frequencies (rad/token) in the order of `frequency_usage`'s columns."""
  if config.pos_encoding == "pope":
    return np.asarray(encodings.pope_frequencies(config.head_size, config.pope_base))
  return np.asarray(encodings.rope_frequencies(config.head_size, config.rope_base))


def _capture_qk(config: ModelConfig):
  model = Transformer(config)

  def sums(params, tokens, weights):
    _, state = model.apply(
        {"params": params}, tokens, mutable=["intermediates"],
        capture_intermediates=lambda mdl, name: name == "__call__" and mdl.name in ("query", "key"))
    inter = state["intermediates"]
    out = {}
    for which in ("query", "key"):
      per_layer = []
      for i in range(config.num_layers):
        x = inter[f"block_{i}"]["attn"][which]["__call__"][0]           # [B, T, N|K, H]
        mag = frequency_magnitudes(x, config.pos_encoding, rope_layout=config.rope_layout)
        per_layer.append(jnp.einsum("btnf,bt->f", mag, weights) / mag.shape[2])
      out[which] = jnp.stack(per_layer)                                   # [L, F]
    return out

  return jax.jit(sums)


def frequency_usage(config: ModelConfig, params: Any,
                    batches: Iterable[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """Mean per-(layer, frequency) magnitude of queries and keys over held-out tokens.

  Args:
    config: the model's config ("rope" or "pope").
    params: its parameters.
    batches: records batched as {"inputs": int [B, T], "weights": float [B, T]}; tokens with
      weight 0 (padding) are left out of the mean.

  Returns:
    {"query": [L, F], "key": [L, F], "frequencies": [F]} float32 numpy arrays, heads averaged.

  Raises:
    ValueError: a config without RoPE/PoPE, or no weighted token.
  """
  if config.pos_encoding not in ("rope", "pope"):
    raise ValueError(f"frequency usage needs pos_encoding 'rope' or 'pope', got "
                     f"{config.pos_encoding!r}")
  step = _capture_qk(config)
  total = {"query": 0.0, "key": 0.0}
  count = 0.0
  for batch in batches:
    w = jnp.asarray(batch["weights"], jnp.float32)
    sums = step(params, jnp.asarray(batch["inputs"], jnp.int32), w)
    total = {k: total[k] + np.asarray(sums[k]) for k in total}
    count += float(w.sum())
  if count == 0:
    raise ValueError("frequency_usage got no token with non-zero weight")
  return {"query": total["query"] / count, "key": total["key"] / count,
          "frequencies": frequencies(config)}
