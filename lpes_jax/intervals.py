"""95 % intervals of accuracies and of paired accuracy differences, over held-out examples.

Each example contributes one score in [0, 1]: its correctness, or the mean of its correctness
under several search seeds (the examples are independent, the seeds' results on one example are
not). The interval of the mean of n such scores is the normal (CLT) interval
mean ± z₀.₉₇₅ · sd / √n, sd the sample standard deviation (n − 1); a gain over a baseline is the
same interval of the per-example differences, paired over the same examples.
"""

from __future__ import annotations

import statistics

import numpy as np

Z95 = statistics.NormalDist().inv_cdf(0.975)      # 1.959963984540054


def mean_interval(scores) -> dict[str, float]:
  """The mean of per-example scores and its normal 95 % interval.

  Args:
    scores: [n] per-example scores (or differences), n >= 1.

  Returns:
    {"mean", "lo", "hi", "n"}; lo = hi = mean when n = 1 or every score is equal.

  Raises:
    ValueError: no scores, or scores that are not finite.
  """
  x = np.asarray(scores, np.float64).ravel()
  if x.size == 0 or not np.all(np.isfinite(x)):
    raise ValueError(f"mean_interval needs finite scores, got {x.size} values")
  mean = float(x.mean())
  half = Z95 * float(x.std(ddof=1)) / np.sqrt(x.size) if x.size > 1 else 0.0
  return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": int(x.size)}


def paired_gain(scores, baseline) -> dict[str, float]:
  """Mean of `scores − baseline` ([n] each, the same examples in the same order) with its normal
  95 % interval (`mean_interval` of the differences).

  Raises:
    ValueError: shapes that differ.
  """
  a, b = np.asarray(scores, np.float64), np.asarray(baseline, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"paired_gain needs scores of the same examples, got shapes {a.shape} and "
                     f"{b.shape}")
  return mean_interval(a - b)
