"""`experiments._gpu_power` on CPU, with an `nvidia-smi` stand-in on PATH that prints samples."""

import os
import stat

import jax.numpy as jnp
import pytest

from experiments import _gpu_power

FAKE_SMI = """#!/bin/bash
case "$1" in
  --query-gpu=power.limit) echo "700.00"; exit 0;;
esac
echo "1980, 120.50, 0x0000000000000000"
while true; do
  echo "1755, 698.20, 0x0000000000000004"
  echo "[N/A], [N/A], [N/A]"
  sleep 0.02
done
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
  path = tmp_path / "nvidia-smi"
  path.write_text(FAKE_SMI)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  return path


def test_parse_samples_skips_what_does_not_parse():
  lines = ["1980, 120.50, 0x0000000000000000", "1755, 698.20, 0x0000000000000004",
           "[N/A], [N/A], [N/A]", "1700, 69"]
  assert _gpu_power.parse_samples(lines) == [
      {"sm_mhz": 1980.0, "power_w": 120.5, "reasons": 0},
      {"sm_mhz": 1755.0, "power_w": 698.2, "reasons": 4}]


def test_summarize_burst_sustained_and_power_cap_share():
  samples = [{"sm_mhz": 1980.0, "power_w": 120.0, "reasons": 0},
             {"sm_mhz": 1800.0, "power_w": 700.0, "reasons": 4},
             {"sm_mhz": 1700.0, "power_w": 690.0, "reasons": 4 | 1}]
  s = _gpu_power.summarize([3.5, 3.7, 3.9, 3.8, 3.6], samples)
  assert s["burst_ms"] == 3.5
  assert s["sustained_ms"] == 3.8  # the median of the second half: 3.9, 3.8, 3.6
  assert s["sm_mhz_median"] == 1800.0 and s["sm_mhz_min"] == 1700.0
  assert s["power_w_median"] == 690.0 and s["power_w_max"] == 700.0
  assert s["power_capped_share"] == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="nothing to summarise"):
    _gpu_power.summarize([], samples)


def test_sustained_run_times_windows_while_sampling(fake_smi):
  result = _gpu_power.sustained_run(lambda x: x * 2, jnp.ones(4), seconds=0.3, idle_s=0.0,
                                    interval_ms=20)
  assert len(result["windows_ms"]) >= 1 and all(ms > 0 for ms in result["windows_ms"])
  assert result["samples"][0]["sm_mhz"] == 1980.0
  assert result["sm_mhz_min"] == 1755.0 and result["power_w_max"] == pytest.approx(698.2)
  assert 0 < result["power_capped_share"] < 1
  assert _gpu_power.power_limit_w() == 700.0


def test_missing_nvidia_smi_is_named(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(RuntimeError, match="nvidia-smi"):
    _gpu_power.sustained_run(lambda x: x, jnp.ones(2), seconds=0.1, idle_s=0.0)
