"""Baselines against LPES, all through the Llama model's `rope_multipliers` input or its config.

* PI (Chen et al., arXiv 2306.15595): one global scale s, angle (m/s)·θ_i (multiplier 1/s).
* Ms-PoE (Zhang et al., "Found in the Middle", arXiv 2403.04797; VITA-Group/Ms-PoE): per-head
  scales r_k = r_min + (r_max − r_min)·k/H, k = 0..H−1 (1.2 … 1.8), from layer 2 on (layers 0–1
  plain). Heads are ordered once per prompt at prefill by a position-awareness score computed on
  un-rotated q, k: A = softmax(q_last·Kᵀ/√d) over the causal keys of the last query row, score =
  fraction of keys with A > 4·mean(A) (the project spec's factor; the released code, commit
  a46c3d1, uses 3·mean: `ms_poe_scores(threshold=3.0)`). Heads are sorted by descending score.
  The released run scripts also switch the ordering off (`--head_type normal`: fixed reversed
  order) for gold positions 5, 7 and 10 of MDQA; this module always orders by score.
    - rank semantics (default, as the paper describes): the head with the k-th highest score gets
      r_k, i.e. ratio[order[k]] = r_k;
    - official indexing (`official_indexing=True`, as the released code does): the ratio table is
      indexed with the argsort permutation itself, ratio[h] = r_{order[h]}.
  With grouped-query attention a query head and its kv head must rotate alike, so heads are
  ordered per kv group (group score = mean of its query heads' scores) and the K groups get
  r_j = r_min + (r_max − r_min)·j/K; with K = N this is the per-head rule above.
  Here the scores of all layers come from one extra prefill pass of the unscaled model (q/k
  projections captured), so layer l ≥ 3 is ordered on hidden states of unscaled earlier layers
  whereas the official code orders each layer inside the scaled forward; layers 0–2 are exact.
* Attention Buckets (Chen et al., arXiv 2312.04455): the whole model once per RoPE base, each copy
  with its own KV cache (`lpes_jax.generate`'s prefill and decode steps); at every decoding step
  the copies' last-token logits ℓ_b are weighted by softmax_b(max_v ℓ_b[v]) and summed; the
  argmax is fed back to every copy.
* MoICE (Lin et al., arXiv 2406.19598) has trained routers and lives in `lpes_jax.moice`.

Shape letters: B batch, T tokens, N query heads, K kv heads, H head dim, L layers, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from lpes_jax.bezier import validate_scales
from lpes_jax.generate import decode_step, prefill
from lpes_jax.llama import Llama

# The RAG list of Attention Buckets for base-10 000 models.
BUCKET_BASES = (10000.0, 13000.0, 16000.0, 19000.0, 22000.0, 25000.0, 28000.0)


def pi_multipliers(scale: float) -> np.ndarray:
  """[] float32 global multiplier 1/s (Positional Interpolation).

  Raises:
    ValueError: s <= 0 or not finite.
  """
  return (1.0 / validate_scales(scale, name="PI scale")).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Ms-PoE


def ms_poe_scores(q: jax.Array, k: jax.Array, mask: jax.Array, *, threshold: float = 4.0):
  """Position-awareness score per head from un-rotated q, k (Ms-PoE `_calculate_outlier`).

  Args:
    q: [B, T, N, H] un-rotated queries; k: [B, T, K, H] un-rotated keys; mask: [B, T] bool, left
      padding False. The last row (position T−1) is the query.
    threshold: a key is an outlier when its weight exceeds threshold · mean weight.

  Returns:
    [B, N] float32: fraction of valid keys whose attention weight exceeds the threshold.
  """
  N, K = q.shape[2], k.shape[2]
  k = jnp.repeat(k, N // K, axis=2).astype(jnp.float32)                    # [B, T, N, H]
  ql = q[:, -1].astype(jnp.float32)                                         # [B, N, H]
  s = jnp.einsum("bnh,btnh->bnt", ql, k) / math.sqrt(q.shape[-1])          # [B, N, T]
  valid = mask[:, None, :]
  a = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
  count = jnp.sum(valid, axis=-1)                                           # [B, 1]
  mean = 1.0 / count                                                        # softmax sums to 1
  out = jnp.sum((a > threshold * mean[..., None]) & valid, axis=-1)
  return out / count


def ms_poe_ratios(scores: jax.Array, num_kv_heads: int, *, min_ratio: float = 1.2,
                  max_ratio: float = 1.8, start_layer: int = 2,
                  official_indexing: bool = False) -> jax.Array:
  """Per-head scale ratios from per-layer head scores.

  Args:
    scores: [..., L, N] position-awareness scores (`ms_poe_scores` per layer).
    num_kv_heads: K; heads are ranked per kv group so q and k of a head share a ratio.
    min_ratio, max_ratio: r_0 and the (exclusive) top of r_k = min + (max − min)·k/K.
    start_layer: layers before it keep ratio 1.
    official_indexing: ratio[g] = r_{order[g]} (released code) instead of the paper's rank
      semantics ratio[order[k]] = r_k.

  Returns:
    [..., L, N] float32 ratios (scales s; the multiplier is 1/s).
  """
  N = scores.shape[-1]
  group = scores.reshape(*scores.shape[:-1], num_kv_heads, N // num_kv_heads).mean(-1)  # [.., L, K]
  order = jnp.argsort(-group, axis=-1, stable=True)                          # heads by score desc
  table = min_ratio + (max_ratio - min_ratio) * jnp.arange(num_kv_heads) / num_kv_heads
  if official_indexing:
    ratio_k = table[order]
  else:
    rank = jnp.argsort(order, axis=-1)                                        # inverse permutation
    ratio_k = table[rank]
  ratio = jnp.repeat(ratio_k, N // num_kv_heads, axis=-1)                   # [.., L, N]
  layer = jnp.arange(scores.shape[-2])[:, None]
  return jnp.where(layer >= start_layer, ratio, 1.0).astype(jnp.float32)


def ms_poe_head_scores(model: Llama, params, tokens: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, L, N] scores from one prefill pass of the unscaled model (q/k projections captured)."""
  cfg = model.config
  _, state = model.apply(
      {"params": params}, tokens, attention_mask=mask, logits_to_keep=1,
      capture_intermediates=lambda mdl, _: mdl.name in ("q_proj", "k_proj"),
      mutable=["intermediates"])
  inter = state["intermediates"]
  B, T = tokens.shape
  out = []
  for i in range(cfg.num_layers):
    attn = inter[f"layers_{i}"]["self_attn"]
    q = attn["q_proj"]["__call__"][0].reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = attn["k_proj"]["__call__"][0].reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    out.append(ms_poe_scores(q, k, mask))
  return jnp.stack(out, axis=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MsPoEConfig:
  """Ms-PoE settings (defaults: the released code's).

  Attributes:
    min_ratio, max_ratio: range of the per-head scales.
    start_layer: first scaled layer.
    official_indexing: see `ms_poe_ratios`.
  """
  min_ratio: float = 1.2
  max_ratio: float = 1.8
  start_layer: int = 2
  official_indexing: bool = False

  def __post_init__(self):
    validate_scales([self.min_ratio, self.max_ratio], name="MsPoEConfig ratios")
    if self.max_ratio < self.min_ratio:
      raise ValueError(f"MsPoEConfig.max_ratio ({self.max_ratio}) < min_ratio ({self.min_ratio})")
    if self.start_layer < 0:
      raise ValueError(f"MsPoEConfig.start_layer must be >= 0, got {self.start_layer}")


def ms_poe_multipliers(model: Llama, params, tokens, mask, cfg: MsPoEConfig = MsPoEConfig()):
  """[B, L, N] per-prompt frequency multipliers 1/r (the extra scoring pass + ranking)."""
  scores = ms_poe_head_scores(model, params, tokens, mask)
  ratios = ms_poe_ratios(scores, model.config.num_kv_heads, min_ratio=cfg.min_ratio,
                         max_ratio=cfg.max_ratio, start_layer=cfg.start_layer,
                         official_indexing=cfg.official_indexing)
  return 1.0 / ratios


# ----------------------------------------------------------------------------------------------
# Attention Buckets


def bucket_bases(model_base: float, bases=BUCKET_BASES, *, relative: bool = True) -> tuple:
  """The bucket bases for a model: the RAG list as is (relative=False), or scaled by
  model_base / 10 000 so that the first bucket is the model's own base (default; for base-10 000
  models both are the same)."""
  b = validate_scales(bases, name="bucket bases")
  factor = model_base / 10000.0 if relative else 1.0
  return tuple(float(x) * factor for x in b)


def ensemble_logits(logits: jax.Array) -> jax.Array:
  """[Bk, B, V] per-base logits → [B, V]: Σ_b softmax_b(max_v ℓ_b[v]) · ℓ_b."""
  w = jax.nn.softmax(jnp.max(logits, axis=-1), axis=0)                     # [Bk, B]
  return jnp.einsum("kb,kbv->bv", w, logits)


def buckets_greedy(config, bases, params, tokens, mask, num_new: int) -> jax.Array:
  """Greedy decoding of the Attention Buckets ensemble.

  Args:
    config: the `LlamaConfig`; each copy uses `dataclasses.replace(config, rope_theta=base)`.
    bases: RoPE bases, one model copy (and KV cache) each.
    params: model parameters (shared by all copies).
    tokens: [B, T] int32 left-padded prompts; mask: [B, T] bool.
    num_new: tokens to generate.

  Returns:
    [B, num_new] int32.
  """
  configs = [dataclasses.replace(config, rope_theta=float(b)) for b in bases]
  caches, logits = [], []
  for c in configs:
    lg, cache = prefill(c, params, tokens, mask, None, tokens.shape[1] + num_new)
    caches.append(cache)
    logits.append(lg)
  first = jnp.argmax(ensemble_logits(jnp.stack(logits)), axis=-1).astype(jnp.int32)

  def step(carry, _):
    tok, caches = carry
    new_caches, logits = [], []
    for c, cache in zip(configs, caches):
      lg, cache = decode_step(c, params, tok, cache, None)
      new_caches.append(cache)
      logits.append(lg)
    nxt = jnp.argmax(ensemble_logits(jnp.stack(logits)), axis=-1).astype(jnp.int32)
    return (nxt, new_caches), nxt

  _, rest = jax.lax.scan(step, (first, caches), None, length=num_new - 1)
  return jnp.concatenate([first[:, None], rest.T], axis=1)
