"""Constrained GA (toy fitness), resumption, sharded population fitness, teacher forcing ≡ greedy."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpes_jax import bezier, fitness, genomes, search
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import Llama, init_params

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_theta=100.0, max_position_embeddings=64)
TARGET = np.linspace(1.0, 2.0, 8)


def toy_fitness(multipliers):
  d = np.abs(1.0 / np.asarray(multipliers) - TARGET).mean(-1)
  return np.stack([1 - d, 1 - 2 * d, 1 - 3 * d], -1)


SMALL = dict(population_size=8, num_parents=4, num_mutations=2, num_crossovers=2)


def test_two_generations_end_to_end(tmp_path):
  bez = genomes.BezierSpace(bezier.BezierConfig(num_layers=8))
  cfg = search.SearchConfig(num_generations=2, **SMALL)
  res = search.run_search(toy_fitness, bez, cfg, str(tmp_path), progress=False)
  assert len(res.history) == 2
  assert res.history[1]["best_fitness"] >= res.history[0]["best_fitness"]   # elitism
  for f in ("results.json", "search_state.json", "best_curve.png", "fitness.png"):
    assert os.path.getsize(tmp_path / f) > 0
  state = json.load(open(tmp_path / "search_state.json"))
  pop = np.asarray(state["population"])
  assert len({bez.key(g) for g in pop}) == 8                  # no two with the same scales
  for g in pop:
    bez.validate(g)
  assert res.num_candidates == cfg.num_candidates == 8 + 4
  np.testing.assert_allclose(search.load_multipliers(tmp_path / "results.json"), 1 / res.scales,
                             rtol=1e-6)


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
  bez = genomes.BezierSpace(bezier.BezierConfig(num_layers=8))
  cfg = search.SearchConfig(num_generations=3, **SMALL)
  full = search.run_search(toy_fitness, bez, cfg, str(tmp_path / "a"), progress=False)
  search.run_search(toy_fitness, bez, cfg, str(tmp_path / "b"), progress=False, stop_after=0)
  with pytest.raises(FileExistsError):
    search.run_search(toy_fitness, bez, cfg, str(tmp_path / "b"), progress=False)
  resumed = search.run_search(toy_fitness, bez, cfg, str(tmp_path / "b"), progress=False,
                              resume=True)
  strip = lambda h: [{k: v for k, v in x.items() if k != "seconds"} for x in h]
  assert strip(resumed.history) == strip(full.history)
  np.testing.assert_array_equal(resumed.genome, full.genome)
  with pytest.raises(ValueError, match=r"other settings \(differs in search.num_generations\)"):
    search.run_search(toy_fitness, bez, search.SearchConfig(num_generations=4, **SMALL),
                      str(tmp_path / "b"), progress=False, resume=True)


def test_resume_refuses_another_fitness(tmp_path):
  # Fitness values of another model or task would not compare with the saved ones.
  bez = genomes.BezierSpace(bezier.BezierConfig(num_layers=8))
  cfg = search.SearchConfig(num_generations=3, **SMALL)
  search.run_search(toy_fitness, bez, cfg, str(tmp_path), progress=False, stop_after=0,
                    fitness_id={"model": "a.gguf", "mode": "teacher_forced"})
  with pytest.raises(ValueError, match=r"differs in fitness.model\)"):
    search.run_search(toy_fitness, bez, cfg, str(tmp_path), progress=False, resume=True,
                      fitness_id={"model": "b.gguf", "mode": "teacher_forced"})
  search.run_search(toy_fitness, bez, cfg, str(tmp_path), progress=False, resume=True,
                    fitness_id={"model": "a.gguf", "mode": "teacher_forced"})


@pytest.mark.slow
def test_state_saved_without_a_fitness_record_resumes_with_a_warning(tmp_path):
  bez = genomes.BezierSpace(bezier.BezierConfig(num_layers=8))
  cfg = search.SearchConfig(num_generations=3, **SMALL)
  full = search.run_search(toy_fitness, bez, cfg, str(tmp_path / "a"), progress=False)
  search.run_search(toy_fitness, bez, cfg, str(tmp_path / "b"), progress=False, stop_after=0)
  state_path = tmp_path / "b" / search.STATE_FILE
  state = json.loads(state_path.read_text())
  del state["signature"]["fitness"]                    # As written by the earlier version.
  state_path.write_text(json.dumps(state))
  with pytest.warns(UserWarning, match="does not record what its fitness scored"):
    resumed = search.run_search(toy_fitness, bez, cfg, str(tmp_path / "b"), progress=False,
                                resume=True, fitness_id={"model": "m.gguf"})
  np.testing.assert_array_equal(resumed.genome, full.genome)
  assert json.loads(state_path.read_text())["signature"]["fitness"] == {"model": "m.gguf"}


def test_scales_whose_inverse_overflows_are_refused():
  with pytest.raises(ValueError, match="overflows float32"):
    bezier.scales_to_multipliers([1.0, 1e-40])


def test_operators_keep_constraints():
  space = genomes.BezierSpace(bezier.BezierConfig(num_layers=12))
  rng = np.random.default_rng(0)
  for _ in range(200):
    a, b = space.random(rng), space.random(rng)
    m = space.mutate(rng, a, 2)
    space.validate(m)
    assert np.abs(m[:, 1] - a[:, 1]).max() <= 2 and (m != a).sum() <= 2
    c = space.crossover(rng, a, b, 1000)
    space.validate(c)
    assert all((c[i] == a[i]).all() or (c[i] == b[i]).all() for i in range(4))


def test_crossovers_all_seen_fall_back_to_mutations():
  # Two parents that differ in one control point have only themselves as crossover children;
  # with both seen, the generation takes mutations in their place instead of stopping.
  space = genomes.BezierSpace(bezier.BezierConfig(num_layers=12))
  rng = np.random.default_rng(1)
  a = space.random(rng)
  b = space.mutate(rng, a, 2)
  while space.key(b) == space.key(a):   # A move that the rounding to the grid hides.
    b = space.mutate(rng, a, 2)
  cfg = search.SearchConfig(population_size=4, num_parents=2, num_mutations=1, num_crossovers=1)
  seen = {space.key(a), space.key(b)}
  parents, _, children = search.next_generation(rng, np.stack([a, b]), np.array([1.0, 0.5]),
                                                space, cfg, seen)
  assert len(children) == 2 and len(seen) == 4
  for child in children:
    space.validate(child)
    assert space.key(child) not in {space.key(p) for p in parents}


@pytest.mark.parametrize("example_batch", [2, 3, 8])
def test_fitness_counts_each_example_once(example_batch):
  # Three examples, all answered correctly, in chunks that need padding or not: the padding
  # rows (copies of the first example) must not count.
  batch = fitness.make_batch([[1, 2], [1, 3], [1, 4]], [[5], [5], [5]], [0, 1, 2])
  forward = lambda p, t, mult, at: jax.nn.one_hot(jnp.full(at.shape, 5), 8)
  population_fitness = fitness.make_fitness_fn(None, batch, forward=forward,
                                               example_batch=example_batch)
  np.testing.assert_array_equal(population_fitness(np.ones((1, 2))), [[1.0, 1.0, 1.0]])


def test_config_and_batch_errors():
  with pytest.raises(ValueError, match="must equal population_size"):
    search.SearchConfig(population_size=10)
  with pytest.raises(ValueError, match="weights"):
    search.SearchConfig(weights=(0, 0, 0))
  with pytest.raises(ValueError, match="exceeds the model's context"):
    fitness.make_batch([[1] * 60], [[2] * 8], [0], max_len=64)


def _tiny_batch(params, model):
  """Half the answers are the model's own greedy tokens (hits), half are random (misses)."""
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 64, rng.integers(5, 12))) for _ in range(12)]
  t, m = fitness.make_batch(prompts, [[1]] * 12, [0] * 12).prompt_tokens, None
  b0 = fitness.make_batch(prompts, [[1]] * 12, [i % 3 for i in range(12)])
  greedy = jax.jit(fitness.llama_fitness_fns(model.config)[1], static_argnums=4)
  out = np.asarray(greedy(params, b0.prompt_tokens, b0.prompt_mask, None, 3))
  answers = [list(out[i, :2 + i % 2]) if i % 2 == 0 else list(rng.integers(3, 64, 3))
             for i in range(12)]
  return fitness.make_batch(prompts, answers, [i % 3 for i in range(12)])


@pytest.mark.slow
def test_teacher_forced_equals_greedy():
  model = Llama(TINY)
  params = init_params(TINY, jax.random.key(1), scale=0.3)
  batch = _tiny_batch(params, model)
  forward, greedy = fitness.llama_fitness_fns(model.config)
  mults = np.stack([np.ones(4), 1 / np.array([1.0, 1.5, 2.0, 1.2]), np.full(4, 0.5)])
  tf_inputs = fitness.teacher_forced_inputs(batch)
  hits = []
  for m in mults:
    tf = np.asarray(fitness.teacher_forced_correct(forward, params, jnp.asarray(m, jnp.float32),
                                                  *map(jnp.asarray, tf_inputs)))
    gr = np.asarray(fitness.greedy_correct(
        greedy, params, jnp.asarray(m, jnp.float32), batch.prompt_tokens, batch.prompt_mask,
        batch.answer_tokens, batch.answer_mask))
    np.testing.assert_array_equal(tf, gr)
    hits.append(tf)
  assert hits[0][0::2].all() and not hits[0][1::2].any()           # identity: own tokens hit
  acc_tf = fitness.make_fitness_fn(params, batch, mode="teacher_forced", forward=forward,
                                  example_batch=5)(mults)
  acc_gr = fitness.make_fitness_fn(params, batch, mode="greedy", greedy=greedy,
                                  example_batch=5)(mults)
  np.testing.assert_allclose(acc_tf, acc_gr)
  assert acc_tf.shape == (3, 3) and acc_tf[0].sum() > 0


SHARDED = textwrap.dedent("""
  import os, sys, numpy as np, jax
  sys.path.insert(0, os.getcwd())
  from tests.lpes_jax.test_search import TINY, _tiny_batch
  from lpes_jax import fitness
  from lpes_jax.llama import Llama, init_params
  assert jax.device_count() == 4, jax.devices()
  model = Llama(TINY)
  params = init_params(TINY, jax.random.key(1), scale=0.3)
  batch = _tiny_batch(params, model)
  mults = 1 / np.random.default_rng(0).uniform(1, 2, (6, 4))          # 6 candidates on 4 devices
  forward = fitness.llama_fitness_fns(TINY)[0]
  f4 = fitness.make_fitness_fn(params, batch, forward=forward, example_batch=4)
  f1 = fitness.make_fitness_fn(params, batch, forward=forward, example_batch=4,
                               mesh=fitness.candidate_mesh(jax.devices()[:1]))
  np.testing.assert_allclose(f4(mults), f1(mults))
  print("OK", f4(mults).shape)
""")


@pytest.mark.slow
def test_four_device_sharding_subprocess():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  r = subprocess.run([sys.executable, "-c", SHARDED], cwd=root, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "OK (6, 3)" in r.stdout


def test_pope_model_per_layer_multipliers():
  """Beyond the paper: the same per-layer multipliers scale a PoPE model's θ_c per layer."""
  from pope_jax.config import ModelConfig
  from pope_jax.model import Transformer
  cfg = ModelConfig(vocab_size=32, num_layers=3, d_model=16, num_heads=2, pos_encoding="pope")
  model = Transformer(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (6, 10)), jnp.int32)
  params = model.init(jax.random.key(0), tokens)["params"]
  apply = lambda p, t, mult: model.apply({"params": p}, t, rope_multipliers=mult)
  base = apply(params, tokens, None)
  np.testing.assert_allclose(apply(params, tokens, jnp.ones(3)), base, atol=1e-6)
  assert not np.allclose(apply(params, tokens, jnp.array([1.0, 1.0, 0.5])), base, atol=1e-4)
  # The population fitness is model-agnostic: the PoPE apply through full_logits_forward.
  answers = [list(np.asarray(jnp.argmax(base[i, -1:], -1))) for i in range(6)]
  batch = fitness.make_batch([list(np.asarray(t[:-1])) for t in tokens], answers,
                            [i % 3 for i in range(6)])
  acc = fitness.make_fitness_fn(params, batch, forward=fitness.full_logits_forward(apply),
                               example_batch=2)(np.stack([np.ones(3), [1.0, 0.5, 0.25]]))
  assert acc.shape == (2, 3) and np.all((acc >= 0) & (acc <= 1))
