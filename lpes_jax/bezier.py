"""Bézier parameterisation of per-layer RoPE scales (LPES, arXiv 2606.27705 §3).

A genome is C control points (x, y) in (layer, scale) space, stored as integer indices: x a layer
index in [0, L), y an index into the grid of M candidate scales. The Bézier curve
B(t) = Σ_c binom(C−1, c) t^c (1−t)^(C−1−c) P_c, t ∈ [0, 1], is sampled at every layer l by solving
x(t) = l (x(t) is increasing when the control x are), and y(t) is rounded to the nearest grid value,
giving one scale s_l per layer. The layer's RoPE frequencies are then multiplied by 1/s_l.

Shape letters: P population (candidates), C control points, L layers, M grid values.

Defaults that are this project's choice (the paper's table of hyper-parameters was not readable):
grid {1.0, 1.1, …, 2.0} (M = 11), C = 4, first control x pinned at 0 and last at L − 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pope_jax import checks

DEFAULT_GRID = tuple(round(1.0 + 0.1 * i, 1) for i in range(11))
_BISECTION_STEPS = 40


@dataclasses.dataclass(frozen=True, kw_only=True)
class BezierConfig:
  """The search space of per-layer scale curves.

  Attributes:
    num_layers: L, layers of the model.
    num_control_points: C (4: cubic).
    grid: the M candidate scale values, strictly increasing, all finite and > 0.
    pin_ends: first control x = 0 and last = L − 1 (default, assumption).
  """
  num_layers: int
  num_control_points: int = 4
  grid: tuple[float, ...] = DEFAULT_GRID
  pin_ends: bool = True

  def __post_init__(self):
    for field in ("num_layers", "num_control_points"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"BezierConfig.{field} must be an int, got {value!r}")
    if self.num_control_points < 2:
      raise ValueError(f"BezierConfig.num_control_points must be >= 2, got {self.num_control_points}")
    if self.num_layers < self.num_control_points:
      raise ValueError(f"BezierConfig.num_layers ({self.num_layers}) must be >= num_control_points "
                       f"({self.num_control_points}) for strictly increasing control x")
    object.__setattr__(self, "grid", tuple(float(g) for g in self.grid))
    validate_scales(np.asarray(self.grid), name="BezierConfig.grid")
    if len(self.grid) < 1 or any(b <= a for a, b in zip(self.grid, self.grid[1:])):
      raise ValueError(f"BezierConfig.grid must be non-empty and strictly increasing, got {self.grid}")

  @property
  def num_values(self) -> int:
    return len(self.grid)

  @property
  def identity_index(self) -> int:
    """Grid index of the scale 1.0 (Raises ValueError if 1.0 is not on the grid)."""
    for i, g in enumerate(self.grid):
      if math.isclose(g, 1.0):
        return i
    raise ValueError(f"BezierConfig.grid has no value 1.0: {self.grid}")


def validate_scales(scales, *, name: str = "scales") -> np.ndarray:
  """Returns scales as float64 numpy; raises ValueError naming `name` if any is <= 0 or not
  finite (the check of every multiplier, `pope_jax.checks.check_positive_finite`)."""
  s = np.asarray(scales, dtype=np.float64)
  checks.check_positive_finite(s, name)
  return s


def scales_to_multipliers(scales) -> np.ndarray:
  """Frequency multipliers 1/s (float32, same shape) after `validate_scales`.

  Raises:
    ValueError: invalid scales, or scales so small that 1/s overflows float32.
  """
  inverse = 1.0 / validate_scales(scales)
  if np.any(inverse > np.finfo(np.float32).max):
    raise ValueError(f"scales too small: 1/s overflows float32 for {np.asarray(scales).tolist()}")
  return inverse.astype(np.float32)


def validate_genome(genome, config: BezierConfig) -> np.ndarray:
  """Checks one genome and returns it as int64 [C, 2].

  Raises:
    ValueError: wrong number of control points or shape, non-integer entries, x outside [0, L),
      x not strictly increasing, ends not pinned (when pin_ends), y outside [0, M).
  """
  g = np.asarray(genome)
  C, L, M = config.num_control_points, config.num_layers, config.num_values
  if g.ndim != 2 or g.shape[1] != 2:
    raise ValueError(f"genome must have shape [C, 2] (x, y index pairs), got {g.shape}")
  if g.shape[0] != C:
    raise ValueError(f"genome has {g.shape[0]} control points, expected {C}")
  if not np.issubdtype(g.dtype, np.integer):
    if not np.all(np.equal(np.mod(g, 1), 0)):
      raise ValueError(f"genome entries must be integer indices, got {g.tolist()}")
  g = g.astype(np.int64)
  x, y = g[:, 0], g[:, 1]
  if np.any(x < 0) or np.any(x >= L):
    raise ValueError(f"genome x must lie in [0, {L}), got {x.tolist()}")
  if np.any(np.diff(x) <= 0):
    raise ValueError(f"genome x must be strictly increasing, got {x.tolist()}")
  if config.pin_ends and (x[0] != 0 or x[-1] != L - 1):
    raise ValueError(f"genome x must start at 0 and end at {L - 1} (pin_ends), got {x.tolist()}")
  if np.any(y < 0) or np.any(y >= M):
    raise ValueError(f"genome y must lie in [0, {M}), got {y.tolist()}")
  return g


def identity_genome(config: BezierConfig) -> np.ndarray:
  """Control points evenly spread over the layers, all at scale 1.0: the unscaled model."""
  C, L = config.num_control_points, config.num_layers
  x = np.round(np.linspace(0, L - 1, C)).astype(np.int64)
  y = np.full(C, config.identity_index, np.int64)
  return validate_genome(np.stack([x, y], axis=1), config)


def curve_scales(genomes, config: BezierConfig) -> jax.Array:
  """Per-layer scales of a population of genomes, in one jitted call.

  Args:
    genomes: [P, C, 2] or [C, 2] integer (x layer index, y grid index); validated.
  Returns:
    [P, L] (or [L]) float32 scales, each a grid value.
  Raises:
    ValueError: any invalid genome (see `validate_genome`).
  """
  g = np.asarray(genomes)
  single = g.ndim == 2
  g = g[None] if single else g
  if g.ndim != 3:
    raise ValueError(f"genomes must have shape [P, C, 2] or [C, 2], got {np.shape(genomes)}")
  for i, genome in enumerate(g):
    try:
      validate_genome(genome, config)
    except ValueError as e:
      raise ValueError(f"genome {i}: {e}") from None
  out = _scales_jit(jnp.asarray(g, jnp.int32), config.num_layers, config.grid)
  return out[0] if single else out


@functools.partial(jax.jit, static_argnames=("num_layers", "grid"))
def _scales_jit(genomes, num_layers, grid):
  """[P, C, 2] int32 → [P, L] float32 (no validation)."""
  g = jnp.asarray(grid, jnp.float32)                                      # [M]
  xs = genomes[..., 0].astype(jnp.float32)                                # [P, C]
  ys = g[genomes[..., 1]]                                                 # [P, C]
  n = xs.shape[-1] - 1
  c = jnp.arange(n + 1, dtype=jnp.float32)
  binom = jnp.asarray([math.comb(n, k) for k in range(n + 1)], jnp.float32)

  def bernstein(t):                                                       # [P, L] → [P, L, C]
    t = t[..., None]
    return binom * t ** c * (1.0 - t) ** (n - c)

  layers = jnp.arange(num_layers, dtype=jnp.float32)[None, :]             # [1, L]
  lo = jnp.zeros((xs.shape[0], num_layers), jnp.float32)
  hi = jnp.ones_like(lo)

  def bisect(_, bounds):                                                  # x(t) increasing in t
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    x_mid = jnp.einsum("plc,pc->pl", bernstein(mid), xs)
    below = x_mid < layers
    return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

  lo, hi = jax.lax.fori_loop(0, _BISECTION_STEPS, bisect, (lo, hi))
  t = 0.5 * (lo + hi)                                                     # [P, L]
  y = jnp.einsum("plc,pc->pl", bernstein(t), ys)                          # [P, L]
  nearest = jnp.argmin(jnp.abs(y[..., None] - g), axis=-1)                # [P, L]
  return g[nearest]
