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
    assert 0 < run["test_nll"] < 10
    assert run["data"]["vocab_size"] == 90 and sum(run["data"]["pieces"].values()) == 8
    assert len(run["frequency_usage"]["query"]) == 1           # one layer
  for enc, s in results["summary"].items():
    assert s["test_nll_mean"] == pytest.approx(summary[enc]) and s["test_nll_sd"] > 0
  config = json.loads((out / "pope" / "result.json").read_text())
  assert config["config"]["model"]["pos_encoding"] == "pope"
  assert config["metadata"]["jax"]
  assert "standard errors" in results["direction"]["statement"]
  usage = results["frequency_usage"]["encodings"]
  assert len(usage["rope"]["query"]["mean"][0]) == 8 and len(usage["pope"]["key"]["mean"][0]) == 16
  text = (out / "results.md").read_text()
  assert text.count("|") > 10 and "0.5081" in text and "contrast" in text
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
