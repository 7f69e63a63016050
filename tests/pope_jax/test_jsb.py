"""JSB chorales: the vendored benchmark, token map, detokenize, source windows, augmentation."""

import gzip
import json

import numpy as np
import pytest

from pope_jax.data import jsb


def test_vendored_benchmark_sizes_and_pitches():
  chorales = jsb.load_chorales()
  assert tuple(len(chorales[s]) for s in jsb.SPLITS) == jsb.JSB_SPLIT == (229, 76, 77)
  # The first training chorale as the data README shows it.
  np.testing.assert_array_equal(chorales["train"][0][:2], [[74, 70, 65, 58], [74, 70, 65, 58]])
  steps = {s: sum(len(c) for c in chorales[s]) for s in jsb.SPLITS}
  assert steps == {"train": 55228, "valid": 18408, "test": 18900}
  grids = np.concatenate([c for s in jsb.SPLITS for c in chorales[s]])
  assert grids.dtype == np.int16 and grids.shape[1] == 4
  sounding = grids[grids >= 0]
  assert (sounding.min(), sounding.max()) == (36, 81)
  assert 0 < (grids < 0).mean() < 0.01                      # 0.35 % silent voices.
  # SATB order: on average each voice sits above the next.
  mean = [grids[:, v][grids[:, v] >= 0].mean() for v in range(4)]
  assert mean == sorted(mean, reverse=True)


def test_load_rejects_bad_files(tmp_path):
  def write(data):
    path = tmp_path / "bad.json.gz"
    with gzip.open(path, "wt") as f:
      json.dump(data, f)
    return path
  good = [[[60, 55, 52, 48]]]
  with pytest.raises(ValueError, match="'test' split"):
    jsb.load_chorales(write({"train": good, "valid": good}))
  with pytest.raises(ValueError, match=r"\[steps, 4\]"):
    jsb.load_chorales(write({"train": good, "valid": [[[60, 55, 52]]], "test": good}))
  with pytest.raises(ValueError, match="outside MIDI"):
    jsb.load_chorales(write({"train": good, "valid": good, "test": [[[60, 55, 52, 12]]]}))
  got = jsb.load_chorales(write({"train": good, "valid": good, "test": [[[60, -1, 52, 48]]]}))
  np.testing.assert_array_equal(got["test"][0], [[60, -1, 52, 48]])


def test_token_map_by_hand():
  grid = np.array([[72, 67, 60, 48], [72, -1, 21, 108]])
  tokens = jsb.tokenize(grid)
  # BOS, then raster order S0 A0 T0 B0 S1 ...; MIDI m → token m - 20; silence → 0.
  np.testing.assert_array_equal(tokens, [89, 52, 47, 40, 28, 52, 0, 1, 88])
  assert tokens.dtype == np.int32 and jsb.VOCAB_SIZE == 90 and jsb.BOS == 89
  np.testing.assert_array_equal(jsb.tokenize(grid[:1], 2)[1:], [54, 49, 42, 30])
  with pytest.raises(ValueError, match="outside MIDI"):
    jsb.tokenize(grid, 1)                                    # 108 + 1 leaves the vocabulary.


def test_detokenize_inverts_tokenize():
  for grid in jsb.load_chorales()["valid"][:5]:
    tokens = jsb.tokenize(grid)
    back = jsb.detokenize(tokens)
    assert back.dtype == np.int16
    np.testing.assert_array_equal(back, grid)
    np.testing.assert_array_equal(jsb.detokenize(tokens[1:]), grid)      # Without BOS.
  with pytest.raises(ValueError, match="multiple of 4"):
    jsb.detokenize([89, 1, 2, 3])
  with pytest.raises(ValueError, match="note tokens"):
    jsb.detokenize([1, 2, 89, 3])


def test_sources_cover_every_note_once():
  sources = jsb.jsb_sources(512)
  chorales = jsb.load_chorales()
  for split, source in sources.items():
    weight = sum(source[i]["weights"].sum() for i in range(len(source)))
    assert weight == 4 * sum(len(c) for c in chorales[split])
  small = jsb.jsb_sources(64, pieces_per_split=(4, 2, 2), transpositions=(-1, 0, 1))
  assert [small[s].num_pieces for s in jsb.SPLITS] == [4, 2, 2]
  assert small["train"].transpositions == (-1, 0, 1) and small["test"].transpositions == (0,)
  with pytest.raises(ValueError, match="pieces_per_split"):
    jsb.jsb_sources(64, pieces_per_split=(4, 0, 2))


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
  np.testing.assert_array_equal(up["targets"],
                                np.where(same["targets"] > 0, same["targets"] + 3, 0))
  with pytest.raises(ValueError, match="outside MIDI"):
    jsb.ChoraleSource(pieces, seq_len=16, transpositions=(60,))
  with pytest.raises(IndexError):
    src[4]


def test_packed_source_is_one_stream():
  rng = np.random.default_rng(1)
  pieces = [rng.integers(50, 70, (10, 4)).astype(np.int16),
            rng.integers(50, 70, (3, 4)).astype(np.int16)]
  stream = np.concatenate([jsb.tokenize(p) for p in pieces])        # 41 + 13 = 54 tokens
  src = jsb.ChoraleSource(pieces, seq_len=16, pack=True)
  assert len(src) == 4                                              # 53 targets → 16+16+16+5
  recs = [src[i] for i in range(4)]
  # Every note token is a target once; the second piece's BOS is an input only (weight 0).
  targets = np.concatenate([r["targets"][r["weights"] > 0] for r in recs])
  np.testing.assert_array_equal(targets, np.delete(stream[1:], 40))
  np.testing.assert_array_equal(recs[2]["inputs"], stream[32:48])  # Spans both pieces.
  assert recs[3]["weights"].sum() == 5 and (recs[2]["targets"] == jsb.BOS).sum() == 1
  assert recs[2]["weights"][recs[2]["targets"] == jsb.BOS].sum() == 0
  aug = jsb.ChoraleSource(pieces, seq_len=16, transpositions=(0, 2), pack=True)
  assert len(aug) == 8
  np.testing.assert_array_equal(aug[1]["inputs"][1:], np.where(
      recs[0]["inputs"][1:] > 0, recs[0]["inputs"][1:] + 2, 0))
  sources = jsb.jsb_sources(2048, pack_train=True)
  assert sources["train"].pack and not sources["test"].pack
  assert len(sources["train"]) == -(-(4 * 55228 + 229 - 1) // 2048)


def test_packed_segments_follow_the_pieces_and_positions_restart_at_bos():
  rng = np.random.default_rng(2)
  pieces = [rng.integers(50, 70, (u, 4)).astype(np.int16) for u in (10, 3, 1, 6)]
  stream = np.concatenate([jsb.tokenize(p) for p in pieces])
  piece_of = np.repeat(np.arange(4), [1 + 4 * len(p) for p in pieces])       # [stream]
  offset = np.concatenate([np.arange(1 + 4 * len(p)) for p in pieces])        # within its piece
  src = jsb.ChoraleSource(pieces, seq_len=16, pack=True)
  for i in range(len(src)):
    r, start = src[i], 16 * i
    n = min(16, len(stream) - 1 - start)
    seg, pos = r["segment_ids"][:n], r["positions"][:n]
    # Same segment exactly when same piece; segments count up from 0 within the window.
    same = piece_of[start:start + n]
    np.testing.assert_array_equal(seg[:, None] == seg[None], same[:, None] == same[None])
    assert seg[0] == 0 and set(np.diff(seg)) <= {0, 1}
    # Positions restart at each BOS; a piece begun before the window counts from its start.
    first = same == same[0]
    np.testing.assert_array_equal(pos[~first], offset[start:start + n][~first])
    np.testing.assert_array_equal(pos[first], np.arange(first.sum()))
    assert r["segment_ids"].dtype == r["positions"].dtype == np.int32
  assert "segment_ids" not in jsb.ChoraleSource(pieces, seq_len=16)[0]
