"""Usage errors of every CLI come before any work (no model load, no data, no step), exit with
status 2 and name the flag."""

import json

import pytest

from experiments import (bench_llama, indirect_indexing, jsb, language_model, lpes_ablations,
                         lpes_eval, lpes_generate, lpes_latency, lpes_search, moice_sweep,
                         moice_train)


def _never(*args, **kwargs):
  raise AssertionError("work started before a usage error")


@pytest.fixture
def no_training(monkeypatch):
  """Training any experiment's model fails the test."""
  monkeypatch.setattr(indirect_indexing.ii, "run_encoding", _never)
  monkeypatch.setattr(jsb.task, "run_encoding", _never)
  monkeypatch.setattr(language_model.lm, "train_model", _never)


def _usage_error(capsys, main, argv) -> str:
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  return capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--weights", "1,1"], "--weights: give one weight per subset (begin, middle, end), got 2"),
    (["--weights", "1,x,1"], "--weights: expected comma-separated numbers, got '1,x,1'"),
    (["--grid", "1,a"], "--grid: expected comma-separated numbers, got '1,a'"),
    (["--grid", "2,1"], "--grid: BezierConfig.grid must be non-empty and strictly increasing"),
    (["--grid", "0,1"], "--grid: BezierConfig.grid"),
    (["--control-points", "1"], "--control-points 1: a curve needs at least 2"),
    (["--control-points", "0"], "--control-points: expected a positive integer, got '0'"),
    (["--num-pairs", "0"], "--num-pairs must be at least 1, got 0"),
    (["--population", "0"], "--population: expected a positive integer, got '0'"),
    (["--seed", "-1"], "--seed: expected a non-negative integer, got '-1'"),
    (["--task", "mdqa"], "--task mdqa needs --mdqa-file"),
    (["--key-length", "1", "--num-pairs", "100"], "--key-length"),
])
def test_lpes_search_flags(model, capsys, flags, message):
  assert message in _usage_error(capsys, lpes_search.main, model + flags)


def test_missing_model_is_a_usage_error(capsys, tmp_path):
  err = _usage_error(capsys, lpes_search.main, ["--model", str(tmp_path / "none.gguf")])
  assert "--model" in err and "does not exist" in err


def test_out_that_is_a_file_is_a_usage_error(model, capsys, tmp_path):
  out = tmp_path / "file"
  out.write_text("")
  for main, extra in ((lpes_search.main, model), (lpes_eval.main, model),
                      (lpes_latency.main, []), (indirect_indexing.main, ["--preset", "smoke"]),
                      (jsb.main, ["--preset", "smoke"]),
                      (language_model.main, ["--preset", "smoke"])):
    err = _usage_error(capsys, main, extra + ["--out", str(out)])
    assert "--out" in err and "is a file" in err, (main, err)


def test_read_only_out_is_a_usage_error(model, capsys, tmp_path, monkeypatch):
  from experiments import common

  def read_only(folder):
    raise PermissionError(f"run folder {folder} is not writable: cannot create its lock file "
                          f"(Permission denied)")
  monkeypatch.setattr(common, "run_lock", read_only)
  err = _usage_error(capsys, lpes_search.main, model + ["--out", str(tmp_path / "ro")])
  assert f"--out {tmp_path / 'ro'}: run folder" in err and "is not writable" in err


def test_existing_search_without_resume_is_a_usage_error(model, capsys, tmp_path):
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "search_state.json").write_text("{}")
  err = _usage_error(capsys, lpes_search.main, model + ["--out", str(tmp_path / "out")])
  assert "pass --resume" in err
  assert not (tmp_path / "out" / ".lock").exists()        # Released on the usage error.


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer, got '0'"),
    (["--positions", "1,a"], "--positions: expected comma-separated non-negative integers"),
    (["--positions", "0,140"], "--positions 0,140: gold positions must be below --num-pairs 140"),
    (["--batch-size", "0"], "--batch-size: expected a positive integer"),
    (["--pi-scale", "0"], "--pi-scale: expected a positive finite number, got '0'"),
    (["--pi-scale", "inf"], "--pi-scale: expected a positive finite number, got 'inf'"),
])
def test_lpes_eval_flags(model, capsys, flags, message):
  assert message in _usage_error(capsys, lpes_eval.main, model + flags)


def test_lpes_eval_baseline_is_checked_before_loading(model, capsys, tmp_path):
  missing = str(tmp_path / "none.json")
  assert f"--baseline {missing}" in _usage_error(capsys, lpes_eval.main,
                                                 model + ["--baseline", missing])
  other = tmp_path / "mdqa.json"
  other.write_text('{"task": "mdqa", "accuracy": {"0": 0.5}}')
  assert "its task 'mdqa' is not --task 'kv'" in _usage_error(
      capsys, lpes_eval.main, model + ["--baseline", str(other)])


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer, got '0'"),
    (["--rope-multipliers", "0"], "--rope-multipliers '0': multipliers must be finite and > 0"),
    (["--rope-multipliers", "1,x"], "--rope-multipliers '1,x': expected a number"),
])
def test_lpes_generate_flags(model, capsys, flags, message):
  assert message in _usage_error(capsys, lpes_generate.main, model + ["--prompt", "Hi"] + flags)


@pytest.mark.parametrize("main, flags, message", [
    (lpes_latency.main, ["--methods", "base,foo"], "--methods: unknown method 'foo'"),
    (lpes_latency.main, ["--new-tokens", "0"], "--new-tokens: expected a positive integer"),
    (bench_llama.main, ["--reps", "0"], "--reps: expected a positive integer, got '0'"),
])
def test_benchmark_flags(model, capsys, main, flags, message):
  assert message in _usage_error(capsys, main, flags)


def test_bench_llama_out_that_is_a_folder_is_a_usage_error(model, capsys, tmp_path):
  err = _usage_error(capsys, bench_llama.main, ["--suite", "gpu", "--out", str(tmp_path)])
  assert "--out" in err and "is a folder" in err


@pytest.mark.parametrize("main, flags, message", [
    (jsb.main, ["--encodings", "rope,alibi"], "--encodings: unknown encoding 'alibi'"),
    (jsb.main, ["--transpose", "-1"], "--transpose: expected a non-negative integer"),
    (jsb.main, ["--steps", "0"], "--steps: expected a positive integer, got '0'"),
    (language_model.main, ["--encodings", "alibi"], "--encodings: unknown encoding 'alibi'"),
    (language_model.main, ["--splits", "train"], "--splits: expected split=file pairs"),
    (language_model.main, ["--num-processes", "0"], "--num-processes: expected a positive"),
    (language_model.main, ["--num-processes", "2", "--process-id", "2"],
     "--process-id 2 must be below --num-processes 2"),
    (indirect_indexing.main, ["--data-workers", "-1"], "--data-workers: expected a non-negative"),
])
def test_training_flags(no_training, capsys, tmp_path, main, flags, message):
  err = _usage_error(capsys, main, ["--preset", "smoke", "--out", str(tmp_path / "o")] + flags)
  assert message in err
  assert not (tmp_path / "o").exists()


def test_every_flag_has_help_and_its_default_once(capsys, monkeypatch):
  from experiments import common
  made = []
  real = common.make_parser
  monkeypatch.setattr(common, "make_parser", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
  for module in (indirect_indexing, jsb, language_model, lpes_eval, lpes_generate, lpes_latency,
                 lpes_search, bench_llama, moice_train, moice_sweep, lpes_ablations):
    name = module.__name__.split(".")[-1]
    with pytest.raises(SystemExit) as e:
      module.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m experiments.{name} ")
    for action in made[-1]._actions:
      assert action.help, (name, action.option_strings)
    options = text.split("options:\n")[1].split("\n\n")[0]
    for block in options.split("\n  -")[1:]:
      assert block.count("(default") <= 1, (name, block)
      assert not block.rstrip().endswith(":"), (name, block)     # No help cut mid-sentence.


def test_help_lists_the_presets(capsys):
  for module, presets in ((indirect_indexing, indirect_indexing.ii.PRESETS),
                          (jsb, jsb.task.PRESETS), (language_model, language_model.lm.PRESETS),
                          (lpes_latency, lpes_latency.PRESETS),
                          (moice_train, moice_train.PRESETS),
                          (moice_sweep, moice_sweep.PRESETS),
                          (lpes_ablations, lpes_ablations.PRESETS)):
    with pytest.raises(SystemExit):
      module.main(["--help"])
    epilog = capsys.readouterr().out.split("presets:\n")[1]
    assert {line.split()[0] for line in epilog.strip().splitlines()} == set(presets)
