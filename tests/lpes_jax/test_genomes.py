"""Genome kinds: valid children, free/global operators, enumeration, equal search budgets."""

import json

import numpy as np
import pytest

from lpes_jax import bezier, genomes, search
from tests.lpes_jax.test_search import toy_fitness

GRID = (1.0, 1.25, 1.5, 1.75, 2.0)


def test_free_operators_keep_constraints():
  space = genomes.make_space("free", 8, grid=GRID)
  rng = np.random.default_rng(0)
  for _ in range(200):
    a, b = space.random(rng), space.random(rng)
    m = space.mutate(rng, a, 2)
    space.validate(m)
    moved = np.flatnonzero(m != a)
    assert len(moved) <= 1 and np.abs(m - a).max() <= 2          # one layer, at most ±2 steps
    c = space.crossover(rng, a, b, 10)
    space.validate(c)
    assert np.all((c == a) | (c == b))                             # each gene from a parent
  np.testing.assert_array_equal(space.scales(np.stack([space.identity()])), np.ones((1, 8)))
  np.testing.assert_array_equal(space.scales(np.array([[0, 1, 2, 3, 4, 4, 4, 0]]))[0],
                                [1.0, 1.25, 1.5, 1.75, 2.0, 2.0, 2.0, 1.0])


def test_global_genome_is_one_scale_for_every_layer():
  space = genomes.make_space("global", 6, grid=GRID, budget=9)
  assert space.grid == (1.0, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875, 2.0)
  rng = np.random.default_rng(0)
  g = space.mutate(rng, np.array([4]), 1)
  assert g.shape == (1,) and abs(int(g[0]) - 4) == 1
  assert space.crossover(rng, np.array([1]), np.array([7]), 10)[0] in (1, 7)
  np.testing.assert_array_equal(space.scales(np.array([[2], [8]])),
                                [[1.25] * 6, [2.0] * 6])
  listed = space.enumerate(9)
  assert listed.shape == (9, 1) and listed[0, 0] == space.identity_index == 0
  assert space.enumerate(8) is None


def test_two_control_points_are_straight_lines():
  space = genomes.make_space("bezier", 5, grid=GRID, control_points=2)
  s = space.scales(np.array([[[0, 0], [4, 4]], [[0, 4], [4, 2]]]))   # 1.0 → 2.0, 2.0 → 1.5
  np.testing.assert_allclose(s, [[1.0, 1.25, 1.5, 1.75, 2.0], [2.0, 1.875, 1.75, 1.625, 1.5]],
                             atol=0.13)
  np.testing.assert_array_equal(s[0], GRID)
  assert space.size() == 25
  listed = space.enumerate(25)
  assert len(listed) == 25 and len({space.key(g) for g in listed}) == 25
  assert space.key(listed[0]) == space.key(space.identity())


def test_bad_kinds_and_genomes_are_refused():
  with pytest.raises(ValueError, match="genome kind must be one of"):
    genomes.make_space("spline", 8)
  with pytest.raises(ValueError, match="budget"):
    genomes.make_space("global", 8)
  with pytest.raises(ValueError, match="no value 1.0"):
    genomes.make_space("free", 8, grid=(1.5, 2.0))
  with pytest.raises(ValueError, match=r"genome 0: free genome must have shape \(8,\)"):
    genomes.make_space("free", 8).scales(np.zeros((1, 7), int))
  with pytest.raises(ValueError, match="grid indices"):
    genomes.make_space("free", 4, grid=GRID).scales(np.array([[0, 1, 2, 5]]))


@pytest.mark.parametrize("kind, control_points", [("bezier", 4), ("bezier", 2), ("free", 4),
                                                   ("global", 4)])
def test_every_kind_spends_the_same_budget_on_distinct_candidates(tmp_path, kind,
                                                                   control_points):
  # 8 + 3 * 4 = 20 candidates. A 2-point line on a 3-value grid has only 9: all of them.
  cfg = search.SearchConfig(population_size=8, num_parents=4, num_mutations=2,
                            num_crossovers=2, num_generations=4)
  grid = (1.0, 1.5, 2.0) if control_points == 2 else bezier.DEFAULT_GRID
  space = genomes.make_space(kind, 8, grid=grid, control_points=control_points,
                             budget=cfg.num_candidates)
  res = search.run_search(toy_fitness, space, cfg, str(tmp_path), progress=False)
  state = json.loads((tmp_path / search.STATE_FILE).read_text())
  expected = 9 if control_points == 2 else cfg.num_candidates
  assert res.num_candidates == len(state["seen"]) == expected
  out = json.loads((tmp_path / search.RESULTS_FILE).read_text())
  assert out["num_candidates"] == expected and out["genome_space"]["kind"] == kind
  if kind == "global":   # Every value of the budget-sized grid, the best one kept.
    assert len(space.grid) == cfg.num_candidates
    assert len(set(res.scales)) == 1
    best = max(space.grid, key=lambda s: toy_fitness(np.full((1, 8), 1 / s))[0].mean())
    assert res.scales[0] == pytest.approx(best)
