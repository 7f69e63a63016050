"""MoICE: a router in every attention head mixes the head's attention under several RoPE bases.

    mcfg = paper_config(config.rope_theta)                 # E = 7 bases, top-K = 7
    routers = init_routers(jax.random.key(0), config, mcfg)
    logits = Llama(config).apply({"params": params}, tokens, attention_mask=mask,
                                 attention=moice_attention(routers, config, mcfg))

Lin et al., "Mixture of In-Context Experts Enhance LLMs' Long Context Awareness", NeurIPS 2024
(arXiv 2406.19598), as in the authors' code (github.com/p1nksnow/MoICE, `modeling_llama.py`
and `training/train.sh`, commit 32a0102):

* Experts: E RoPE bases; for Llama-2 (base 10 000) {10 000, 17 500, 18 000, 19 000, 20 000,
  22 500, 25 000}. Here they are scaled by model_base / 10 000 (so the first is the model's own,
  as in the paper), like `baselines.bucket_bases`.
* Router (one per layer, shared by its heads, run on each head's query q_n [H] rotated by the
  first expert's RoPE at the token's position): logits = W2 · (silu(W1 q_n) ⊙ W3 q_n), W1, W3
  [E, H], W2 [E, E], no biases, initialised N(0, 0.02²) (the checkpoint's `initializer_range`).
* Weights: p = softmax(logits) over all E (float32); keep the top-K by logit, renormalise:
  w_e = p_e·[e ∈ topK] / Σ_{e' ∈ topK} p_e'.
* Output: the head's attention OUTPUTS are mixed, o_n = Σ_e w_{n,e} · softmax(q_n^e K^eᵀ/√H) V,
  with q^e, K^e rotated by expert e's frequencies (keys re-rotated at attention time from the
  raw keys in the KV cache, so cached decoding works).
* Auxiliary loss: the Switch / Mixtral load-balancing loss over the router logits of every
  layer, head and token, weight 0.3 (`load_balancing_loss`). The released settings use K = E = 7,
  for which this loss is the constant E (no gradient) and top-K keeps every expert.

Deviations: the load-balancing loss leaves out padding tokens (the released code counts them);
the expert weights and the mixture are float32 (the released code casts the weights to bf16).

Shape letters: B batch, T query length, S key length, N query heads, K kv heads, H head dim,
L layers, E experts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lpes_jax.baselines import bucket_bases
from lpes_jax.bezier import validate_scales
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import AttentionFn
from lpes_jax.rope_scaling import scaled_rope_frequencies
from pope_jax import atomic, encodings

Array = jax.Array
Routers = dict[str, Array]

# The released base set for Llama-2-7B-chat (rope base 10 000).
PAPER_BASES = (10000.0, 17500.0, 18000.0, 19000.0, 20000.0, 22500.0, 25000.0)
PAPER_TOP_K = 7
PAPER_AUX_LOSS_COEF = 0.3
ROUTER_INIT_STD = 0.02
METADATA_FILE = "moice.json"
ROUTERS_FOLDER = "routers"


class RoutersMismatch(ValueError):
  """Routers that do not fit the model (layers, head dim, experts)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoiceConfig:
  """The in-context experts and the router's settings.

  Attributes:
    bases: E RoPE bases, the model's own first (the router reads q rotated by it).
    top_k: K experts kept per head and token, 1 <= K <= E.
    aux_loss_coef: weight of the load-balancing loss in the training loss.
  """
  bases: tuple[float, ...]
  top_k: int = PAPER_TOP_K
  aux_loss_coef: float = PAPER_AUX_LOSS_COEF

  def __post_init__(self):
    if not self.bases:
      raise ValueError("MoiceConfig.bases must name at least one RoPE base")
    validate_scales(self.bases, name="MoiceConfig.bases")
    object.__setattr__(self, "bases", tuple(float(b) for b in self.bases))
    if not 1 <= self.top_k <= len(self.bases):
      raise ValueError(f"MoiceConfig.top_k must be in [1, {len(self.bases)}] (the number of "
                       f"bases), got {self.top_k}")
    if not (math.isfinite(self.aux_loss_coef) and self.aux_loss_coef >= 0):
      raise ValueError(f"MoiceConfig.aux_loss_coef must be finite and >= 0, got "
                       f"{self.aux_loss_coef}")

  @property
  def num_experts(self) -> int:
    return len(self.bases)


def paper_config(model_base: float) -> MoiceConfig:
  """The released settings (E = 7, K = 7, aux weight 0.3), bases scaled to `model_base`."""
  return MoiceConfig(bases=bucket_bases(model_base, PAPER_BASES))


def expert_frequencies(config: LlamaConfig, mcfg: MoiceConfig) -> np.ndarray:
  """[E, H/2] float32 RoPE frequencies of each expert (the checkpoint's rope_scaling applied)."""
  return np.stack([np.asarray(scaled_rope_frequencies(config.head_dim, b, config.rope_scaling),
                              np.float32) for b in mcfg.bases])


def init_routers(key: Array, config: LlamaConfig, mcfg: MoiceConfig, *,
                 std: float = ROUTER_INIT_STD) -> Routers:
  """Random routers: "w1", "w3" [L, H, E] and "w2" [L, E, E] float32, N(0, std²)."""
  L, H, E = config.num_layers, config.head_dim, mcfg.num_experts
  k1, k2, k3 = jax.random.split(key, 3)
  return {"w1": std * jax.random.normal(k1, (L, H, E), jnp.float32),
          "w2": std * jax.random.normal(k2, (L, E, E), jnp.float32),
          "w3": std * jax.random.normal(k3, (L, H, E), jnp.float32)}


def check_routers(routers: Any, config: LlamaConfig, mcfg: MoiceConfig, *,
                  name: str = "routers") -> None:
  """Raises RoutersMismatch (naming `name`) unless the routers fit the model and the experts."""
  L, H, E = config.num_layers, config.head_dim, mcfg.num_experts
  want = {"w1": (L, H, E), "w2": (L, E, E), "w3": (L, H, E)}
  if not isinstance(routers, dict) or set(routers) != set(want):
    got = sorted(routers) if isinstance(routers, dict) else type(routers).__name__
    raise RoutersMismatch(f"{name}: expected router leaves {sorted(want)}, got {got}")
  for leaf, shape in want.items():
    if tuple(np.shape(routers[leaf])) != shape:
      raise RoutersMismatch(
          f"{name}: {leaf} has shape {tuple(np.shape(routers[leaf]))}, but a model with "
          f"{L} layers and head dim {H} and {E} experts needs {shape}")


def router_logits(w: Routers, q: Array) -> Array:
  """Router logits W2·(silu(W1 q) ⊙ W3 q) of one layer.

  Args:
    w: one layer's routers, "w1", "w3" [H, E], "w2" [E, E].
    q: [B, T, N, H] queries (rotated by the first expert).

  Returns:
    [B, T, N, E] float32.
  """
  qf = q.astype(jnp.float32)
  hidden = jax.nn.silu(qf @ w["w1"]) * (qf @ w["w3"])                   # [B, T, N, E]
  return hidden @ w["w2"]


def routing_weights(logits: Array, top_k: int) -> Array:
  """[..., E] float32 mixture weights: softmax over all experts, kept on the top-K logits and
  renormalised (the released code's order: softmax, top-K mask, divide by the kept sum)."""
  p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  _, idx = jax.lax.top_k(logits, top_k)                                  # [..., K]
  keep = jnp.any(jax.nn.one_hot(idx, logits.shape[-1], dtype=bool), axis=-2)
  p = jnp.where(keep, p, 0.0)
  return p / jnp.sum(p, axis=-1, keepdims=True)


def moice_attention(routers: Routers, config: LlamaConfig, mcfg: MoiceConfig) -> AttentionFn:
  """The MoICE attention for `Llama(config).apply(..., attention=...)` (`llama.AttentionFn`).

  Each layer runs its router on the heads' queries, attends once per expert (the layer's own
  `rope_attention` call with the expert's frequencies) and mixes the E outputs [B, T, N, H] with
  the routing weights. It sows the router logits [B, T, N, E] float32 as "router_logits".

  Args:
    routers: "w1", "w3" [L, H, E], "w2" [L, E, E] float32 (may be traced).
    config: the model config; mcfg: the experts.
  """
  freqs = jnp.asarray(expert_frequencies(config, mcfg))                  # [E, H/2]

  def attention(layer, q, k, v, *, q_positions, attend):
    w = {name: leaf[layer] for name, leaf in routers.items()}
    q_router = encodings.apply_rope(q, q_positions, frequencies=freqs[0])
    logits = router_logits(w, q_router)                                 # [B, T, N, E]
    weights = routing_weights(logits, mcfg.top_k)
    out = sum(weights[..., e, None] * attend(q, k, v, frequencies=freqs[e]).astype(jnp.float32)
              for e in range(mcfg.num_experts))                         # [B, T, N, H]
    return out.astype(q.dtype), {"router_logits": logits}

  return attention


def load_balancing_loss(logits: Array, top_k: int, mask: Array | None = None) -> Array:
  """Switch-Transformer load-balancing loss (Fedus et al. 2021, eqs. 4–6; Mixtral's form).

  E · Σ_{k, e} f_{k,e} · P_e, with f_{k,e} the share of tokens whose k-th choice is expert e and
  P_e the mean router probability of e, over every leading index (layers, batch, tokens, heads).
  Balanced top-1 routing gives 1; with top_k == E it is the constant E.

  Args:
    logits: [L, B, T, N, E] router logits (any leading shape [..., E]).
    top_k: K.
    mask: None, or [B, T] bool (False: padding, left out), broadcast over the other axes.

  Returns:
    [] float32.
  """
  E = logits.shape[-1]
  p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  _, idx = jax.lax.top_k(p, top_k)
  chosen = jax.nn.one_hot(idx, E, dtype=jnp.float32)                      # [..., K, E]
  if mask is None:
    w = jnp.ones(logits.shape[:-1], jnp.float32)
  else:
    w = jnp.broadcast_to(mask.astype(jnp.float32)[None, :, :, None], logits.shape[:-1])
  lead = tuple(range(w.ndim))
  tokens_per_expert = jnp.sum(chosen * w[..., None, None], axis=lead) / jnp.sum(w)   # [K, E]
  prob_per_expert = jnp.sum(p * w[..., None], axis=lead) / jnp.sum(w)                # [E]
  return E * jnp.sum(tokens_per_expert * prob_per_expert[None, :])


def router_entropy(logits: Array, mask: Array | None = None) -> Array:
  """Mean entropy (nats) of the router distributions softmax(logits) over the E experts.

  log E for uniform routing (an untrained router), 0 for routing that picks one expert.

  Args:
    logits: [L, B, T, N, E] router logits.
    mask: None, or [B, T] bool (False: padding, left out).

  Returns:
    [] float32.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  h = -jnp.sum(jnp.exp(logp) * logp, axis=-1)                               # [L, B, T, N]
  if mask is None:
    return jnp.mean(h)
  w = jnp.broadcast_to(mask.astype(jnp.float32)[None, :, :, None], h.shape)
  return jnp.sum(h * w) / jnp.maximum(jnp.sum(w), 1.0)


def save_routers(directory: str | Path, routers: Routers, mcfg: MoiceConfig,
                 config: LlamaConfig) -> None:
  """Writes `directory/routers/` (orbax, atomic) and `directory/moice.json` (the experts and
  the model shape they fit), replacing earlier ones."""
  import orbax.checkpoint as ocp
  directory = Path(directory).absolute()
  check_routers(routers, config, mcfg)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(directory / ROUTERS_FOLDER, jax.tree.map(np.asarray, routers), force=True)
  atomic.write_json(directory / METADATA_FILE, {
      "bases": list(mcfg.bases), "top_k": mcfg.top_k, "aux_loss_coef": mcfg.aux_loss_coef,
      "num_layers": config.num_layers, "head_dim": config.head_dim,
      "num_experts": mcfg.num_experts})


def load_moice_config(directory: str | Path) -> tuple[MoiceConfig, dict]:
  """(MoiceConfig, the metadata dict) of a routers folder, without reading the routers.

  Raises:
    FileNotFoundError: no such folder, or no `moice.json` / `routers/` in it.
    ValueError: an unreadable or invalid `moice.json`.
  """
  directory = Path(directory)
  if not directory.is_dir():
    raise FileNotFoundError(f"{directory} is not a folder")
  meta_file = directory / METADATA_FILE
  if not meta_file.is_file() or not (directory / ROUTERS_FOLDER).is_dir():
    raise FileNotFoundError(f"{directory} holds no trained routers ({METADATA_FILE} and "
                            f"{ROUTERS_FOLDER}/, written by experiments.moice_train)")
  try:
    meta = json.loads(meta_file.read_text())
    mcfg = MoiceConfig(bases=tuple(meta["bases"]), top_k=meta["top_k"],
                       aux_loss_coef=meta["aux_loss_coef"])
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{meta_file}: not a MoICE router description ({e})") from e
  return mcfg, meta


def load_routers(directory: str | Path, config: LlamaConfig | None = None
                 ) -> tuple[Routers, MoiceConfig]:
  """(routers as float32 arrays, MoiceConfig) saved by `save_routers`.

  Raises:
    FileNotFoundError, ValueError: see `load_moice_config`.
    RoutersMismatch: `config` given and the routers do not fit it.
  """
  import orbax.checkpoint as ocp
  mcfg, _ = load_moice_config(directory)
  with ocp.StandardCheckpointer() as ckpt:
    routers = ckpt.restore(Path(directory).absolute() / ROUTERS_FOLDER)
  routers = {k: jnp.asarray(v, jnp.float32) for k, v in routers.items()}
  if config is not None:
    check_routers(routers, config, mcfg, name=str(directory))
  return routers, mcfg
