"""Smoke test of `python -m experiments.jsb --preset smoke` (eight real scores, four steps)."""

import json

import pytest

pytest.importorskip("music21")

from experiments import jsb  # noqa: E402


def test_jsb_smoke(tmp_path):
  out = tmp_path / "jsb"
  args = ["--preset", "smoke", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
          "--no-progress"]
  summary = jsb.main(args)
  assert set(summary) == {"rope", "pope"}
  results = json.loads((out / "results.json").read_text())
  for run in results["runs"]:
    assert 0 < run["test_nll"] < 10
    assert run["data"]["vocab_size"] == 90 and sum(run["data"]["pieces"].values()) == 8
    assert run["config"]["model"]["pos_encoding"] == run["encoding"]
    assert run["metadata"]["jax"]
  assert (out / "results.md").read_text().count("|") > 10
  assert (out / "loss.png").stat().st_size > 1000
  # A finished run with the same config is reused, not retrained.
  mtime = (out / "pope" / "result.json").stat().st_mtime_ns
  assert jsb.main(args + ["--encodings", "pope"]) == {"pope": summary["pope"]}
  assert (out / "pope" / "result.json").stat().st_mtime_ns == mtime


def test_init_std_flag_is_validated(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    jsb.main(["--preset", "smoke", "--out", str(tmp_path), "--init-std", "0"])
  assert e.value.code == 2
  assert "ModelConfig.init_std must be None or > 0, got 0.0" in capsys.readouterr().err
