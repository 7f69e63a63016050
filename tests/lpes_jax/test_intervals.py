"""Normal 95 % intervals of a mean and of paired differences, against hand-computed values."""

import numpy as np
import pytest

from lpes_jax import intervals


def test_mean_interval_by_hand():
  # 3 of 5 right: mean 0.6, sd = sqrt(((0.4² · 3) + (0.6² · 2)) / 4) = sqrt(0.3),
  # half-width 1.959964 · sqrt(0.3) / sqrt(5) = 0.480091.
  r = intervals.mean_interval([1, 0, 1, 1, 0])
  assert r["mean"] == pytest.approx(0.6) and r["n"] == 5
  assert r["hi"] - r["mean"] == pytest.approx(0.4800912, abs=1e-6)
  assert r["mean"] - r["lo"] == pytest.approx(0.4800912, abs=1e-6)
  assert intervals.mean_interval([1.0]) == {"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": 1}


def test_paired_gain_by_hand():
  # Differences 1, 0, 0, 1 → mean 0.5, sd = sqrt(1/3), half-width 1.959964 · 0.57735 / 2.
  method = [1, 1, 0, 1]
  base = [0, 1, 0, 0]
  r = intervals.paired_gain(method, base)
  assert r["mean"] == pytest.approx(0.5)
  assert r["hi"] - 0.5 == pytest.approx(1.959964 * np.sqrt(1 / 3) / 2, abs=1e-6)
  # Unpaired the interval would be wider: pairing removes the shared per-example difficulty.
  unpaired = np.sqrt(np.var(method, ddof=1) / 4 + np.var(base, ddof=1) / 4) * intervals.Z95
  assert r["hi"] - 0.5 < unpaired


def test_bad_input():
  with pytest.raises(ValueError, match="same examples"):
    intervals.paired_gain([1, 0], [1, 0, 1])
  with pytest.raises(ValueError, match="finite scores"):
    intervals.mean_interval([])
