"""Packed documents in training: segment ids and positions reach the model, and a document inside
a packed window is modelled as if it stood alone."""

import dataclasses

import jax
import numpy as np
import pytest

from pope_jax import ModelConfig
from pope_jax import train as train_lib
from pope_jax.data import jsb
from pope_jax.model import Transformer

def _packed_window():
  rng = np.random.default_rng(0)
  pieces = [rng.integers(50, 70, (u, 4)).astype(np.int16) for u in (5, 3)]
  src = jsb.ChoraleSource(pieces, seq_len=40, pack=True)     # 21 + 13 tokens: one window
  return pieces, src[0]


def test_apply_model_passes_positions_and_segment_ids_when_the_batch_has_them():
  class Recorder:                                            # Stands in for a Transformer.
    def apply(self, variables, tokens, **kw):
      self.kw = kw
      return tokens
  _, rec = _packed_window()
  batch = {k: v[None] for k, v in rec.items()}
  model = Recorder()
  train_lib.apply_model(model, {}, batch, deterministic=False)
  assert set(model.kw) == {"positions", "segment_ids", "deterministic"}
  np.testing.assert_array_equal(model.kw["segment_ids"], batch["segment_ids"])
  train_lib.apply_model(model, {}, {"inputs": batch["inputs"]})
  assert model.kw == {}


@pytest.mark.parametrize("encoding", ["rope", "pope"])
def test_a_packed_chorale_is_modelled_as_if_alone(encoding):
  pieces, rec = _packed_window()
  cfg = ModelConfig(vocab_size=jsb.VOCAB_SIZE, num_layers=2, d_model=32, num_heads=2,
                    pos_encoding=encoding, attention_implementation="xla")
  model = Transformer(cfg)
  tokens = rec["inputs"][None]
  params = model.init(jax.random.key(0), tokens)["params"]
  packed = model.apply({"params": params}, tokens, positions=rec["positions"][None],
                       segment_ids=rec["segment_ids"][None])
  real = np.arange(40) < 33                                   # The stream's 34 tokens - 1.
  for i, piece in enumerate(pieces):
    where = np.flatnonzero((rec["segment_ids"] == i) & real)
    alone = jsb.tokenize(piece)[:len(where)]                   # The second loses its last.
    np.testing.assert_array_equal(rec["inputs"][where], alone)
    np.testing.assert_allclose(packed[0, where], model.apply({"params": params}, alone[None])[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_jsb_smoke_trains_packed(tmp_path):
  from experiments import jsb as cli
  summary = cli.main(["--preset", "smoke", "--pack", "--out", str(tmp_path), "--no-progress",
                      "--encodings", "pope"])
  assert 0 < summary["pope"] < 10


@pytest.mark.slow
def test_language_model_smoke_trains_packed(tmp_path):
  from experiments import language_model as cli
  summary = cli.main(["--preset", "smoke", "--pack", "--out", str(tmp_path), "--no-progress",
                      "--encodings", "rope"])
  assert 1 < summary["rope"] < 1000 and (tmp_path / "rope_packed" / "result.json").exists()
