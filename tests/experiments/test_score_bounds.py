"""The fused kernel's score bounds of a model (experiments.score_bounds): exact at zero
projections and against the PoPE formula in float64."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import score_bounds
from pope_jax import analysis, encodings
from pope_jax.config import ModelConfig
from pope_jax.model import Transformer


def _gqa_pope_model():
  cfg = ModelConfig(vocab_size=13, num_layers=1, d_model=64, num_heads=4, num_kv_heads=2,
                    pos_encoding="pope")
  tokens = jax.random.randint(jax.random.key(0), (2, 250), 0, 13)   # two 192-row tiles, padded
  params = Transformer(cfg).init(jax.random.key(1), tokens)["params"]
  return cfg, tokens, params


def test_score_bounds_exact_at_zero_projections():
  # q = k = 0 and δ = 0: every softplus is log 2, so the score at s = t is H·log²2/√H, i.e.
  # √H·log 2 in log2 units, and Cauchy-Schwarz is tight: bound == max |score| == √H·log 2.
  cfg, tokens, params = _gqa_pope_model()
  attn = params["block_0"]["attn"]
  for name in ("query", "key"):
    attn[name]["kernel"] = jnp.zeros_like(attn[name]["kernel"])
  attn["delta"] = jnp.zeros_like(attn["delta"])
  got = score_bounds.score_bounds(cfg, params, [{"inputs": tokens}])
  want = math.sqrt(cfg.head_size) * math.log(2)
  assert got["bound"].shape == got["max_score"].shape == (1, 2 * 4 * 2)   # [L, B·N·tiles]
  assert got["tile_rows"] == 192
  np.testing.assert_allclose(got["bound"], want, rtol=1e-5)
  np.testing.assert_allclose(got["max_score"], want, rtol=1e-5)


def test_score_bounds_match_the_pope_formula():
  # Σ_c μq_tc μk_sc cos((s - t)θ_c + δ_c) / √H in log2 units and the norm bound, by hand in
  # float64, with a random δ and the two kv heads' keys scaled apart so a wrong GQA mapping
  # (or scale, phase sign, positions) shows; large queries push tiles past the limit.
  cfg, tokens, params = _gqa_pope_model()
  h, n, g = cfg.head_size, cfg.num_heads, cfg.num_heads // cfg.kv_heads
  attn = params["block_0"]["attn"]
  attn["query"]["kernel"] = attn["query"]["kernel"] * 20
  attn["key"]["kernel"] = attn["key"]["kernel"].at[:, 1].multiply(60).at[:, 0].multiply(5)
  attn["delta"] = jax.random.uniform(jax.random.key(2), (n, h), minval=-2 * math.pi, maxval=0.)
  got = score_bounds.score_bounds(cfg, params, [{"inputs": tokens}])
  ((q, k),) = analysis.layer_projections(cfg, params, tokens)
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  mq, mk = np.logaddexp(0, q), np.repeat(np.logaddexp(0, k), g, axis=2)
  theta = np.asarray(encodings.pope_frequencies(h, cfg.pope_base), np.float64)
  t = np.arange(tokens.shape[1])
  phase = ((t[None, :] - t[:, None])[None, :, :, None] * theta
           + np.asarray(attn["delta"])[:, None, None])                     # [N, T, S, H]
  scores = np.einsum("btnc,bsnc,ntsc->bnts", mq, mk, np.cos(phase)) / math.sqrt(h) / math.log(2)
  per_row = np.pad(np.abs(scores).max(-1), ((0, 0), (0, 0), (0, 134)))   # T 250 -> 384
  np.testing.assert_allclose(got["max_score"][0], per_row.reshape(2, n, 2, 192).max(-1).ravel(),
                             rtol=1e-4)
  norm = lambda x: np.sqrt(((np.maximum(x, 0) + math.log(2)) ** 2).sum(-1))
  qn = np.pad(norm(q), ((0, 0), (0, 134), (0, 0))).reshape(2, 2, 192, n).max(2)   # [B, R, N]
  kn = np.repeat(norm(k).max(1), g, axis=1)                                       # [B, N]
  bound = (qn * kn[:, None]).transpose(0, 2, 1).ravel() / math.sqrt(h) / math.log(2)
  np.testing.assert_allclose(got["bound"][0], bound, rtol=1e-5)
  assert np.all(got["bound"] >= got["max_score"])
  assert 0 < np.mean(got["bound"] <= got["limit"]) < 1


def test_score_bounds_errors():
  cfg, tokens, params = _gqa_pope_model()
  with pytest.raises(ValueError, match="pope"):
    score_bounds.score_bounds(dataclasses.replace(cfg, pos_encoding="rope"), params,
                          [{"inputs": tokens}])
  with pytest.raises(ValueError, match="no batch"):
    score_bounds.score_bounds(cfg, params, [])
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    score_bounds.score_bounds(cfg, params, [{"inputs": tokens[:0]}])
