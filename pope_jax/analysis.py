"""Analyses of trained models: frequency usage (PoPE §5) and zero-shot length extrapolation.

Frequency usage: how strongly each layer uses each frequency.

For every layer and frequency, the mean magnitude of the query and key components that carry that
frequency, over the tokens of held-out text and averaged over heads:

* RoPE: frequency i (θ_i = base^(-2i/H), i < H/2) rotates the pair (x_i, x_{i+H/2}) (Hugging Face
  half-split layout) or (x_{2i}, x_{2i+1}) (interleaved); its magnitude is the pair's 2-norm, which
  the rotation leaves unchanged, so it is read from the raw projection.
* PoPE: frequency c (θ_c = base^(-c/H), c < H) belongs to component c alone; its magnitude is
  softplus(x_c) (PoPE Eq. 3).

Both lists run from the highest frequency (index 0, θ = 1 rad/token) to the lowest. q and k are
read from the attention layers' "query"/"key" projections with Flax's `capture_intermediates`.
One number per layer summarises a row (`high_frequency_share`): the share of its magnitude in the
higher-frequency half of the frequency index (0.5 for uniform use); the paper's contrast is RoPE
low (suppressed high frequencies) and PoPE high in every layer but the first.

Length extrapolation (`perplexity_by_length`, PoPE Figure 2): a model trained at context L is
evaluated on held-out text cut into non-overlapping windows of each evaluation length, every token
predicted from the window's preceding tokens; the metric is the mean NLL per token of each length.

Shape letters: B batch, T length, N heads, H head dim, F frequencies (H/2 RoPE, H PoPE), L layers.
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

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


def layer_projections(config: ModelConfig, params: Any,
                       tokens: Array) -> list[tuple[Array, Array]]:
  """Per layer, the raw query and key projections ([B, T, N, H], [B, T, K, H], before
  rotation / softplus) of `tokens` [B, T], in the model's compute dtype."""
  _, state = Transformer(config).apply(
      {"params": params}, tokens, mutable=["intermediates"],
      capture_intermediates=lambda mdl, name: name == "__call__" and mdl.name in ("query", "key"))
  attn = [state["intermediates"][f"block_{i}"]["attn"] for i in range(config.num_layers)]
  return [(a["query"]["__call__"][0], a["key"]["__call__"][0]) for a in attn]


@functools.lru_cache(maxsize=8)    # One compile serves every seed of a config.
def _capture_qk(config: ModelConfig):
  def sums(params, tokens, weights):
    out = {"query": [], "key": []}
    for layer in layer_projections(config, params, tokens):
      for which, x in zip(("query", "key"), layer):
        mag = frequency_magnitudes(x, config.pos_encoding, rope_layout=config.rope_layout)
        out[which].append(jnp.einsum("btnf,bt->f", mag, weights) / mag.shape[2])
    return {which: jnp.stack(per_layer) for which, per_layer in out.items()}   # [L, F]

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


def high_frequency_share(usage: np.ndarray) -> np.ndarray:
  """Share of each row's magnitude in the higher-frequency half of the frequency index.

  Args:
    usage: [..., L, F] magnitudes, column 0 the highest frequency (`frequency_usage` rows).

  Returns:
    [..., L] float: sum of the first F // 2 columns over the sum of all (0.5 = uniform use).
  """
  usage = np.asarray(usage, np.float64)
  return usage[..., :usage.shape[-1] // 2].sum(-1) / usage.sum(-1)


def standard_errors_apart(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
  """Welch-style gap between two groups of seeds: (mean(a) - mean(b), that gap in standard errors).

  The standard error is sqrt(sd_a² / n_a + sd_b² / n_b) with sample standard deviations (n - 1);
  with fewer than two values in a group, or no spread at all, the second item is NaN.
  """
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  gap = float(a.mean() - b.mean())
  if len(a) < 2 or len(b) < 2:
    return gap, math.nan
  se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
  return gap, (gap / se if se > 0 else math.nan)


def attention_score_bytes(config: ModelConfig, batch_size: int, length: int) -> int:
  """Bytes of float32 attention scores the reference attention materialises in one layer.

  Logits, masked logits and probabilities of [B, N, T, T] float32 (3 copies): the dominant term
  of evaluation memory at long contexts with the XLA reference path (the fused PoPE kernel needs
  far less, so this is an upper bound there).
  """
  return 3 * 4 * batch_size * config.num_heads * length * length


def default_memory_budget() -> int:
  """Usable bytes: the first device's memory limit where JAX reports it, else half the host RAM."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def check_memory(config: ModelConfig, batch_size: int, lengths: Sequence[int],
                 memory_budget: int | None = None) -> None:
  """Refuses evaluation lengths whose attention scores (`attention_score_bytes`) exceed the
  memory budget (default `default_memory_budget()`).

  Raises:
    ValueError: naming the first such length, the batch size and the budget.
  """
  budget = default_memory_budget() if memory_budget is None else memory_budget
  for length in lengths:
    need = attention_score_bytes(config, batch_size, length)
    if need > budget:
      raise ValueError(
          f"evaluation length {length} at batch {batch_size} needs ~{need / 2**30:.1f} GiB of "
          f"attention scores per layer, over the {budget / 2**30:.1f} GiB budget; lower the "
          f"batch size or the length")


# (config, batch size, length) -> the compiled evaluation step, or its compile under way. One
# compile per process serves every seed's model of a config (and YaRN zero-shot and fine-tuned,
# which share theirs).
_EVAL_PROGRAMS: dict[tuple[ModelConfig, int, int], Future] = {}
_COMPILER: list[ThreadPoolExecutor] = []


def compile_perplexity_by_length(config: ModelConfig, params: Any, lengths: Sequence[int], *,
                                 batch_size: int = 1) -> None:
  """Starts compiling the programs `perplexity_by_length` needs for this model and returns at
  once: they compile in background threads (XLA compiles outside the GIL), concurrently with one
  another and with whatever runs next (e.g. training). Programs compiled or started before are
  not compiled again.

  Args:
    config, params: the model; params give the argument shapes (any seed of the config).
    lengths: evaluation context lengths.
    batch_size: windows per forward pass.
  """
  todo = [n for n in dict.fromkeys(lengths) if (config, batch_size, n) not in _EVAL_PROGRAMS]
  if not todo:
    return
  from pope_jax.train import weighted_metrics
  model = Transformer(config)
  step = jax.jit(lambda p, b: weighted_metrics(model.apply({"params": p}, b["inputs"]), b))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
  if not _COMPILER:
    _COMPILER.append(ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                        thread_name_prefix="compile"))
  for n in todo:     # Tracing holds the GIL: here, in turn; compiling: in the pool.
    tokens = jax.ShapeDtypeStruct((batch_size, n), jnp.int32)
    lowered = step.lower(abstract, {"inputs": tokens, "targets": tokens,
                                    "weights": jax.ShapeDtypeStruct((batch_size, n), jnp.float32)})
    _EVAL_PROGRAMS[(config, batch_size, n)] = _COMPILER[0].submit(lowered.compile)


def perplexity_by_length(config: ModelConfig, params: Any, token_file: str | os.PathLike,
                         lengths: Sequence[int], *, batch_size: int = 1,
                         max_tokens: int | None = None, dtype: str = "uint16",
                         memory_budget: int | None = None,
                         progress: bool = False) -> dict[int, dict[str, float]]:
  """Zero-shot evaluation of one model at several context lengths (PoPE Figure 2).

  Args:
    config, params: the model (a `config.rope_yarn` applies YaRN scaling at evaluation).
    token_file: held-out token file (`pope_jax.data.text` format).
    lengths: evaluation context lengths.
    batch_size: windows per forward pass.
    max_tokens: evaluate only the first ~max_tokens tokens of the file at every length
      (floor(max_tokens / length) windows, at least one), so that all lengths score the same
      text; None = the whole file.
    dtype: token dtype of the file.
    memory_budget: bytes the attention scores may take (default `default_memory_budget()`).
    progress: tqdm bar over lengths.

  One program per (config, batch size, length) is compiled per process
  (`compile_perplexity_by_length`, the lengths concurrently) and reused by later calls.

  Returns:
    {length: {"loss": mean NLL per token, "perplexity": exp(loss), "accuracy", "windows"}}.

  Raises:
    ValueError: a length whose attention scores would exceed the memory budget (checked for all
      lengths before any evaluation), or a file shorter than a window.
  """
  from tqdm.auto import tqdm

  from pope_jax.data.text import TokenWindowSource

  check_memory(config, batch_size, lengths, memory_budget)
  sources = {n: TokenWindowSource(Path(token_file), n, dtype=dtype) for n in lengths}
  compile_perplexity_by_length(config, params, lengths, batch_size=batch_size)
  programs = {n: _EVAL_PROGRAMS[(config, batch_size, n)].result() for n in lengths}
  params = jax.device_put(params)             # Once, not once per batch.
  out = {}
  for length in tqdm(list(lengths), desc="lengths", disable=not progress):
    source = sources[length]
    windows = len(source) if max_tokens is None else min(len(source),
                                                         max(1, max_tokens // length))
    total = {"nll_sum": 0.0, "correct_sum": 0.0, "weight_sum": 0.0}
    for start in range(0, windows, batch_size):
      recs = [source[i] for i in range(start, min(start + batch_size, windows))]
      recs += [{k: np.zeros_like(v) for k, v in recs[0].items()}] * (batch_size - len(recs))
      batch = {k: np.stack([r[k] for r in recs]) for k in recs[0]}
      m = jax.device_get(programs[length](params, batch))
      total = {k: total[k] + float(m[k]) for k in total}
    loss = total["nll_sum"] / total["weight_sum"]
    out[int(length)] = {"loss": loss, "perplexity": math.exp(loss),
                        "accuracy": total["correct_sum"] / total["weight_sum"],
                        "windows": windows}
  return out
