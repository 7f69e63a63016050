"""The LPES command lines: GA settings from the flags, bad settings refused before a model loads."""

import json

import pytest

from experiments import lpes_eval, lpes_search

NO_MODEL = ["--model", "/nonexistent/model.gguf"]  # Never opened: the errors come first.


@pytest.fixture
def model(tmp_path, monkeypatch):
  """An (empty) model file that exists; loading it fails the test: errors must come first."""
  path = tmp_path / "model.gguf"
  path.write_bytes(b"")

  def never(*args, **kwargs):
    raise AssertionError("the model was loaded before a usage error")
  for module in (lpes_search, lpes_eval):
    monkeypatch.setattr(module, "load_checkpoint", never)
  return ["--model", str(path)]


@pytest.mark.parametrize("flags, split", [
    ([], (16, 8, 8)),
    (["--population", "4"], (2, 1, 1)),
    (["--population", "10", "--parents", "4"], (4, 3, 3)),
    (["--population", "6", "--crossovers", "0"], (3, 3, 0)),
    (["--population", "7", "--mutations", "1"], (3, 1, 3)),
])
def test_unset_ga_counts_split_the_population(flags, split):
  args = lpes_search.build_parser().parse_args(NO_MODEL + flags)
  cfg = lpes_search.search_config(args)
  assert (cfg.num_parents, cfg.num_mutations, cfg.num_crossovers) == split
  assert (args.parents, args.mutations, args.crossovers) == split  # As written to the state.


def test_search_settings_that_do_not_add_up_are_usage_errors(model, capsys):
  with pytest.raises(SystemExit) as e:
    lpes_search.main(model + ["--population", "4", "--parents", "1", "--mutations", "1",
                                 "--crossovers", "1"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "population_size = 4" in err and "--parents" in err


@pytest.mark.parametrize("flags, message", [
    (["--num-examples", "2"], "--num-examples 2"),
    (["--num-examples", "0"], "--num-examples: expected a positive integer, got '0'"),
    (["--example-batch", "0"], "--example-batch: expected a positive integer, got '0'"),
])
def test_example_counts_are_usage_errors_before_the_model_loads(model, capsys, flags, message):
  with pytest.raises(SystemExit) as e:
    lpes_search.main(model + ["--task", "kv"] + flags)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("{", "not valid JSON"),
    (json.dumps({"best": [1.0]}), "no 'scales' field"),
    (json.dumps({"scales": [1.0, -2.0]}), "scales"),
])
def test_bad_scales_file_is_a_usage_error_before_the_model_loads(model, tmp_path, capsys, content,
                                                                  message):
  path = tmp_path / "results.json"
  path.write_text(content)
  with pytest.raises(SystemExit) as e:
    lpes_eval.main(model + ["--method", "lpes", "--scales", str(path),
                               "--out", str(tmp_path / "out")])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--scales" in err and message in err


def test_missing_scales_file_is_a_usage_error(model, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    lpes_eval.main(model + ["--method", "lpes", "--scales", str(tmp_path / "none.json"),
                               "--out", str(tmp_path / "out")])
  assert e.value.code == 2
  assert "none.json" in capsys.readouterr().err


def test_fitness_id_names_what_is_scored_not_the_ga_settings():
  def parse(*flags):
    return lpes_search.fitness_id(lpes_search.build_parser().parse_args(NO_MODEL + list(flags)))

  base = parse()
  assert base["model"] == NO_MODEL[1] and base["mode"] == "teacher_forced"
  assert parse("--population", "8", "--out", "elsewhere", "--example-batch", "2") == base
  assert parse("--num-pairs", "5") != base and parse("--mode", "greedy") != base
