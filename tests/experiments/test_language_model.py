"""Smoke tests of the language-model experiments on Shakespeare: training, length extrapolation
(with the YaRN baseline and its fine-tune) and frequency usage share one output folder."""

import json

import pytest

from experiments import frequency_usage, language_model, length_extrapolation


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
  record = frequency_usage.main(["--preset", "smoke", "--out", str(lm_out), "--no-progress"])
  assert len(record["usage"]["rope"]["query"][0]) == 8      # head dim 16 → 8 RoPE pairs
  assert len(record["usage"]["pope"]["key"][0]) == 16       # 16 PoPE frequencies
  assert (lm_out / "frequency_usage.png").stat().st_size > 1000
