"""Bézier scale curves: identity, grid rounding, vectorisation, genome validation."""

import numpy as np
import pytest

from lpes_jax import bezier


def test_identity_is_all_ones():
  cfg = bezier.BezierConfig(num_layers=30)
  s = np.asarray(bezier.curve_scales(bezier.identity_genome(cfg), cfg))
  np.testing.assert_array_equal(s, np.ones(30))
  np.testing.assert_array_equal(bezier.scales_to_multipliers(s), np.ones(30))


def test_constant_and_linear_curves_hand_checked():
  cfg = bezier.BezierConfig(num_layers=11)
  # Control points on the straight line (x, 1 + 0.1·x): the curve is the line itself, and layer l
  # gets scale 1 + 0.1·l (cubic Bézier reproduces linear data with equally spaced control points).
  line = np.array([[0, 0], [3, 3], [7, 7], [10, 10]])
  line_eq = np.array([[0, 0], [3, 3], [6, 6], [10, 10]])
  const = np.array([[0, 5], [2, 5], [8, 5], [10, 5]])
  s = np.asarray(bezier.curve_scales(np.stack([line, const, line_eq]), cfg))
  assert s.shape == (3, 11)
  np.testing.assert_allclose(s[0], 1 + 0.1 * np.arange(11), atol=1e-6)
  np.testing.assert_allclose(s[1], 1.5, atol=1e-6)
  assert np.all(np.isin(np.round(s.astype(np.float64), 4), np.round(cfg.grid, 4)))  # grid values
  assert np.all(np.diff(s[2]) >= -1e-6)                            # monotone data, monotone curve


def test_population_matches_single_calls():
  cfg = bezier.BezierConfig(num_layers=16, num_control_points=5)
  rng = np.random.default_rng(0)
  from lpes_jax.genomes import BezierSpace
  pop = np.stack([BezierSpace(cfg).random(rng) for _ in range(6)])
  batch = np.asarray(bezier.curve_scales(pop, cfg))
  for g, row in zip(pop, batch):
    np.testing.assert_array_equal(np.asarray(bezier.curve_scales(g, cfg)), row)


@pytest.mark.parametrize("genome,match", [
    ([[0, 0], [5, 0], [9, 0]], "3 control points, expected 4"),
    ([[0, 0], [5, 0], [4, 0], [9, 0]], "strictly increasing"),
    ([[0, 0], [5, 0], [5, 0], [9, 0]], "strictly increasing"),
    ([[1, 0], [5, 0], [6, 0], [9, 0]], "start at 0"),
    ([[0, 0], [5, 11], [6, 0], [9, 0]], r"y must lie in \[0, 11\)"),
    ([[0, 0], [5, 0], [6, 0], [10, 0]], r"x must lie in \[0, 10\)"),
])
def test_bad_genomes(genome, match):
  cfg = bezier.BezierConfig(num_layers=10)
  with pytest.raises(ValueError, match=match):
    bezier.curve_scales(np.array(genome), cfg)


@pytest.mark.parametrize("scales", [[1.0, 0.0], [1.0, -2.0], [1.0, np.nan], [np.inf, 1.0]])
def test_bad_scales(scales):
  with pytest.raises(ValueError, match="scales"):
    bezier.scales_to_multipliers(scales)


def test_config_errors():
  with pytest.raises(ValueError, match="num_layers"):
    bezier.BezierConfig(num_layers=3)
  with pytest.raises(ValueError, match="grid"):
    bezier.BezierConfig(num_layers=8, grid=(1.0, 0.0))
  with pytest.raises(ValueError, match="no value 1.0"):
    bezier.identity_genome(bezier.BezierConfig(num_layers=8, grid=(1.5, 2.0)))


@pytest.mark.parametrize("field, value", [("num_layers", 4.0), ("num_control_points", True)])
def test_config_counts_must_be_ints(field, value):
  kwargs = {"num_layers": 8, field: value}
  with pytest.raises(TypeError, match=f"BezierConfig.{field} must be an int"):
    bezier.BezierConfig(**kwargs)
