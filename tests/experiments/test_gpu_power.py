"""`experiments._gpu_power` on CPU, with an `nvidia-smi` stand-in on PATH that prints samples."""

import os
import stat

import jax.numpy as jnp
import pytest

from experiments import _gpu_power

FAKE_SMI = """#!/bin/bash
echo "$@" >> "$(dirname "$0")/calls.txt"
for arg in "$@"; do
  case "$arg" in
    --query-gpu=power.limit) echo "700.00"; exit 0;;
  esac
done
echo "1980, 120.50, 0x0000000000000000"
while true; do
  echo "1755, 698.20, 0x0000000000000004"
  echo "[N/A], [N/A], [N/A]"
  echo "1700, 690.00, [N/A]"
  sleep 0.02
done
"""


def _install(tmp_path, monkeypatch, script):
  path = tmp_path / "nvidia-smi"
  path.write_text(script)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  return tmp_path / "calls.txt"


def test_parse_samples_skips_what_does_not_parse():
  lines = ["1980, 120.50, 0x0000000000000000", "1755, 698.20, 0x0000000000000004",
           "[N/A], [N/A], [N/A]", "1700, 69", "1650, 650.0, [N/A]"]
  assert _gpu_power.parse_samples(lines) == [
      {"sm_mhz": 1980.0, "power_w": 120.5, "reasons": 0},
      {"sm_mhz": 1755.0, "power_w": 698.2, "reasons": 4},
      {"sm_mhz": 1650.0, "power_w": 650.0, "reasons": None}]


def test_summarize_burst_sustained_and_power_cap_share():
  samples = [{"sm_mhz": 1980.0, "power_w": 120.0, "reasons": 0},
             {"sm_mhz": 1800.0, "power_w": 700.0, "reasons": 4},
             {"sm_mhz": 1700.0, "power_w": 690.0, "reasons": 4 | 1},
             {"sm_mhz": 1750.0, "power_w": 695.0, "reasons": None}]
  s = _gpu_power.summarize([3.5, 3.7, 3.9, 3.8, 3.6], samples)
  assert s["burst_ms"] == 3.5
  assert s["sustained_ms"] == 3.8  # the median of the second half: 3.9, 3.8, 3.6
  assert s["sm_mhz_median"] == 1775.0 and s["sm_mhz_min"] == 1700.0
  assert s["power_w_median"] == 692.5 and s["power_w_max"] == 700.0
  assert s["power_capped_share"] == pytest.approx(2 / 3)  # of the samples with known reasons
  with pytest.raises(ValueError, match="nothing to summarise"):
    _gpu_power.summarize([], samples)


def test_sustained_run_times_windows_while_sampling(tmp_path, monkeypatch):
  calls = _install(tmp_path, monkeypatch, FAKE_SMI)
  result = _gpu_power.sustained_run(lambda x: x * 2, jnp.ones(4), seconds=0.3, idle_s=0.0,
                                    interval_ms=20)
  assert len(result["windows_ms"]) >= 1 and all(ms > 0 for ms in result["windows_ms"])
  assert result["samples"][0]["sm_mhz"] == 1980.0
  assert result["sm_mhz_min"] == 1700.0 and result["power_w_max"] == pytest.approx(698.2)
  assert 0 < result["power_capped_share"] < 1
  assert _gpu_power.power_limit_w() == 700.0
  sampled, limit = calls.read_text().splitlines()
  assert sampled.split() == [
      "--id=0", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
      "--format=csv,noheader,nounits", "--loop-ms=20"]
  assert limit.split()[:2] == ["--id=0", "--query-gpu=power.limit"]


def test_sampled_gpu_follows_cuda_visible_devices(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
  assert _gpu_power.gpu_id() == "3"


def test_failures_are_named(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="calls_per_window"):
    _gpu_power.sustained_run(lambda x: x, jnp.ones(2), seconds=0.1, calls_per_window=0)
  _install(tmp_path, monkeypatch, "#!/bin/bash\necho 'Field is not a valid field' >&2\nexit 2\n")
  with pytest.raises(RuntimeError, match="not a valid field"):
    _gpu_power.sustained_run(lambda x: x, jnp.ones(2), seconds=0.1, idle_s=0.0)
  with pytest.raises(RuntimeError, match="not a valid field"):
    _gpu_power.power_limit_w()
  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  with pytest.raises(RuntimeError, match="not on PATH"):
    _gpu_power.power_limit_w()
