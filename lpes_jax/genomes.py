"""Genome kinds of the LPES search: how a candidate's per-layer scales are written and varied.

One interface, three kinds (`GENOMES`), so that `lpes_jax.search` runs one loop for all:
  * "bezier" (`BezierSpace`): C Bézier control points (LPES, arXiv 2606.27705 §3.1); C = 2 is the
    straight line between the first and the last layer's scale (linear interpolation).
  * "free" (`FreeSpace`): one grid index per layer, no curve. Mutation moves one layer by at most
    ±steps grid steps; crossover takes each gene from one of the two parents (uniform crossover).
  * "global" (`FreeSpace(tied=True)`): one grid index for every layer, i.e. PI with a searched s.

A candidate is its phenotype, the grid index of every layer's scale (`layer_indices`); the search
counts, and never repeats, phenotypes, so that every kind spends its budget on distinct candidates.
A space of at most `limit` genomes lists them all (`enumerate`, identity first): the search then
evaluates the whole space instead of running the GA (the 1-D "global" genome, a C = 2 line).

Shape letters: P population, C control points, L layers, M grid values.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from lpes_jax import bezier

GENOMES = ("bezier", "free", "global")


class GenomeSpace:
  """What the search needs of a genome kind (subclasses define the operators).

  Attributes (of every subclass): kind, one of GENOMES; num_layers, L; grid, the M scale values.
  """
  kind: str
  num_layers: int
  grid: tuple[float, ...]

  def identity(self) -> np.ndarray:
    """The genome of the unscaled model (every s_l = 1)."""
    raise NotImplementedError

  def random(self, rng: np.random.Generator) -> np.ndarray:
    """A uniformly drawn valid genome."""
    raise NotImplementedError

  def mutate(self, rng: np.random.Generator, genome: np.ndarray, steps: int) -> np.ndarray:
    """A copy of `genome` with one gene moved by at most ±steps grid steps."""
    raise NotImplementedError

  def crossover(self, rng: np.random.Generator, a: np.ndarray, b: np.ndarray,
                max_redraws: int) -> np.ndarray:
    """A child taking each gene whole from `a` or `b`."""
    raise NotImplementedError

  def validate(self, genome) -> np.ndarray:
    """The genome as int64, or ValueError naming what is wrong."""
    raise NotImplementedError

  def layer_indices(self, genomes) -> np.ndarray:
    """[P, L] int64 grid index of every layer's scale (the phenotype) of [P, ...] genomes."""
    raise NotImplementedError

  def size(self) -> int:
    """The number of distinct genomes."""
    raise NotImplementedError

  def all_genomes(self):
    """Every genome, in a fixed order (an iterator)."""
    raise NotImplementedError

  def describe(self) -> dict:
    """JSON-able settings (saved with the search state: a resume must match them)."""
    raise NotImplementedError

  @property
  def identity_index(self) -> int:
    """Grid index of the scale 1.0 (Raises ValueError if 1.0 is not on the grid)."""
    for i, g in enumerate(self.grid):
      if math.isclose(g, 1.0):
        return i
    raise ValueError(f"{type(self).__name__}.grid has no value 1.0: {self.grid}")

  def scales(self, genomes) -> np.ndarray:
    """[P, L] float64 per-layer scales of [P, ...] genomes (each a grid value)."""
    return np.asarray(self.grid)[self.layer_indices(genomes)]

  def key(self, genome) -> str:
    """The phenotype of one genome as a string (the search's record of what it has seen)."""
    return ",".join(map(str, self.layer_indices(np.asarray(genome)[None])[0]))

  def enumerate(self, limit: int) -> np.ndarray | None:
    """[N, ...] every genome, identity first, when there are at most `limit`; else None."""
    if self.size() > limit:
      return None
    ident = self.identity()
    rest = [g for g in self.all_genomes() if not np.array_equal(g, ident)]
    return np.stack([ident] + rest)


@dataclasses.dataclass(frozen=True)
class BezierSpace(GenomeSpace):
  """Genomes [C, 2] of Bézier control points (x layer index, y grid index), see `lpes_jax.bezier`.

  Mutation moves one control point: y by a uniform step in [−steps, steps] \\ {0} (clipped to the
  grid), x uniformly inside its neighbours' open interval (pinned ends keep their x). Crossover
  takes each control point whole from one parent, re-drawn while x is not strictly increasing.
  """
  config: bezier.BezierConfig
  kind = "bezier"

  @property
  def num_layers(self) -> int:
    return self.config.num_layers

  @property
  def grid(self) -> tuple[float, ...]:
    return self.config.grid

  def identity(self) -> np.ndarray:
    return bezier.identity_genome(self.config)

  def random(self, rng):
    C, L, M = self.config.num_control_points, self.num_layers, self.config.num_values
    if self.config.pin_ends:
      inner = np.sort(rng.choice(np.arange(1, L - 1), size=C - 2, replace=False))
      x = np.concatenate([[0], inner, [L - 1]])
    else:
      x = np.sort(rng.choice(L, size=C, replace=False))
    y = rng.integers(0, M, size=C)
    return np.stack([x, y], axis=1).astype(np.int64)

  def mutate(self, rng, genome, steps):
    g = np.array(genome, np.int64)
    C, L, M = self.config.num_control_points, self.num_layers, self.config.num_values
    c = int(rng.integers(C))
    moves = np.concatenate([np.arange(-steps, 0), np.arange(1, steps + 1)])
    g[c, 1] = np.clip(g[c, 1] + rng.choice(moves), 0, M - 1)
    if not (self.config.pin_ends and c in (0, C - 1)):
      lo = g[c - 1, 0] + 1 if c > 0 else 0
      hi = g[c + 1, 0] - 1 if c < C - 1 else L - 1
      g[c, 0] = rng.integers(lo, hi + 1)
    return g

  def crossover(self, rng, a, b, max_redraws):
    """Raises RuntimeError: no child with strictly increasing x in `max_redraws` draws."""
    for _ in range(max_redraws):
      pick = rng.integers(0, 2, size=a.shape[0]).astype(bool)
      child = np.where(pick[:, None], a, b)
      if np.all(np.diff(child[:, 0]) > 0):
        return child.astype(np.int64)
    raise RuntimeError(f"crossover found no monotone child in {max_redraws} draws")

  def validate(self, genome):
    return bezier.validate_genome(genome, self.config)

  def layer_indices(self, genomes):
    scales = np.asarray(bezier.curve_scales(np.asarray(genomes), self.config), np.float64)
    return np.argmin(np.abs(scales[..., None] - np.asarray(self.grid)), axis=-1)

  def size(self):
    C, L, M = self.config.num_control_points, self.num_layers, self.config.num_values
    xs = math.comb(L - 2, C - 2) if self.config.pin_ends else math.comb(L, C)
    return xs * M ** C

  def all_genomes(self):
    C, L, M = self.config.num_control_points, self.num_layers, self.config.num_values
    if self.config.pin_ends:
      xs = ((0, *inner, L - 1) for inner in itertools.combinations(range(1, L - 1), C - 2))
    else:
      xs = itertools.combinations(range(L), C)
    for x in xs:
      for y in itertools.product(range(M), repeat=C):
        yield np.stack([x, y], axis=1).astype(np.int64)

  def describe(self):
    return {"kind": self.kind, **dataclasses.asdict(self.config)}


@dataclasses.dataclass(frozen=True)
class FreeSpace(GenomeSpace):
  """Genomes [G] of grid indices: one per layer (G = L), or one for all layers (tied, G = 1).

  Attributes:
    num_layers: L.
    grid: the M candidate scales, strictly increasing, > 0, with 1.0 among them.
    tied: one gene for every layer (the "global" kind).
  """
  num_layers: int
  grid: tuple[float, ...] = bezier.DEFAULT_GRID
  tied: bool = False

  def __post_init__(self):
    if self.num_layers < 1:
      raise ValueError(f"FreeSpace.num_layers must be >= 1, got {self.num_layers}")
    object.__setattr__(self, "grid", tuple(float(g) for g in self.grid))
    bezier.validate_scales(np.asarray(self.grid), name="FreeSpace.grid")
    if not self.grid or any(b <= a for a, b in zip(self.grid, self.grid[1:])):
      raise ValueError(f"FreeSpace.grid must be non-empty and strictly increasing, got "
                       f"{self.grid}")
    self.identity_index  # Raises without 1.0 on the grid.

  @property
  def kind(self) -> str:
    return "global" if self.tied else "free"

  @property
  def num_genes(self) -> int:
    return 1 if self.tied else self.num_layers

  def identity(self):
    return np.full(self.num_genes, self.identity_index, np.int64)

  def random(self, rng):
    return rng.integers(0, len(self.grid), size=self.num_genes).astype(np.int64)

  def mutate(self, rng, genome, steps):
    g = np.array(genome, np.int64)
    gene = int(rng.integers(self.num_genes))
    moves = np.concatenate([np.arange(-steps, 0), np.arange(1, steps + 1)])
    g[gene] = np.clip(g[gene] + rng.choice(moves), 0, len(self.grid) - 1)
    return g

  def crossover(self, rng, a, b, max_redraws):
    pick = rng.integers(0, 2, size=self.num_genes).astype(bool)
    return np.where(pick, a, b).astype(np.int64)

  def validate(self, genome):
    g = np.asarray(genome)
    if g.shape != (self.num_genes,):
      raise ValueError(f"{self.kind} genome must have shape ({self.num_genes},), got {g.shape}")
    if not np.all(np.equal(np.mod(g, 1), 0)) or np.any(g < 0) or np.any(g >= len(self.grid)):
      raise ValueError(f"{self.kind} genome entries must be grid indices in [0, "
                       f"{len(self.grid)}), got {g.tolist()}")
    return g.astype(np.int64)

  def layer_indices(self, genomes):
    g = np.asarray(genomes)
    for i, genome in enumerate(g):
      try:
        self.validate(genome)
      except ValueError as e:
        raise ValueError(f"genome {i}: {e}") from None
    return np.broadcast_to(g.astype(np.int64), (len(g), self.num_layers)).copy() if self.tied \
        else g.astype(np.int64)

  def size(self):
    return len(self.grid) ** self.num_genes

  def all_genomes(self):
    for g in itertools.product(range(len(self.grid)), repeat=self.num_genes):
      yield np.asarray(g, np.int64)

  def describe(self):
    return {"kind": self.kind, "num_layers": self.num_layers, "grid": list(self.grid)}


def global_grid(grid, num_values: int) -> tuple[float, ...]:
  """`num_values` evenly spaced scales from min(grid) to max(grid) (the "global" kind's grid,
  as fine as the search budget allows), rounded to 6 decimals."""
  if num_values < 2:
    raise ValueError(f"global_grid needs num_values >= 2, got {num_values}")
  return tuple(float(x) for x in np.round(np.linspace(min(grid), max(grid), num_values), 6))


def make_space(kind: str, num_layers: int, *, grid=bezier.DEFAULT_GRID, control_points: int = 4,
               budget: int | None = None) -> GenomeSpace:
  """The genome space of a kind.

  Args:
    kind: one of GENOMES.
    num_layers: L.
    grid: candidate scales (the "global" kind spreads `budget` values over its range instead).
    control_points: C of the "bezier" kind.
    budget: candidates the search may evaluate (needed by "global").

  Raises:
    ValueError: unknown kind, bad grid or control points, "global" without a budget >= 2.
  """
  if kind == "bezier":
    return BezierSpace(bezier.BezierConfig(num_layers=num_layers,
                                           num_control_points=control_points, grid=grid))
  if kind == "free":
    return FreeSpace(num_layers=num_layers, grid=grid)
  if kind == "global":
    if budget is None or budget < 2:
      raise ValueError(f"the 'global' genome needs a budget of >= 2 candidates, got {budget}")
    return FreeSpace(num_layers=num_layers, grid=global_grid(grid, budget), tied=True)
  raise ValueError(f"genome kind must be one of {GENOMES}, got {kind!r}")
