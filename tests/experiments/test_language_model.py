"""Smoke tests of the language-model experiments on Shakespeare: training over seeds, length
extrapolation (with the YaRN baseline and its fine-tune), frequency usage and score bounds share
one output folder, one run folder per model and seed."""

import argparse
import json
import shutil
import statistics

import numpy as np
import pytest

from experiments import common, frequency_usage, language_model, length_extrapolation, score_bounds
from pope_jax.tasks import language_model as lm_task

MODELS = ("pope", "rope", "rope+yarn s=4", "rope+yarn s=4, fine-tuned at 128")


@pytest.fixture(scope="module")
def lm_out(tmp_path_factory):
  out = tmp_path_factory.mktemp("lm")
  summary = language_model.main(["--preset", "smoke", "--out", str(out), "--no-progress",
                                 "--seeds", "0,1"])
  assert set(summary) == {"rope", "pope"}
  return out


@pytest.fixture
def trainings(monkeypatch):
  """The run folders that train a model (rather than reload a finished one) while a test runs."""
  names = []
  real = lm_task.train_and_evaluate

  def counting(*args, **kwargs):
    names.append(kwargs["workdir"].name)
    return real(*args, **kwargs)
  monkeypatch.setattr(lm_task, "train_and_evaluate", counting)
  return names


@pytest.mark.slow
def test_language_model_smoke(lm_out):
  results = json.loads((lm_out / "results.json").read_text())
  assert [(r["encoding"], r["seed"]) for r in results["runs"]] == [
      ("rope", 0), ("pope", 0), ("rope", 1), ("pope", 1)]
  for run in results["runs"]:
    assert 1 < run["valid_perplexity"] < 1000
    assert run["data"]["split"]["valid"] == ["tempest"]
    assert run["data"]["vocab_size"] <= 400 and run["config"]["model"]["vocab_size"] % 64 == 0
  assert (lm_out / "data" / "tokenizer.json").exists()
  assert (lm_out / "loss.png").stat().st_size > 1000


@pytest.mark.slow  # trains the module's run (lm_out), as the smoke test does
def test_language_model_seeds_have_own_folders_and_mean_sd(lm_out):
  results = json.loads((lm_out / "results.json").read_text())
  for enc in ("rope", "pope"):
    # Seed 0 keeps the one-seed layout OUT/<encoding>; seed N is OUT/<encoding>_seedN.
    per_seed = [json.loads((lm_out / folder / "result.json").read_text())
                for folder in (enc, f"{enc}_seed1")]
    assert [r["seed"] for r in per_seed] == [0, 1]
    assert [r["config"]["train"]["seed"] for r in per_seed] == [0, 1]
    ppl = [r["valid_perplexity"] for r in per_seed]
    assert ppl[0] != ppl[1]
    got = results["summary"][enc]["valid_perplexity"]
    assert got["per_seed"] == ppl
    assert got["mean"] == pytest.approx((ppl[0] + ppl[1]) / 2)
    assert got["sd"] == pytest.approx(abs(ppl[0] - ppl[1]) / 2 ** 0.5)   # n - 1 = 1
    row = next(l for l in (lm_out / "results.md").read_text().splitlines()
               if l.startswith(f"| {enc} |"))
    assert f"{got['mean']:.2f} ± {got['sd']:.2f}" in row
  gap = results["comparison"]["rope_minus_pope"]
  assert gap == pytest.approx(results["summary"]["rope"]["valid_perplexity"]["mean"]
                              - results["summary"]["pope"]["valid_perplexity"]["mean"])
  assert "standard errors (Welch, 2 and 2 seeds)" in results["comparison"]["statement"]


@pytest.mark.slow
def test_language_model_resume_trains_only_new_seeds(lm_out, tmp_path, trainings):
  out = shutil.copytree(lm_out, tmp_path / "lm")
  summary = language_model.main(["--preset", "smoke", "--out", str(out), "--no-progress",
                                 "--seeds", "1,0,2", "--encodings", "pope"])
  assert trainings == ["pope_seed2"]
  results = json.loads((out / "results.json").read_text())
  assert results["summary"]["pope"]["seeds"] == [1, 0, 2]
  assert summary["pope"] == pytest.approx(
      statistics.mean(r["valid_perplexity"] for r in results["runs"]))


@pytest.mark.slow
def test_length_extrapolation_over_seeds(lm_out, trainings, capsys):
  record = length_extrapolation.main(["--preset", "smoke", "--out", str(lm_out),
                                      "--no-progress", "--seeds", "0,1"])
  # The language models of both seeds are reused; each seed fine-tunes its own YaRN model.
  assert trainings == ["rope_yarn_finetune", "rope_yarn_finetune_seed1"]
  assert "s] seed 1: YaRN fine-tune at 128 trained or reloaded" in capsys.readouterr().out
  assert record["lengths"] == [32, 96] and record["seeds"] == [0, 1]
  assert tuple(record["models"]) == MODELS and set(record["perplexity"]) == set(MODELS)
  assert record["config"]["models"]["rope+yarn s=4"]["rope_yarn"]["original_max_position"] == 32
  seeds = [record["per_seed"][s] for s in ("0", "1")]
  for model in MODELS:
    ppl = {n: [s[model][n]["perplexity"] for s in seeds] for n in ("32", "96")}
    assert ppl["32"][0] != ppl["32"][1] and all(v > 1 for v in ppl["32"] + ppl["96"])
    for n, values in ppl.items():
      got = record["perplexity"][model][n]
      assert got["per_seed"] == values
      assert got["mean"] == pytest.approx(np.mean(values))
      assert got["sd"] == pytest.approx(np.std(values, ddof=1))
    rise = [100 * (b / a - 1) for a, b in zip(ppl["32"], ppl["96"])]
    assert record["rise_percent"][model]["per_seed"] == pytest.approx(rise)
    assert record["rise_percent"][model]["mean"] == pytest.approx(np.mean(rise))
    assert record["rise_percent"][model]["sd"] == pytest.approx(np.std(rise, ddof=1))
  # YaRN changes the RoPE model's predictions (same parameters, scaled frequencies).
  assert seeds[0]["rope"]["32"]["loss"] != seeds[0]["rope+yarn s=4"]["32"]["loss"]
  # Seed 0's models are the language_model run's.
  results = json.loads((lm_out / "results.json").read_text())
  assert record["config"]["models"]["pope"] == results["runs"][1]["config"]["model"]
  assert json.loads((lm_out / "extrapolation.json").read_text())["seeds"] == [0, 1]
  assert set(record["timings"]) >= {"seed 1: rope+yarn s=4 evaluated at 2 lengths"}
  text = (lm_out / "extrapolation.md").read_text()
  mean, sd = (record["perplexity"]["pope"]["96"][k] for k in ("mean", "sd"))
  assert f"{mean:.2f} ± {sd:.2f}" in text and "1× → 3×" in text
  assert (lm_out / "extrapolation.png").stat().st_size > 1000


@pytest.mark.slow
def test_length_extrapolation_rerun_reuses_every_model(lm_out, tmp_path, trainings):
  # A copy of the shared folder, so that this test runs alone (any order, any pytest-xdist
  # worker) and leaves test_length_extrapolation_over_seeds its first run on lm_out.
  out = shutil.copytree(lm_out, tmp_path / "lm")
  flags = ["--preset", "smoke", "--out", str(out), "--no-progress", "--seeds", "0,1"]
  first = length_extrapolation.main(flags)
  for name in ("rope_yarn_finetune", "rope_yarn_finetune_seed1"):
    assert (out / name / "result.json").exists()
  trainings.clear()
  again = length_extrapolation.main(flags)
  assert trainings == []
  assert again["perplexity"] == first["perplexity"]
  assert json.loads((out / "extrapolation.json").read_text())["perplexity"] == first["perplexity"]


@pytest.mark.parametrize("main", [language_model.main, length_extrapolation.main,
                                  frequency_usage.main])
def test_repeated_seeds_are_a_usage_error(main, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    main(["--preset", "smoke", "--out", str(tmp_path / "out"), "--seeds", "0,1,0"])
  assert e.value.code == 2
  assert "--seeds: expected distinct seeds, got 0,1,0" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_length_extrapolation_refuses_an_evaluation_over_the_memory_budget(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    length_extrapolation.main(["--preset", "smoke", "--out", str(tmp_path / "out"),
                               "--eval-batch-size", "100000000"])
  assert e.value.code == 2
  assert "--eval-batch-size: evaluation length 32 at batch 100000000" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def test_frequency_usage_smoke(lm_out, trainings):
  record = frequency_usage.main(["--preset", "smoke", "--out", str(lm_out), "--no-progress",
                                 "--seeds", "0,1"])
  assert trainings == []                                    # language_model's models
  assert len(record["usage"]["rope"][0]["query"][0]) == 8   # head dim 16 → 8 RoPE pairs
  assert len(record["usage"]["pope"][1]["key"][0]) == 16    # 16 PoPE frequencies
  share = record["summary"]["encodings"]["pope"]["query"]
  assert len(share["share_per_seed"]) == 2 and share["share_sd"][0] > 0
  assert "contrast" in (lm_out / "frequency_usage.md").read_text()
  assert (lm_out / "frequency_usage.png").stat().st_size > 1000
  assert (lm_out / "frequency_share.png").stat().st_size > 1000


def test_score_bounds_smoke(lm_out, tmp_path, capsys):
  record = score_bounds.main(["--preset", "smoke", "--out", str(lm_out), "--no-progress"])
  assert len(record["per_layer"]) == 1 and 0.0 <= record["bounded_share"] <= 1.0
  assert record["windows"] == 2
  assert all(r["bound_max"] >= r["max_score"] > 0 for r in record["per_layer"])
  assert json.loads((lm_out / "score_bounds.json").read_text())["windows"] == 2
  assert (lm_out / "score_bounds.png").stat().st_size > 1000
  lines = (lm_out / "score_bounds.md").read_text().splitlines()
  header = lines.index(next(l for l in lines if l.startswith("| layer")))
  assert lines[header].count("|") == lines[header + 1].count("|") == lines[header + 2].count("|")
  for flags, message in ((["--max-windows", "0"], "--max-windows"),
                         (["--encodings", "rope"], "--encodings"),
                         (["--data-dir", str(tmp_path / "none")], "--data-dir"),
                         (["--data-dir", str(tmp_path)], "valid")):
    with pytest.raises(SystemExit):
      score_bounds.main(["--preset", "smoke", "--out", str(lm_out), "--no-progress", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_two_processes_match_one(lm_out, tmp_path):
  """Multi-host training (`--distributed`, two CPU processes with one device each, gloo) gives
  the single-process results, and process 0 alone writes the shared files."""
  import os
  import subprocess
  import sys

  import portpicker
  port = portpicker.pick_unused_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  cmd = [sys.executable, "-m", "experiments.language_model", "--preset", "smoke", "--encodings",
         "rope", "--out", str(tmp_path), "--no-progress", "--distributed", "--coordinator",
         f"localhost:{port}", "--num-processes", "2", "--process-id"]
  procs = [subprocess.Popen(cmd + [str(i)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = [p.communicate(timeout=600)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], logs
  multi = json.loads((tmp_path / "results.json").read_text())["runs"][0]
  single = next(r for r in json.loads((lm_out / "results.json").read_text())["runs"]
                if r["encoding"] == "rope")
  assert multi["valid_loss"] == pytest.approx(single["valid_loss"], rel=1e-5)
  steps = [json.loads(line)["step"] for line in
           (tmp_path / "rope" / "metrics.jsonl").read_text().splitlines()]
  assert steps == sorted(set(steps))                 # one writer: no duplicated records


@pytest.mark.parametrize("main", [language_model.main, length_extrapolation.main])
def test_init_std_flag_is_validated(main, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    main(["--preset", "smoke", "--out", str(tmp_path), "--init-std", "-0.5"])
  assert e.value.code == 2
  assert "ModelConfig.init_std must be None or > 0, got -0.5" in capsys.readouterr().err


def test_init_std_flag_reaches_the_model_config():
  parser = argparse.ArgumentParser()
  common.add_lm_flags(parser, "runs/x")
  for flag, want in (([], 0.02), (["--init-std", "flax"], None), (["--init-std", "0.01"], 0.01)):
    preset = common.resolve_lm_preset(parser.parse_args(["--preset", "smoke"] + flag))
    assert preset.model.init_std == want
