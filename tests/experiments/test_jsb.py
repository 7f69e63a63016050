"""Smoke test of `python -m experiments.jsb --preset smoke` (eight benchmark chorales, four
steps, two seeds side by side)."""

import json

import pytest

from experiments import jsb


@pytest.mark.slow
def test_jsb_smoke(tmp_path):
  out = tmp_path / "jsb"
  args = ["--preset", "smoke", "--out", str(out), "--no-progress"]
  summary = jsb.main(args)
  assert set(summary) == {"rope", "pope"}
  results = json.loads((out / "results.json").read_text())
  assert [r["seed"] for r in results["runs"]] == [0, 1, 0, 1]
  for run in results["runs"]:
    assert 0 < run["test_nll"] < 10 and 0 < run["best_test_nll"] < 10
    evals = [(h["valid_loss"], h["step"]) for h in run["history"] if "valid_loss" in h]
    assert run["best_step"] == min(evals)[1]         # Selected by (periodic) validation NLL.
    assert run["data"]["vocab_size"] == 90 and sum(run["data"]["pieces"].values()) == 8
    assert len(run["frequency_usage"]["query"]) == 1           # one layer
  for enc, s in results["summary"].items():
    assert s["test_nll_mean"] == pytest.approx(summary[enc]) and s["test_nll_sd"] > 0
    assert s["best"]["mean"] == s["test_nll_mean"] and s["last"]["sd"] > 0
  config = json.loads((out / "pope" / "result.json").read_text())
  assert config["config"]["model"]["pos_encoding"] == "pope"
  assert config["metadata"]["jax"]
  for key in ("direction", "direction_last"):
    assert "Welch's t" in results[key]["statement"] and results[key]["df"] > 0
  assert "best validation step" in results["direction"]["statement"]
  usage = results["frequency_usage"]["encodings"]
  assert len(usage["rope"]["query"]["mean"][0]) == 8 and len(usage["pope"]["key"]["mean"][0]) == 16
  text = (out / "results.md").read_text()
  assert text.count("|") > 10 and "0.5081" in text and "contrast" in text
  assert "test NLL at best valid step" in text and "test NLL at last step" in text
  for png in ("loss.png", "frequency_usage.png", "frequency_share.png"):
    assert (out / png).stat().st_size > 1000
  # A finished run with the same config is reused, not retrained.
  mtime = (out / "pope" / "result.json").stat().st_mtime_ns
  assert jsb.main(args + ["--encodings", "pope"]) == {"pope": summary["pope"]}
  assert (out / "pope" / "result.json").stat().st_mtime_ns == mtime


def test_init_std_flag_is_validated(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    jsb.main(["--preset", "smoke", "--out", str(tmp_path), "--init-std", "0"])
  assert e.value.code == 2
  assert "ModelConfig.init_std must be None or > 0, got 0.0" in capsys.readouterr().err


def test_seeds_flag_is_validated(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    jsb.main(["--preset", "smoke", "--out", str(tmp_path), "--seeds", "1,1"])
  assert e.value.code == 2
  assert "distinct" in capsys.readouterr().err


def test_attention_dropout_flag_reaches_the_model_and_is_validated(tmp_path, capsys, monkeypatch):
  seen = []
  monkeypatch.setattr(jsb.task, "run_encoding", lambda preset, *a, **k: seen.append(preset) or [])
  monkeypatch.setattr(jsb.task, "summarize", lambda *a, **k: {})
  jsb.main(["--preset", "smoke", "--out", str(tmp_path), "--attention-dropout", "0.1",
            "--encodings", "pope"])
  assert seen[0].model.attention_dropout == 0.1 and seen[0].train.select_split == "valid"
  with pytest.raises(SystemExit) as e:
    jsb.main(["--preset", "smoke", "--out", str(tmp_path), "--attention-dropout", "1"])
  assert e.value.code == 2
  assert "ModelConfig.attention_dropout must be in [0, 1)" in capsys.readouterr().err
