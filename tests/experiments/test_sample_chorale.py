"""`experiments.sample_chorale` on the JSB smoke preset (two seeds side by side), read back with
mido."""

import mido
import numpy as np
import pytest

from experiments import jsb, sample_chorale
from pope_jax import train
from pope_jax.data import jsb as jsb_data
from pope_jax.tasks import jsb as task


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("jsb")
  jsb.main(["--preset", "smoke", "--encodings", "pope", "--out", str(out), "--no-progress"])
  return out / "pope"


def _pitches(path) -> list[list[int]]:
  """Per track, the pitches of its note-on messages."""
  return [[m.note for m in t if m.type == "note_on" and m.velocity > 0]
          for t in mido.MidiFile(path).tracks]


@pytest.mark.slow
def test_sample_chorale_smoke(run_dir, tmp_path, capsys):
  out = tmp_path / "sub" / "c.mid"
  args = ["--run", str(run_dir), "--out", str(out), "--steps", "12", "--top-k", "40",
          "--top-p", "0.95", "--seed", "3", "--model-seed", "1"]
  steps = sample_chorale.main(args)
  assert steps.shape == (12, 4) and steps.dtype == np.int16
  printed = capsys.readouterr().out
  assert "12 sampled" in printed and "seed 1" in printed
  voices = _pitches(out)
  assert len(voices) == 4 and sum(map(len, voices)) > 0
  assert all(jsb_data.PITCH_MIN <= p <= jsb_data.PITCH_MAX for v in voices for p in v)
  # Same seeds, same chorale; the progress bar changes nothing.
  again = sample_chorale.main(args + ["--no-progress", "--out", str(tmp_path / "d.mid")])
  np.testing.assert_array_equal(again, steps)
  assert (tmp_path / "d.mid").read_bytes() == out.read_bytes()
  other = sample_chorale.main(args[:-2] + ["--seed-index", "0", "--no-progress",
                                           "--out", str(tmp_path / "e.mid")])
  assert not np.array_equal(other, steps)                  # the other seed's model


def test_sample_chorale_primed(run_dir, tmp_path):
  out = tmp_path / "p.mid"
  steps = sample_chorale.main(["--run", str(run_dir), "--out", str(out), "--steps", "4",
                               "--prime-steps", "8", "--prime-chorale", "1", "--temperature", "0",
                               "--no-progress"])
  prime = jsb_data.load_chorales()["test"][1][:8]
  assert steps.shape == (12, 4)
  np.testing.assert_array_equal(steps[:8], prime)
  assert all(len(v) > 0 for v in _pitches(out))


def test_load_run_seeds(run_dir):
  config, params, seed = task.load_run(run_dir, 1)
  assert seed == 1 and config.pos_encoding == "pope" and config.vocab_size == jsb_data.VOCAB_SIZE
  assert params["embed"]["embedding"].shape == (jsb_data.VOCAB_SIZE, config.d_model)
  first = task.load_run(run_dir)[1]
  assert not np.array_equal(first["embed"]["embedding"], params["embed"]["embedding"])
  with pytest.raises(ValueError, match="not seed 7"):
    task.load_run(run_dir, 7)
  with pytest.raises(IndexError, match="outside the 2 seeds"):
    train.restore_params(run_dir, 2)


def test_restore_params_without_checkpoints(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    train.restore_params(tmp_path)


@pytest.mark.parametrize("flags, message", [
    (["--seed-index", "2"], "--seed-index 2"),
    (["--model-seed", "9"], "--model-seed 9"),
    (["--seed-index", "0", "--model-seed", "0"], "not allowed with"),
    (["--prime-steps", "100000"], "--prime-steps 100000"),
    (["--prime-chorale", "77", "--prime-steps", "1"], "--prime-chorale 77"),
    (["--top-p", "1.5"], "top_p"),
    (["--bpm", "1"], "bpm"),
    (["--steps", "0"], "--steps"),
])
def test_sample_chorale_usage_errors(run_dir, tmp_path, capsys, flags, message):
  out = tmp_path / "c.mid"
  with pytest.raises(SystemExit) as e:
    sample_chorale.main(["--run", str(run_dir), "--out", str(out), *flags])
  assert e.value.code == 2 and message in capsys.readouterr().err
  assert not out.exists()


def test_sample_chorale_not_a_run(run_dir, tmp_path, capsys):
  for argv in (["--run", str(run_dir.parent)], ["--run", str(run_dir), "--out", str(tmp_path)]):
    with pytest.raises(SystemExit) as e:
      sample_chorale.main(argv)
    assert e.value.code == 2
  err = capsys.readouterr().err
  assert "OUT/<encoding>" in err and "is a folder" in err


def test_help(capsys):
  with pytest.raises(SystemExit) as e:
    sample_chorale.main(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  assert text.startswith("usage: python -m experiments.sample_chorale ")
  options = text.split("options:\n")[1]
  for block in options.split("\n  -")[1:]:
    assert block.count("(default") <= 1, block
  flat = " ".join(text.split())                            # line breaks follow the terminal
  assert "--bpm BPM" in flat and "(default: 80.0)" in flat and "(default: 120)" in flat
