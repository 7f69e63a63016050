"""Baselines: PI, Ms-PoE scores and head ranking (paper vs official indexing, GQA), Buckets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpes_jax import baselines, generate
from lpes_jax.llama import Llama, init_params
from tests.lpes_jax.test_search import TINY


def test_pi():
  assert baselines.pi_multipliers(2.0) == np.float32(0.5)
  for bad in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError):
      baselines.pi_multipliers(bad)


def test_ms_poe_scores_hand_checked():
  # One head, head dim 1, 5 keys: q·k = 0 everywhere except a large logit on key 2, so the
  # softmax puts almost all mass there; mean weight is 1/5, only key 2 exceeds 4/5.
  q = jnp.ones((1, 5, 1, 1))
  k = jnp.asarray([0, 0, 10, 0, 0], jnp.float32).reshape(1, 5, 1, 1)
  mask = jnp.ones((1, 5), bool)
  np.testing.assert_allclose(baselines.ms_poe_scores(q, k, mask), [[0.2]])
  # Left padding: padded keys are excluded from the softmax and the count.
  q6 = jnp.ones((1, 6, 1, 1))
  k6 = jnp.asarray([10, 0, 0, 10, 0, 0], jnp.float32).reshape(1, 6, 1, 1)
  mask = jnp.asarray([[False, True, True, True, True, True]])                 # 5 valid, 1 outlier
  np.testing.assert_allclose(baselines.ms_poe_scores(q6, k6, mask), [[0.2]])


def test_ms_poe_rank_vs_official_indexing():
  scores = jnp.asarray([[0.0, 0.0, 0.0, 0.0]] * 2 + [[0.1, 0.4, 0.3, 0.2]])     # L=3, N=K=4
  r = np.asarray(baselines.ms_poe_ratios(scores, 4))
  table = 1.2 + 0.6 * np.arange(4) / 4
  np.testing.assert_array_equal(r[:2], 1.0)                                     # layers 0-1 plain
  # order (desc) = [1, 2, 3, 0]; paper: head 1 gets r_0, head 2 r_1, head 3 r_2, head 0 r_3.
  np.testing.assert_allclose(r[2], table[[3, 0, 1, 2]], rtol=1e-6)
  # official: ratio[h] = table[order[h]] = table[[1, 2, 3, 0]].
  off = np.asarray(baselines.ms_poe_ratios(scores, 4, official_indexing=True))
  np.testing.assert_allclose(off[2], table[[1, 2, 3, 0]], rtol=1e-6)


def test_ms_poe_gqa_groups_share_ratio():
  scores = jnp.asarray(np.random.default_rng(0).uniform(size=(5, 6)))           # N=6, K=2
  r = np.asarray(baselines.ms_poe_ratios(scores, 2))
  np.testing.assert_array_equal(r[:, 0::3], r[:, 1::3])
  np.testing.assert_array_equal(r[:, 0::3], r[:, 2::3])
  np.testing.assert_allclose(np.unique(r[2:]), [1.2, 1.5], rtol=1e-6)


def test_ms_poe_multipliers_on_model():
  model = Llama(TINY)
  params = init_params(TINY, jax.random.key(0), scale=0.3)
  t = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 9)), jnp.int32)
  m = jnp.ones_like(t, bool).at[1, :3].set(False)
  mult = np.asarray(baselines.ms_poe_multipliers(model, params, t, m))
  assert mult.shape == (2, 4, 4)
  np.testing.assert_array_equal(mult[:, :2], 1.0)
  np.testing.assert_allclose(np.sort(1 / mult[0, 2]), [1.2, 1.2, 1.5, 1.5], rtol=1e-6)


def test_ensemble_logits_hand_checked():
  l = jnp.asarray([[[0.0, 2.0]], [[1.0, 0.0]]])                                # [Bk=2, B=1, V=2]
  w = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
  np.testing.assert_allclose(baselines.ensemble_logits(l), [[w[1], 2 * w[0]]], rtol=1e-6)


def test_buckets_single_base_is_greedy_and_bases():
  model = Llama(TINY)
  params = init_params(TINY, jax.random.key(0), scale=0.3)
  t = jnp.asarray(np.random.default_rng(1).integers(3, 64, (2, 7)), jnp.int32)
  m = jnp.ones_like(t, bool)
  ref = generate.greedy_tokens(model.config, params, t, m, None, 4)
  out = baselines.buckets_greedy(TINY, (TINY.rope_theta,), params, t, m, 4)
  np.testing.assert_array_equal(out, ref)
  two = baselines.buckets_greedy(TINY, (100.0, 300.0), params, t, m, 4)
  assert two.shape == (2, 4)
  assert baselines.bucket_bases(100000.0)[:2] == (100000.0, 130000.0)
  assert baselines.bucket_bases(100000.0, relative=False)[0] == 10000.0
