"""What the compiled-kernel tests measure and allow: the error of an output or a gradient
relative to the float32 XLA reference, and each check shape's tolerance."""

from __future__ import annotations

import numpy as np

from pallas_kernels.shapes import CHECK_TOLERANCES, SHAPES

TOLERANCE = 2e-2  # max |error| / max |reference|, where a shape's CHECK_TOLERANCES is not larger
CHECK_SHAPES = tuple(name for name in SHAPES if name.startswith("check"))


def relative_error(x, reference) -> float:
  """max |x - reference| / max |reference| (both cast to float32); NaN if either has a NaN."""
  x, reference = np.asarray(x, np.float32), np.asarray(reference, np.float32)
  return float(np.abs(x - reference).max() / (np.abs(reference).max() + 1e-6))


def tolerance(shape_name: str) -> float:
  """The largest `relative_error` a check shape's output or gradient may have."""
  return max(TOLERANCE, CHECK_TOLERANCES.get(shape_name, 0.0))


def over_tolerance(shape_name: str, errors: dict[str, float]) -> dict[str, float]:
  """The entries of `errors` (name: `relative_error`) above the shape's tolerance or NaN."""
  return {key: err for key, err in errors.items() if not err <= tolerance(shape_name)}
