"""JSB-style Bach chorales extracted from music21's corpus, as a grain random-access source.

Representation (PoPE App. A, after Boulanger-Lewandowski et al. 2012 and Huang et al. 2017's
16th-note JSB): four voices, soprano, alto, tenor, bass, sampled on a 16th-note grid (0.25
quarter lengths); each grid step is the MIDI pitch sounding in each voice, or silence. A piece is
serialised time-major (raster order): S0 A0 T0 B0 S1 A1 T1 B1 ... A held note repeats its pitch
at every step (as in JSB, no separate onset token).

Vocabulary (fixed, `VOCAB_SIZE` = 90): 0 silence, 1..88 MIDI pitches 21..108 (the piano range),
89 beginning-of-piece (`BOS`). Records start with BOS; targets are every note token.

Extraction rules (`extract_chorale`): a score is four-voice when exactly one part's name begins
with each of "Soprano", "Alto", "Tenor", "Bass" (instrument doubling parts are ignored), or, with
no such names, when it has exactly four parts (ordered by mean pitch, high to low). Everything
else (roman-numeral analyses, two-soprano scores, piano reductions) is skipped and counted, as are
files music21 cannot parse and pitches outside the vocabulary. Chords within a voice keep their
highest pitch. Repeats are not expanded.

Split (`split_names`): the extracted pieces sorted by file name, permuted with
`numpy.random.default_rng(0)`, then cut in the original JSB proportions 229/76/77 (of 382):
n_train = round(n·229/382), n_valid = round(n·76/382), the rest test. With music21 10.5.1, 407
of the 433 files are four-voice (26 skipped: 20 roman-numeral analyses, BWV 227.3 and 27.6 with
five voices, BWV 846, a keyboard prelude, and 3 Humdrum duplicates of MusicXML files), split
244/81/82.

Parsing all 433 files takes 20-70 s on one CPU core, so `load_chorales` caches the extracted
arrays (`chorales.npz` + `chorales.json`) in a cache folder keyed by the extraction version and
the music21 version.

Shape letters: T record length (tokens), U grid steps of a piece.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tqdm.auto import tqdm

VOICES = ("soprano", "alto", "tenor", "bass")
SILENCE = 0
PITCH_MIN, PITCH_MAX = 21, 108          # MIDI, inclusive: tokens 1..88.
BOS = PITCH_MAX - PITCH_MIN + 2         # 89
VOCAB_SIZE = BOS + 1                    # 90, as in PoPE App. A.
STEPS_PER_QUARTER = 4                   # 16th-note grid.
JSB_SPLIT = (229, 76, 77)               # Original JSB train/valid/test counts.
_MUSICXML = (".mxl", ".xml", ".musicxml")
EXTRACTION_VERSION = 2                  # Bump when the rules above change (invalidates caches).


@dataclasses.dataclass(frozen=True)
class Chorales:
  """Extracted pieces: name → [U, 4] int16 MIDI pitches (-1 = silence), plus skip counts."""
  pieces: dict[str, np.ndarray]
  skipped: dict[str, int]
  skipped_files: dict[str, str]


def _voice_parts(score) -> list | None:
  """The score's SATB parts in that order, or None when it is not four-voice."""
  parts = list(score.parts)
  by_voice: dict[str, list] = {v: [] for v in VOICES}
  for part in parts:
    name = (part.partName or str(part.id) or "").strip().split()
    first = name[0].lower() if name else ""
    if first in by_voice:
      by_voice[first].append(part)
  if any(by_voice.values()):
    if all(len(v) == 1 for v in by_voice.values()):
      return [by_voice[v][0] for v in VOICES]
    return None
  if len(parts) != 4:
    return None
  def mean_pitch(part):
    ps = [n.pitches[-1].midi for n in part.flatten().notes]
    return float(np.mean(ps)) if ps else -1.0
  return sorted(parts, key=mean_pitch, reverse=True)


def extract_chorale(score) -> np.ndarray | str:
  """Four voices on a 16th-note grid.

  Args:
    score: a parsed `music21.stream.Score`.

  Returns:
    [U, 4] int16 MIDI pitches (SATB columns, -1 = silence), or a string naming why the score was
    skipped ("not four-voice", "pitch out of range", "empty").
  """
  parts = _voice_parts(score)
  if parts is None:
    return "not four-voice"
  steps = int(round(float(score.highestTime) * STEPS_PER_QUARTER))
  if steps <= 0:
    return "empty"
  grid = np.full((steps, 4), -1, np.int16)
  for v, part in enumerate(parts):
    for note in part.flatten().notes:
      start = int(round(float(note.offset) * STEPS_PER_QUARTER))
      end = int(round(float(note.offset + note.quarterLength) * STEPS_PER_QUARTER))
      if end <= start:                     # Grace notes have no duration on the grid.
        continue
      pitch = max(p.midi for p in note.pitches)
      if not PITCH_MIN <= pitch <= PITCH_MAX:
        return "pitch out of range"
      grid[start:min(end, steps), v] = pitch
  if (grid < 0).all():
    return "empty"
  return grid


def extract_files(paths: Iterable[str | os.PathLike], *, progress: bool = False) -> Chorales:
  """Parses score files with music21 and extracts the four-voice ones.

  A file music21 cannot parse counts as "unparseable"; no file raises. When two files share a
  stem (music21 ships BWV 277, 281 and 366 as both Humdrum and MusicXML) the MusicXML one is used
  and the other counts as "duplicate".

  Args:
    paths: score files (MusicXML, Humdrum, ...; anything `music21.converter.parse` reads).
    progress: show a tqdm bar.

  Returns:
    `Chorales` keyed by file stem (e.g. "bwv1.6").
  """
  from music21 import converter  # Lazy: music21 import costs ~1 s.
  pieces, skipped, skipped_files = {}, {}, {}
  paths = [Path(p) for p in paths]
  preferred = {}
  for path in sorted(paths, key=lambda p: (p.suffix.lower() not in _MUSICXML, p.name)):
    preferred.setdefault(path.stem, path)
  for path in tqdm(paths, desc="music21 parse", disable=not progress):
    if preferred[path.stem] != path:
      out = f"duplicate (of {preferred[path.stem].name})"
    else:
      try:
        out = extract_chorale(converter.parse(path))
      except Exception as e:  # music21 raises many exception types on corrupt input.
        out = f"unparseable ({type(e).__name__})"
    if isinstance(out, str):
      reason = out.split(" (")[0]
      skipped[reason] = skipped.get(reason, 0) + 1
      skipped_files[path.name] = out
    else:
      pieces[path.stem] = out
  return Chorales(pieces=pieces, skipped=skipped, skipped_files=skipped_files)


def music21_bach_paths() -> list[Path]:
  """The 433 files of music21's `corpus/bach`, sorted by name."""
  from music21 import corpus
  return sorted(Path(p) for p in corpus.getComposer("bach"))


def default_cache_dir() -> Path:
  """$POPE_JAX_CACHE, else ~/.cache/pope_jax."""
  return Path(os.environ.get("POPE_JAX_CACHE", Path.home() / ".cache" / "pope_jax"))


def load_chorales(paths: Sequence[str | os.PathLike] | None = None, *,
                  cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Chorales:
  """Extracted chorales, from the on-disk cache when the same files were extracted before.

  Args:
    paths: score files (default: all of music21's `corpus/bach`).
    cache_dir: where `jsb-<key>/chorales.npz` lives (default `default_cache_dir()`); the key hashes
      the extraction version, the music21 version and the file names and sizes.
    progress: tqdm bar while parsing.

  Returns:
    `Chorales`.
  """
  import music21
  paths = music21_bach_paths() if paths is None else [Path(p) for p in paths]
  key = hashlib.sha256(json.dumps(
      [EXTRACTION_VERSION, music21.__version__,
       [(p.name, p.stat().st_size) for p in paths]]).encode()).hexdigest()[:16]
  folder = Path(cache_dir or default_cache_dir()) / f"jsb-{key}"
  npz, meta = folder / "chorales.npz", folder / "chorales.json"
  if npz.exists() and meta.exists():
    with np.load(npz) as data:
      info = json.loads(meta.read_text())
      return Chorales(pieces={name: data[name] for name in info["names"]},
                      skipped=info["skipped"], skipped_files=info["skipped_files"])
  chorales = extract_files(paths, progress=progress)
  folder.mkdir(parents=True, exist_ok=True)
  np.savez(npz, **chorales.pieces)
  meta.write_text(json.dumps({"names": list(chorales.pieces), "skipped": chorales.skipped,
                              "skipped_files": chorales.skipped_files,
                              "music21": music21.__version__,
                              "extraction_version": EXTRACTION_VERSION}, indent=1))
  return chorales


def split_names(names: Iterable[str], seed: int = 0) -> dict[str, list[str]]:
  """The fixed train/valid/test split in JSB's 229/76/77 proportions (module docstring).

  Raises:
    ValueError: fewer than 3 pieces.
  """
  names = sorted(names)
  n = len(names)
  if n < 3:
    raise ValueError(f"need at least 3 pieces to split, got {n}")
  order = [names[i] for i in np.random.default_rng(seed).permutation(n)]
  total = sum(JSB_SPLIT)
  n_train = max(1, round(n * JSB_SPLIT[0] / total))
  n_valid = max(1, round(n * JSB_SPLIT[1] / total))
  n_train = min(n_train, n - n_valid - 1)
  return {"train": sorted(order[:n_train]), "valid": sorted(order[n_train:n_train + n_valid]),
          "test": sorted(order[n_train + n_valid:])}


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


class ChoraleSource:
  """Grain random-access source of fixed-length records from whole chorales.

  Each piece becomes ceil(4U / T) records: windows of T + 1 tokens with stride T over its token
  sequence (BOS + raster), padded with silence at zero weight, so every note token is a target
  exactly once. With `transpositions`, every record appears once per semitone shift (index
  i → record i // len(transpositions), shift i % len(transpositions)): augmentation that stays
  random-access and deterministic; the trainer's shuffle mixes the shifts.

  Record: {"inputs": int32[T], "targets": int32[T], "weights": float32[T]}.
  """

  def __init__(self, pieces: Sequence[np.ndarray], seq_len: int, *,
               transpositions: Sequence[int] = (0,)):
    """
    Args:
      pieces: [U, 4] grids (see `extract_chorale`).
      seq_len: T.
      transpositions: semitone shifts, e.g. range(-5, 7); (0,) = none.

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
    self._windows = [(i, start) for i, p in enumerate(self._pieces)
                     for start in range(0, 4 * len(p), seq_len)]

  def __len__(self) -> int:
    return len(self._windows) * len(self.transpositions)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not -len(self) <= index < len(self):
      raise IndexError(f"index {index} out of range for {len(self)} records")
    index %= len(self)
    window, shift = divmod(index, len(self.transpositions))
    piece, start = self._windows[window]
    tokens = tokenize(self._pieces[piece], self.transpositions[shift])
    tokens = tokens[start:start + self.seq_len + 1]
    n = len(tokens) - 1
    out = {"inputs": np.full(self.seq_len, SILENCE, np.int32),
           "targets": np.full(self.seq_len, SILENCE, np.int32),
           "weights": np.zeros(self.seq_len, np.float32)}
    out["inputs"][:n], out["targets"][:n], out["weights"][:n] = tokens[:-1], tokens[1:], 1.0
    return out

  def __repr__(self) -> str:
    return (f"ChoraleSource({len(self._pieces)} pieces, seq_len={self.seq_len}, "
            f"transpositions={self.transpositions}, {len(self)} records)")


def jsb_sources(seq_len: int, *, transpositions: Sequence[int] = (0,),
                paths: Sequence[str | os.PathLike] | None = None,
                cache_dir: str | os.PathLike | None = None,
                progress: bool = True) -> tuple[dict[str, ChoraleSource], Chorales, dict]:
  """Train/valid/test sources; augmentation (if any) on train only.

  Returns:
    (sources by split, the extracted `Chorales`, the split as {split: [names]}).
  """
  chorales = load_chorales(paths, cache_dir=cache_dir, progress=progress)
  split = split_names(chorales.pieces)
  sources = {name: ChoraleSource([chorales.pieces[n] for n in names], seq_len,
                                 transpositions=transpositions if name == "train" else (0,))
             for name, names in split.items()}
  return sources, chorales, split
