"""JSB chorale extraction from music21 scores: grid, voices, skips, split, source, cache."""

import time
from pathlib import Path

import numpy as np
import pytest

music21 = pytest.importorskip("music21")
from music21 import note, pitch, stream  # noqa: E402

from pope_jax.data import jsb  # noqa: E402

BACH = Path(music21.__file__).parent / "corpus" / "bach"


def _score(voices, names=("Soprano", "Alto", "Tenor", "Bass")):
  """A score with one part per voice; each voice is a list of (midi or None, quarter lengths)."""
  score = stream.Score()
  for name, voice in zip(names, voices):
    part = stream.Part()
    part.partName = name
    for midi, ql in voice:
      part.append(note.Rest(quarterLength=ql) if midi is None else
                  note.Note(pitch.Pitch(midi=midi), quarterLength=ql))
    score.insert(0, part)
  return score


def test_extract_grid_by_hand():
  score = _score([[(72, 1.0), (74, 0.5)], [(67, 0.5), (None, 0.5), (65, 0.5)],
                  [(60, 1.5)], [(48, 0.25), (50, 1.25)]])
  grid = jsb.extract_chorale(score)
  want = np.array([[72, 67, 60, 48], [72, 67, 60, 50], [72, -1, 60, 50], [72, -1, 60, 50],
                   [74, 65, 60, 50], [74, 65, 60, 50]])
  np.testing.assert_array_equal(grid, want)
  tokens = jsb.tokenize(grid)
  assert tokens[0] == jsb.BOS and len(tokens) == 1 + 24
  # Raster order: S0 A0 T0 B0 S1 ...; MIDI m → token m - 20; silence → 0.
  np.testing.assert_array_equal(tokens[1:9], [52, 47, 40, 28, 52, 47, 40, 30])
  assert tokens[1 + 2 * 4 + 1] == jsb.SILENCE          # Alto rests at step 2.


def test_voice_selection_rules():
  v = [[(72, 1.0)], [(67, 1.0)], [(60, 1.0)], [(48, 1.0)]]
  # Unnamed four parts are ordered by mean pitch.
  grid = jsb.extract_chorale(_score(v[::-1], names=("p1", "p2", "p3", "p4")))
  np.testing.assert_array_equal(grid[0], [72, 67, 60, 48])
  # Doubling instruments are ignored; two sopranos or three parts are not four-voice.
  grid = jsb.extract_chorale(_score([[(84, 1.0)]] + v, names=("Horn", "Soprano", "Alto", "Tenor",
                                                             "Bass")))
  np.testing.assert_array_equal(grid[0], [72, 67, 60, 48])
  assert jsb.extract_chorale(_score(v + [[(70, 1.0)]], names=(
      "Soprano 1", "Alto", "Tenor", "Bass", "Soprano 2"))) == "not four-voice"
  assert jsb.extract_chorale(_score(v[:3], names=("a", "b", "c"))) == "not four-voice"
  assert jsb.extract_chorale(_score([[(10, 1.0)]] + v[1:])) == "pitch out of range"


def test_real_files_skips_and_cache(tmp_path):
  corrupt = tmp_path / "broken.mxl"
  corrupt.write_bytes(b"PK\x03\x04 this is not a zip archive")
  paths = [BACH / "bwv1.6.mxl", BACH / "bwv10.7.mxl", BACH / "bwv277.krn", BACH / "bwv277.mxl",
           BACH / "choraleAnalyses" / "riemenschneider001.rntxt"
           if (BACH / "choraleAnalyses" / "riemenschneider001.rntxt").exists()
           else next(BACH.rglob("*.rntxt")), corrupt]
  t0 = time.perf_counter()
  chorales = jsb.load_chorales(paths, cache_dir=tmp_path, progress=False)
  parse_s = time.perf_counter() - t0
  assert sorted(chorales.pieces) == ["bwv1.6", "bwv10.7", "bwv277"]
  assert chorales.skipped == {"not four-voice": 1, "unparseable": 1, "duplicate": 1}
  assert chorales.skipped_files["bwv277.krn"] == "duplicate (of bwv277.mxl)"
  for grid in chorales.pieces.values():
    assert grid.ndim == 2 and grid.shape[1] == 4 and grid.dtype == np.int16
    sounding = grid[(grid >= 0).all(1)]
    # SATB order: on average each voice sits above the next.
    assert (sounding.mean(0)[:-1] > sounding.mean(0)[1:]).all()
  # BWV 1.6 is 4/4 with 80 quarter notes (music21's highestTime) → 320 16th steps.
  assert chorales.pieces["bwv1.6"].shape == (320, 4)
  t0 = time.perf_counter()
  again = jsb.load_chorales(paths, cache_dir=tmp_path, progress=False)
  assert time.perf_counter() - t0 < parse_s
  assert again.skipped == chorales.skipped
  for k, grid in chorales.pieces.items():
    np.testing.assert_array_equal(again.pieces[k], grid)


def test_split_proportions_and_determinism():
  names = [f"bwv{i}" for i in range(407)]
  split = jsb.split_names(names)
  assert [len(split[k]) for k in ("train", "valid", "test")] == [244, 81, 82]
  assert split == jsb.split_names(reversed(names))
  assert not set(split["train"]) & set(split["test"])
  assert [len(v) for v in jsb.split_names(names[:382]).values()] == [229, 76, 77]
  with pytest.raises(ValueError):
    jsb.split_names(["a", "b"])


def test_source_windows_padding_and_transposition():
  rng = np.random.default_rng(0)
  pieces = [rng.integers(50, 70, (10, 4)).astype(np.int16),
            rng.integers(50, 70, (3, 4)).astype(np.int16)]
  src = jsb.ChoraleSource(pieces, seq_len=16)
  # Piece 0: 40 note tokens → windows at 0, 16, 32; piece 1: 12 → one window.
  assert len(src) == 4
  recs = [src[i] for i in range(4)]
  tokens = jsb.tokenize(pieces[0])
  np.testing.assert_array_equal(np.concatenate([r["targets"][r["weights"] > 0]
                                                for r in recs[:3]]), tokens[1:])
  np.testing.assert_array_equal(recs[1]["inputs"], tokens[16:32])
  assert recs[2]["weights"].sum() == 8 and recs[3]["weights"].sum() == 12
  assert all(r["inputs"].dtype == np.int32 and r["weights"].dtype == np.float32 for r in recs)
  aug = jsb.ChoraleSource(pieces, seq_len=16, transpositions=(-2, 0, 3))
  assert len(aug) == 12
  up, same = aug[2], aug[1]
  np.testing.assert_array_equal(same["inputs"], recs[0]["inputs"])
  np.testing.assert_array_equal(up["targets"], np.where(same["targets"] > 0, same["targets"] + 3, 0))
  with pytest.raises(ValueError, match="outside MIDI"):
    jsb.ChoraleSource(pieces, seq_len=16, transpositions=(60,))
  with pytest.raises(IndexError):
    src[4]
