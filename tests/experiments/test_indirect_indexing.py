"""The main job's CLI end to end on the smoke preset: outputs, resume, bad flags."""

import json
import math
import shutil

import pytest

from experiments import indirect_indexing
from pope_jax import reporting
from pope_jax.tasks import indirect_indexing as ii
from pope_jax.data import indirect_indexing as task


def _strict_json(path):
  """Parses a file as standard JSON (NaN or Infinity fail)."""
  return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{path}: {c}"))


@pytest.mark.slow
def test_smoke_preset_writes_table_json_and_plot_and_resumes(tmp_path, capsys):
  summary = indirect_indexing.main(["--preset", "smoke", "--seeds", "0,1", "--out",
                                    str(tmp_path), "--no-progress"])
  assert set(summary) == {"rope", "pope"}
  assert summary["pope"]["seeds"] == [0, 1] and len(summary["pope"]["per_seed"]) == 2
  results = json.loads((tmp_path / "results.json").read_text())
  assert {r["encoding"] for r in results["runs"]} == {"rope", "pope"}
  assert results["configs"]["pope"]["config"]["model"]["pos_encoding"] == "pope"
  assert "test accuracy" in (tmp_path / "results.md").read_text()
  assert (tmp_path / "accuracy.png").stat().st_size > 1000
  # The per-shift breakdown covers the whole test split: weighted by the shifts' counts it gives
  # the overall test accuracy.
  preset = ii.PRESETS["smoke"].task
  shifts = [task.generate_example(preset, 0, "test", i)[2] for i in range(preset.size("test"))]
  for run in results["runs"]:
    by_shift = run["test_accuracy_by_shift"]
    assert set(by_shift) == {str(k) for k in shifts}
    weighted = sum(by_shift[str(k)] for k in shifts) / len(shifts)
    assert weighted == pytest.approx(run["test_accuracy"])
  page = (tmp_path / "results.md").read_text()
  assert "shift 0 %" in page
  # What ran, the chance level, the paper's number and the subsample behind the curves.
  assert "Preset `smoke`" in page and "M parameters" in page and "30 steps of 16" in page
  assert "Chance level: 1.9 % guessing one of the 52 letters" in page
  assert "RoPE 11.16 ± 2.45 %, PoPE 94.82 ± 2.91 %" in page
  assert "validation accuracy on the first 32 of 64 validation examples every 10 steps" in page
  # A finished run is reused on --resume (no training: the same numbers come back).
  again = indirect_indexing.main(["--preset", "smoke", "--seeds", "0,1", "--out", str(tmp_path),
                                  "--resume", "--no-progress"])
  assert again == summary
  # A fresh start into the same folder is refused (a usage error naming the folder) rather than
  # overwriting checkpoints.
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    indirect_indexing.main(["--preset", "smoke", "--seeds", "0,1", "--encodings", "rope",
                            "--out", str(tmp_path), "--no-progress"])
  assert e.value.code == 2
  assert f"{tmp_path / 'rope'}" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_starts_encodings_not_begun_and_refuses_other_configs(tmp_path, capsys):
  common = ["--preset", "smoke", "--out", str(tmp_path), "--no-progress"]
  indirect_indexing.main(common + ["--encodings", "rope"])
  summary = indirect_indexing.main(common + ["--encodings", "rope,pope", "--resume"])
  assert set(summary) == {"rope", "pope"}
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    indirect_indexing.main(common + ["--encodings", "rope", "--resume", "--batch-size", "8"])
  assert e.value.code == 2
  assert "another configuration or seeds (differs in train.batch_size)" in capsys.readouterr().err
  # The worker count does not change results: the finished run is reused.
  again = indirect_indexing.main(common + ["--encodings", "rope", "--resume",
                                           "--data-workers", "1"])
  assert again["rope"] == summary["rope"]


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0,a"], "--seeds: expected comma-separated non-negative integers, got '0,a'"),
    (["--seeds", ""], "--seeds: expected comma-separated non-negative integers, got ''"),
    (["--seeds", "1,1"], "--seeds: expected distinct non-negative integers"),
    (["--steps-per-call", "7"], "TrainConfig.steps=30 must be a multiple of steps_per_call=7"),
    (["--encodings", ""], "--encodings: name at least one of rope, pope, none"),
    (["--encodings", "rope,alibi"], "--encodings: unknown encoding 'alibi'"),
    (["--batch-size", "0"], "--batch-size: expected a positive integer, got '0'"),
    (["--steps", "0"], "--steps: expected a positive integer, got '0'"),
    (["--init-std", "gpt2"], "--init-std: expected a float or 'flax', got 'gpt2'"),
    (["--init-std", "-1"], "ModelConfig.init_std must be None or > 0, got -1.0"),
])
def test_bad_flags_are_usage_errors(tmp_path, capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    indirect_indexing.main(["--preset", "smoke", "--out", str(tmp_path)] + argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err
  assert not list(tmp_path.iterdir())


def test_summarize_without_finished_runs_names_the_folder(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    indirect_indexing.main(["--summarize", "--out", str(tmp_path / "nothing")])
  assert e.value.code == 2
  assert f"--summarize: no finished runs (*/result.json) under {tmp_path / 'nothing'}" in (
      capsys.readouterr().err)


def test_checkpoints_file_is_not_taken_for_a_run_not_begun(tmp_path):
  (tmp_path / "rope").mkdir()
  (tmp_path / "rope" / "checkpoints").write_text("")
  with pytest.raises(NotADirectoryError, match=str(tmp_path / "rope" / "checkpoints")):
    indirect_indexing.main(["--preset", "smoke", "--encodings", "rope", "--out", str(tmp_path),
                            "--resume", "--no-progress"])


@pytest.mark.slow
def test_resume_after_training_without_result_keeps_the_speed(tmp_path):
  """A run killed during its final evaluation: trained, checkpointed, no result.json."""
  argv = ["--preset", "smoke", "--encodings", "rope", "--out", str(tmp_path), "--no-progress"]
  first = indirect_indexing.main(argv)["rope"]["steps_per_second"]
  assert math.isfinite(first) and first > 0
  (tmp_path / "rope" / "result.json").unlink()
  again = indirect_indexing.main(argv + ["--resume"])["rope"]["steps_per_second"]
  assert again == first
  assert _strict_json(tmp_path / "rope" / "result.json")["runs"][0]["steps_per_second"] == first


def test_unmeasured_speed_is_null_in_json_and_na_in_the_table(tmp_path):
  run = {"encoding": "pope", "seed": 0, "test_accuracy": 0.5, "validation_accuracy": 0.5,
         "test_loss": 1.0, "steps_per_second": math.nan,
         "history": [{"step": 2, "seed": 0, "validation_accuracy": 0.5}]}
  reporting.write_json(tmp_path / "pope" / "result.json", {
      "encoding": "pope", "seeds": [0], "runs": [run], "config": {}, "metadata": {}})
  assert _strict_json(tmp_path / "pope" / "result.json")["runs"][0]["steps_per_second"] is None
  shutil.copytree(tmp_path / "pope", tmp_path / "rope")  # An older file with a bare NaN.
  (tmp_path / "rope" / "result.json").write_text(json.dumps({
      "encoding": "rope", "seeds": [0], "runs": [dict(run, encoding="rope")], "config": {},
      "metadata": {}}))
  summary = indirect_indexing.main(["--summarize", "--out", str(tmp_path)])
  assert summary["pope"]["steps_per_second"] is None and summary["rope"]["steps_per_second"] is None
  assert "| n/a |" in (tmp_path / "results.md").read_text()
  assert "nan" not in (tmp_path / "results.md").read_text().lower()
  _strict_json(tmp_path / "results.json")


def test_presets_are_consistent():
  paper = ii.PRESETS["paper"]
  assert (paper.model.num_layers, paper.model.d_model, paper.model.num_heads) == (8, 512, 8)
  assert (paper.train.steps, paper.train.batch_size, paper.train.warmup_steps) == (100_000, 64,
                                                                                     4000)
  assert (paper.train.learning_rate, paper.train.min_learning_rate, paper.train.b2) == (
      2e-4, 2e-5, 0.99)
  assert (paper.train.weight_decay, paper.train.grad_clip) == (0.01, 1.0)
  assert paper.model.delta_init == "uniform" and paper.model.dropout_rate == 0.0
  for preset in ii.PRESETS.values():
    assert preset.model.vocab_size == len(task.VOCAB)
