"""The main job's CLI end to end on the smoke preset: outputs, resume, bad flags."""

import json

import pytest

from experiments import indirect_indexing


def test_smoke_preset_writes_table_json_and_plot_and_resumes(tmp_path):
  summary = indirect_indexing.main(["--preset", "smoke", "--seeds", "0,1", "--out",
                                    str(tmp_path), "--no-progress"])
  assert set(summary) == {"rope", "pope"}
  assert summary["pope"]["seeds"] == [0, 1] and len(summary["pope"]["per_seed"]) == 2
  results = json.loads((tmp_path / "results.json").read_text())
  assert {r["encoding"] for r in results["runs"]} == {"rope", "pope"}
  assert results["configs"]["pope"]["config"]["model"]["pos_encoding"] == "pope"
  assert "test accuracy" in (tmp_path / "results.md").read_text()
  assert (tmp_path / "accuracy.png").stat().st_size > 1000
  # A finished run is reused on --resume (no training: the same numbers come back).
  again = indirect_indexing.main(["--preset", "smoke", "--seeds", "0,1", "--out", str(tmp_path),
                                  "--resume", "--no-progress"])
  assert again == summary
  # A fresh start into the same folder is refused rather than overwriting checkpoints.
  with pytest.raises(FileExistsError, match="checkpoints"):
    indirect_indexing.main(["--preset", "smoke", "--seeds", "0,1", "--encodings", "rope",
                            "--out", str(tmp_path), "--no-progress"])


def test_resume_starts_encodings_not_begun_and_refuses_other_configs(tmp_path):
  common = ["--preset", "smoke", "--out", str(tmp_path), "--no-progress"]
  indirect_indexing.main(common + ["--encodings", "rope"])
  summary = indirect_indexing.main(common + ["--encodings", "rope,pope", "--resume"])
  assert set(summary) == {"rope", "pope"}
  with pytest.raises(ValueError, match="another configuration"):
    indirect_indexing.main(common + ["--encodings", "rope", "--resume", "--batch-size", "8"])


def test_unknown_encoding_is_named(tmp_path):
  with pytest.raises(SystemExit, match="alibi"):
    indirect_indexing.main(["--preset", "smoke", "--encodings", "alibi", "--out", str(tmp_path)])


def test_presets_are_consistent():
  paper = indirect_indexing.PRESETS["paper"]
  assert (paper.model.num_layers, paper.model.d_model, paper.model.num_heads) == (8, 512, 8)
  assert (paper.train.steps, paper.train.batch_size, paper.train.warmup_steps) == (100_000, 64,
                                                                                     4000)
  assert (paper.train.learning_rate, paper.train.min_learning_rate, paper.train.b2) == (
      2e-4, 2e-5, 0.99)
  assert (paper.train.weight_decay, paper.train.grad_clip) == (0.01, 1.0)
  assert paper.model.delta_init == "uniform" and paper.model.dropout_rate == 0.0
  for preset in indirect_indexing.PRESETS.values():
    assert preset.model.vocab_size == len(indirect_indexing.task.VOCAB)
