"""JSB Chorales (the standard benchmark of PoPE App. A) as a grain random-access source.

Data: `jsb_chorales_16th_separated.json.gz` beside this module, the split of Boulanger-Lewandowski,
Vincent and Bengio (ICML 2012), 229 / 76 / 77 chorales, in the "Jsb16thSeparated" format of
Coconet (Huang, Cooijmans et al., ISMIR 2017), from the public repository
czhuang/JSB-Chorales-dataset (file Jsb16thSeparated.json, commit 9a7f733), gzipped. JSON: keys
"train", "valid", "test"; each chorale a list of 16th-note steps; each step four MIDI pitches,
soprano, alto, tenor, bass, -1 for a silent voice. Pitches span 36..81.

Serialisation (PoPE App. A): raster (time-major) order, S0 A0 T0 B0 S1 A1 T1 B1 ...; a held note
repeats its pitch at every step (no onset token); every piece starts with BOS.

Token map (`VOCAB_SIZE` = 90, as the paper):

    token 0          silence (-1 in the data)
    token 1 .. 88    MIDI pitch 21 .. 108 (the piano range): token = pitch - 20
    token 89         BOS, beginning of a piece (an input only, never a target)

Shape letters: T record length (tokens), U 16th-note steps of a piece.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from pope_jax.data.packing import document_segments

VOICES = ("soprano", "alto", "tenor", "bass")
SILENCE = 0
PITCH_MIN, PITCH_MAX = 21, 108          # MIDI, inclusive: tokens 1..88.
BOS = PITCH_MAX - PITCH_MIN + 2         # 89
VOCAB_SIZE = BOS + 1                    # 90, as in PoPE App. A.
SPLITS = ("train", "valid", "test")
JSB_SPLIT = (229, 76, 77)               # Chorales per split in the standard benchmark.
DATA_FILE = Path(__file__).with_name("jsb_chorales_16th_separated.json.gz")


def load_chorales(path: str | os.PathLike = DATA_FILE) -> dict[str, list[np.ndarray]]:
  """The chorales of each split, checked against the token map.

  Args:
    path: a gzipped JSON file in the Jsb16thSeparated format (default: the vendored benchmark).

  Returns:
    {"train": [...], "valid": [...], "test": [...]}, each chorale [U, 4] int16 MIDI pitches
    (SATB columns, -1 = silence), in the file's order.

  Raises:
    ValueError: a missing split, an empty chorale, a step without exactly four voices, or a
      pitch outside MIDI 21..108.
  """
  with gzip.open(path, "rt") as f:
    data = json.load(f)
  out = {}
  for split in SPLITS:
    if split not in data:
      raise ValueError(f"{path}: no {split!r} split (keys {sorted(data)})")
    out[split] = []
    for i, chorale in enumerate(data[split]):
      grid = np.asarray(chorale, np.int16)
      if grid.ndim != 2 or grid.shape[0] == 0 or grid.shape[1] != 4:
        raise ValueError(f"{path}: {split} chorale {i} is not [steps, 4] voices "
                         f"(shape {grid.shape})")
      sounding = grid[grid >= 0]
      if (grid < -1).any() or ((sounding < PITCH_MIN) | (sounding > PITCH_MAX)).any():
        raise ValueError(f"{path}: {split} chorale {i} has a pitch outside MIDI "
                         f"{PITCH_MIN}..{PITCH_MAX} (or -1 for silence)")
      out[split].append(grid)
  return out


def tokenize(grid: np.ndarray, transpose: int = 0) -> np.ndarray:
  """Raster (time-major) token sequence of one piece, BOS first.

  Args:
    grid: [U, 4] int MIDI pitches, -1 = silence.
    transpose: semitones added to every sounding pitch.

  Returns:
    [1 + 4U] int32 tokens.

  Raises:
    ValueError: a (transposed) pitch outside MIDI 21..108.
  """
  grid = np.asarray(grid)
  sounding = grid >= 0
  pitch = grid.astype(np.int32) + transpose
  if ((pitch < PITCH_MIN) | (pitch > PITCH_MAX))[sounding].any():
    raise ValueError(f"transposition {transpose:+d} puts a pitch outside MIDI "
                     f"{PITCH_MIN}..{PITCH_MAX}")
  tokens = np.where(sounding, pitch - PITCH_MIN + 1, SILENCE).reshape(-1)
  return np.concatenate([[BOS], tokens]).astype(np.int32)


def detokenize(tokens: np.ndarray) -> np.ndarray:
  """The inverse of `tokenize`: raster tokens back to four voices (e.g. for a MIDI writer).

  Args:
    tokens: [4U] or [1 + 4U] int tokens (a leading BOS is dropped).

  Returns:
    [U, 4] int16 MIDI pitches, -1 = silence.

  Raises:
    ValueError: BOS after the first token, a token outside 0..89, or a length (after BOS) that
      is not a multiple of 4.
  """
  tokens = np.asarray(tokens).reshape(-1)
  if tokens.size and tokens[0] == BOS:
    tokens = tokens[1:]
  if ((tokens < 0) | (tokens >= BOS)).any():
    raise ValueError(f"detokenize takes note tokens 0..{BOS - 1} after an optional leading BOS")
  if tokens.size % 4:
    raise ValueError(f"detokenize needs a multiple of 4 note tokens, got {tokens.size}")
  pitch = np.where(tokens == SILENCE, -1, tokens.astype(np.int32) + PITCH_MIN - 1)
  return pitch.reshape(-1, 4).astype(np.int16)


class ChoraleSource:
  """Grain random-access source of fixed-length records from whole chorales.

  Each piece becomes ceil(4U / T) records: windows of T + 1 tokens with stride T over its token
  sequence (BOS + raster), padded with silence at zero weight, so every note token is a target
  exactly once and a window never spans two pieces. With `pack`, the pieces' token sequences are
  instead concatenated in order into one stream cut the same way (no padding but in the last
  window), and each record also carries the pieces' `segment_ids` and `positions`
  (`pope_jax.data.packing`: a piece starts at its BOS, positions restart there), so that no
  token attends across a piece boundary; BOS stays an input only (a target of weight 0), so the
  packed windows score the same note tokens as unpacked ones. With `transpositions`, every
  record appears once per semitone shift (index i → record i // len(transpositions), shift
  i % len(transpositions)): augmentation that stays random-access and deterministic; the
  trainer's shuffle mixes the shifts.

  Record: {"inputs": int32[T], "targets": int32[T], "weights": float32[T]}, and with `pack`
  "segment_ids", "positions": int32[T].
  """

  def __init__(self, pieces: Sequence[np.ndarray], seq_len: int, *,
               transpositions: Sequence[int] = (0,), pack: bool = False):
    """
    Args:
      pieces: [U, 4] grids (see `load_chorales`).
      seq_len: T.
      transpositions: semitone shifts, e.g. range(-5, 7); (0,) = none.
      pack: concatenate the pieces into one stream (class docstring).

    Raises:
      ValueError: seq_len < 1, no pieces, or a shift that leaves the pitch vocabulary.
    """
    if seq_len < 1:
      raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not pieces:
      raise ValueError("ChoraleSource needs at least one piece")
    self.seq_len = seq_len
    self.transpositions = tuple(int(t) for t in transpositions)
    if not self.transpositions:
      raise ValueError("transpositions must hold at least one shift (0 for none)")
    self._pieces = [np.asarray(p, np.int16) for p in pieces]
    for shift in self.transpositions:
      for p in self._pieces:
        tokenize(p, shift)                     # Raises on a shift out of range.
    self.pack = pack
    # With pack, one token stream per shift; piece -1 in `_windows` stands for it.
    self._streams = {t: np.concatenate([tokenize(p, t) for p in self._pieces])
                     for t in self.transpositions} if pack else {}
    lengths = ([len(self._streams[self.transpositions[0]])] if pack else
               [1 + 4 * len(p) for p in self._pieces])
    self._windows = [(-1 if pack else i, start) for i, n in enumerate(lengths)
                     for start in range(0, n - 1, seq_len)]

  def __len__(self) -> int:
    return len(self._windows) * len(self.transpositions)

  @property
  def num_pieces(self) -> int:
    return len(self._pieces)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not -len(self) <= index < len(self):
      raise IndexError(f"index {index} out of range for {len(self)} records")
    index %= len(self)
    window, shift = divmod(index, len(self.transpositions))
    piece, start = self._windows[window]
    shift = self.transpositions[shift]
    tokens = self._streams[shift] if piece < 0 else tokenize(self._pieces[piece], shift)
    tokens = tokens[start:start + self.seq_len + 1]
    n = len(tokens) - 1
    out = {"inputs": np.full(self.seq_len, SILENCE, np.int32),
           "targets": np.full(self.seq_len, SILENCE, np.int32),
           "weights": np.zeros(self.seq_len, np.float32)}
    out["inputs"][:n], out["targets"][:n], out["weights"][:n] = tokens[:-1], tokens[1:], 1.0
    if self.pack:
      out["weights"][out["targets"] == BOS] = 0.0
      out["segment_ids"], out["positions"] = document_segments(out["inputs"] == BOS)
    return out

  def __repr__(self) -> str:
    return (f"ChoraleSource({len(self._pieces)} pieces, seq_len={self.seq_len}, "
            f"transpositions={self.transpositions}, pack={self.pack}, {len(self)} records)")


def jsb_sources(seq_len: int, *, transpositions: Sequence[int] = (0,),
                pack_train: bool = False, pieces_per_split: Sequence[int] | None = None,
                path: str | os.PathLike = DATA_FILE) -> dict[str, ChoraleSource]:
  """Train/valid/test sources of the benchmark; augmentation and packing (if any) on train only,
  so evaluation always scores each chorale from its own BOS.

  Args:
    seq_len: T.
    transpositions: semitone shifts of the training pieces.
    pack_train: concatenate the training pieces into one stream (`ChoraleSource`).
    pieces_per_split: (train, valid, test) counts of the first chorales of each split to keep
      (a cheap subset for tests); None = all (229 / 76 / 77).
    path: the data file (default: the vendored benchmark).

  Returns:
    {"train", "valid", "test"} → `ChoraleSource`.

  Raises:
    ValueError: see `load_chorales` and `ChoraleSource`; pieces_per_split not three positive
      counts.
  """
  chorales = load_chorales(path)
  if pieces_per_split is not None:
    if len(pieces_per_split) != 3 or min(pieces_per_split) < 1:
      raise ValueError(f"pieces_per_split must be three positive counts, got {pieces_per_split}")
    chorales = {s: chorales[s][:n] for s, n in zip(SPLITS, pieces_per_split)}
  train = {"transpositions": transpositions, "pack": pack_train}
  return {s: ChoraleSource(chorales[s], seq_len, **(train if s == "train" else {}))
          for s in SPLITS}
