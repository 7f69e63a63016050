"""Indirect indexing (PoPE §4, App. A) as a grain random-access data source.

An example: a source string of 20-40 distinct letters from [A-Za-z], a character c of it, a shift k
in [-15, 15]; the target is the character k positions from c (right for k > 0). Serialised as
characters, e.g. `TzbkWoKDyscBepYvfwxEVQtgPa, c, -8, b`; the target is the last token and the
only one with loss.

Each example is a pure function of (seed, split, index), so the 1M/10k/10k splits are never
materialised and any index can be read in any order (grain shuffles indices).

Record fields (T = `IndirectIndexingConfig.seq_len`): "inputs" int32[T] (tokens 0..T-1 of the
padded sequence), "targets" int32[T] (inputs shifted by one), "weights" float32[T] (1 at the
position that predicts the target, else 0).
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

LETTERS = string.ascii_uppercase + string.ascii_lowercase
# Token 0 is padding; then letters, digits and the separators of the serialisation.
VOCAB = ["<pad>"] + list(LETTERS) + list(string.digits) + [",", "+", "-", " "]
TOKEN_ID = {ch: i for i, ch in enumerate(VOCAB)}
SPLITS = {"train": 0, "validation": 1, "test": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndirectIndexingConfig:
  """Task parameters (PoPE App. A).

  Attributes:
    min_length, max_length: source string length range (inclusive), at most 52 (distinct letters).
    max_shift: shifts are drawn uniformly from [-max_shift, max_shift].
    allow_zero_shift: whether shift 0 may be drawn. The paper does not say; default True takes the
      range literally (assumption, overridable).
    split_sizes: examples per split (paper: 1M / 10k / 10k).
  """
  min_length: int = 20
  max_length: int = 40
  max_shift: int = 15
  allow_zero_shift: bool = True
  split_sizes: tuple[tuple[str, int], ...] = (
      ("train", 1_000_000), ("validation", 10_000), ("test", 10_000))

  def __post_init__(self):
    if not 2 <= self.min_length <= self.max_length <= len(LETTERS):
      raise ValueError(
          f"IndirectIndexingConfig needs 2 <= min_length <= max_length <= {len(LETTERS)}, got "
          f"min_length={self.min_length}, max_length={self.max_length}")
    if self.max_shift < 0 or (self.max_shift == 0 and not self.allow_zero_shift):
      raise ValueError(f"IndirectIndexingConfig.max_shift={self.max_shift} leaves no shift to draw")
    smallest = 0 if self.allow_zero_shift else 1
    if smallest >= self.max_length:
      raise ValueError(
          f"IndirectIndexingConfig: no shift in the range fits a string of at most "
          f"max_length={self.max_length} characters")
    for name, size in self.split_sizes:
      if name not in SPLITS or size <= 0:
        raise ValueError(f"IndirectIndexingConfig.split_sizes: bad entry ({name!r}, {size})")

  @property
  def seq_len(self) -> int:
    """Model input length: longest serialisation `src, c, -15, t` minus the final token."""
    return self.max_length + len(", c, -15, t") - 1

  def size(self, split: str) -> int:
    return dict(self.split_sizes)[split]


def generate_example(config: IndirectIndexingConfig, seed: int, split: str, index: int
                     ) -> tuple[str, int, int, str]:
  """One example as (source, source index of c, shift, target character).

  Deterministic in (seed, split, index). Draws the shift again while the target would fall
  outside the string.
  """
  rng = np.random.default_rng([seed, SPLITS[split], index])
  length = int(rng.integers(config.min_length, config.max_length + 1))
  source = "".join(rng.choice(list(LETTERS), size=length, replace=False))
  pos = int(rng.integers(length))
  while True:
    shift = int(rng.integers(-config.max_shift, config.max_shift + 1))
    if (shift != 0 or config.allow_zero_shift) and 0 <= pos + shift < length:
      return source, pos, shift, source[pos + shift]


def serialise(source: str, pos: int, shift: int, target: str) -> str:
  """`<source>, <char>, <±shift>, <target>` (shift 0 is written "+0")."""
  return f"{source}, {source[pos]}, {shift:+d}, {target}"


def encode(text: str) -> np.ndarray:
  """Characters → int32 token ids; raises KeyError naming an unknown character."""
  try:
    return np.array([TOKEN_ID[ch] for ch in text], np.int32)
  except KeyError as e:
    raise KeyError(f"character {e.args[0]!r} is not in the indirect-indexing vocabulary") from None


def decode(tokens) -> str:
  return "".join(VOCAB[int(t)] for t in tokens if int(t) != 0)


class IndirectIndexingSource:
  """grain random-access source of one split: `len()` and `[index]` → record (module docstring)."""

  def __init__(self, config: IndirectIndexingConfig, split: str, *, seed: int = 0):
    if split not in SPLITS:
      raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    self.config, self.split, self.seed = config, split, seed
    self._len = config.size(split)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= index < self._len:
      raise IndexError(f"index {index} out of range for split {self.split!r} of {self._len}")
    tokens = encode(serialise(*generate_example(self.config, self.seed, self.split, int(index))))
    t = self.config.seq_len
    padded = np.zeros(t + 1, np.int32)
    padded[:len(tokens)] = tokens
    weights = np.zeros(t, np.float32)
    weights[len(tokens) - 2] = 1.0                       # position whose next token is the target
    return {"inputs": padded[:-1], "targets": padded[1:], "weights": weights}

  def __repr__(self) -> str:
    return f"IndirectIndexingSource(split={self.split!r}, seed={self.seed}, len={self._len})"
