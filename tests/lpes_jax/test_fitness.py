"""The teacher-forced fitness: right-padded rows, chunked populations, and the fused path against
the reference on the real SmolLM2 search set."""

import dataclasses

import jax
import numpy as np
import pytest

from lpes_jax import evaluate, fitness
from lpes_jax.llama import init_params
from lpes_jax.tasks.task import TaskConfig
from tests.lpes_jax.test_search import TINY


def test_teacher_forced_inputs_right_padded():
  batch = fitness.make_batch([[7, 8, 9], [5]], [[1, 2], [3]], [0, 1])
  tokens, at, targets, tmask = fitness.teacher_forced_inputs(batch, bucket=4)
  # Row 0: 7 8 9 1 (the last answer token is only a target); row 1: 5.
  np.testing.assert_array_equal(tokens, [[7, 8, 9, 1], [5, 0, 0, 0]])
  np.testing.assert_array_equal(targets, [[1, 2], [0, 3]])
  np.testing.assert_array_equal(tmask, [[True, True], [False, True]])
  np.testing.assert_array_equal(at[0], [2, 3])            # 9 predicts 1, 1 predicts 2
  assert at[1, 1] == 0                                    # 5 predicts 3
  padded = fitness.pad_batch(batch, 9)                    # a longer shared prompt length
  assert fitness.teacher_forced_inputs(padded, bucket=4)[0].shape == (2, 12)


def test_candidate_batch_matches_one_call():
  params = init_params(TINY, jax.random.key(1), scale=0.3)
  rng = np.random.default_rng(0)
  batch = fitness.make_batch([list(rng.integers(3, 64, rng.integers(4, 10))) for _ in range(6)],
                             [list(rng.integers(3, 64, 2)) for _ in range(6)], [0, 1, 2] * 2)
  forward = fitness.llama_fitness_fns(TINY)[0]
  mults = 1 / rng.uniform(1, 2, (5, TINY.num_layers))
  whole = fitness.make_fitness_fn(params, batch, forward=forward, example_batch=4)(mults)
  chunked = fitness.make_fitness_fn(params, batch, forward=forward, example_batch=4,
                                    candidate_batch=2)(mults)
  np.testing.assert_array_equal(chunked, whole)
  with pytest.raises(ValueError, match="candidate_batch"):
    fitness.fitness_fn_factory(params, forward=forward, candidate_batch=0)


@pytest.fixture(scope="module")
def smollm2_search_set(smollm2, smollm2_tokenizer):
  """(config, params, batch, multipliers): 9 KV search examples (6 pairs, 4-hex keys and values,
  seed 0) and three candidates (identity, a searched-like curve, PI)."""
  _, params, config = smollm2
  task = TaskConfig(task="kv", num_pairs=6, key_length=4, value_length=4)
  batch = evaluate.search_batch(task, smollm2_tokenizer, config, num_examples=9, seed=0)
  L = config.num_layers
  mults = np.stack([np.ones(L), 1 / np.linspace(1.3, 1.0, L), np.full(L, 1 / 1.5)])
  return config, params, batch, mults


@pytest.mark.slow
def test_smollm2_teacher_forced_counts_equal_greedy(smollm2_search_set):
  """float32: the right-padded plain forward counts exactly what left-padded greedy decoding
  with a KV cache counts, on the real search set."""
  config, params, batch, mults = smollm2_search_set
  forward, greedy = fitness.llama_fitness_fns(config)
  tf = fitness.make_fitness_fn(params, batch, forward=forward, example_batch=3)(mults)
  gr = fitness.make_fitness_fn(params, batch, mode="greedy", greedy=greedy,
                               example_batch=3)(mults)
  np.testing.assert_array_equal(tf, gr)
  assert tf.sum() > 0                                      # some candidates answer some


@pytest.mark.slow
def test_smollm2_fused_differs_only_on_bf16_near_ties(smollm2_search_set, monkeypatch):
  """bfloat16: the fused path ("cudnn", named, so the forward must be plain; run on CPU by
  `jax.nn.dot_product_attention`'s XLA backend, which rounds the scores to bf16) and the
  reference ("xla", float32 scores) agree on every example whose deciding logit margin exceeds
  bf16 rounding of the logits; where they disagree, the reference's margin is a near-tie."""
  from pope_jax import attention
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "xla")
  monkeypatch.setattr(attention, "_gpu_capability", lambda: ("gpu", 9))
  config, params, batch, mults = smollm2_search_set
  config = dataclasses.replace(config, dtype="bfloat16")
  params = jax.tree.map(lambda x: x.astype(config.dtype), params)
  tokens, at, targets, tmask = fitness.teacher_forced_inputs(batch)
  logits = {}
  for impl in ("xla", "cudnn"):
    forward = fitness.llama_fitness_fns(dataclasses.replace(
        config, attention_implementation=impl))[0]
    run = jax.jit(forward)
    logits[impl] = np.stack([np.asarray(run(params, tokens, m.astype(np.float32), at))
                             for m in mults])                               # [P, E, W, V]
  hits = {k: np.all((v.argmax(-1) == targets) | ~tmask, -1) for k, v in logits.items()}
  ref = np.sort(logits["xla"], -1)
  margin = np.where(tmask, ref[..., -1] - ref[..., -2], np.inf).min(-1)     # [P, E]
  differ = hits["xla"] != hits["cudnn"]
  assert hits["xla"].sum() > 0
  assert np.all(margin[differ] < 0.25), (margin[differ], differ.sum())
