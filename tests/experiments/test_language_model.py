"""Smoke tests of the language-model experiments on Shakespeare: training, length extrapolation
(with the YaRN baseline and its fine-tune), frequency usage and score bounds share one output
folder."""

import argparse
import json

import pytest

from experiments import common, frequency_usage, language_model, length_extrapolation, score_bounds


@pytest.fixture(scope="module")
def lm_out(tmp_path_factory):
  out = tmp_path_factory.mktemp("lm")
  summary = language_model.main(["--preset", "smoke", "--out", str(out), "--no-progress"])
  assert set(summary) == {"rope", "pope"}
  return out


def test_language_model_smoke(lm_out):
  results = json.loads((lm_out / "results.json").read_text())
  for run in results["runs"]:
    assert 1 < run["valid_perplexity"] < 1000
    assert run["data"]["split"]["valid"] == ["tempest"]
    assert run["data"]["vocab_size"] <= 400 and run["config"]["model"]["vocab_size"] % 64 == 0
  assert (lm_out / "data" / "tokenizer.json").exists()
  assert (lm_out / "loss.png").stat().st_size > 1000


def test_length_extrapolation_smoke(lm_out):
  record = length_extrapolation.main(["--preset", "smoke", "--out", str(lm_out),
                                      "--no-progress"])
  assert record["lengths"] == [32, 96]
  assert set(record["perplexity"]) == {"pope", "rope", "rope+yarn s=4",
                                       "rope+yarn s=4, fine-tuned at 128"}
  for per_len in record["perplexity"].values():
    assert all(v["perplexity"] > 1 for v in per_len.values())
  assert record["config"]["models"]["rope+yarn s=4"]["rope_yarn"]["original_max_position"] == 32
  # YaRN changes the RoPE model's predictions (same parameters, scaled frequencies).
  assert (record["perplexity"]["rope"]["32"]["loss"] !=
          record["perplexity"]["rope+yarn s=4"]["32"]["loss"])
  assert (lm_out / "extrapolation.png").stat().st_size > 1000
  assert "rope+yarn" in (lm_out / "extrapolation.md").read_text()


def test_frequency_usage_smoke(lm_out):
  record = frequency_usage.main(["--preset", "smoke", "--out", str(lm_out), "--no-progress",
                                 "--seeds", "0,1"])
  assert len(record["usage"]["rope"][0]["query"][0]) == 8   # head dim 16 → 8 RoPE pairs
  assert len(record["usage"]["pope"][1]["key"][0]) == 16    # 16 PoPE frequencies
  assert (lm_out / "rope_seed1" / "result.json").exists()   # Seed 0 is the shared OUT/rope.
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
