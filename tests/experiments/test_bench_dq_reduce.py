"""experiments.bench_dq_reduce off the GPU: its byte counts, its kernel's CUDA lowering, and its
refusal to run without a GPU."""

import numpy as np
import pytest

from experiments import bench_dq_reduce as bench


def test_visits_follow_the_causal_mask():
  # Key tile j of 64 rows is visible to the query steps j .. 63; of 128 rows, 2j .. 63.
  np.testing.assert_array_equal(bench.visits_per_tile(64), 64 - np.arange(64))
  np.testing.assert_array_equal(bench.visits_per_tile(128), 64 - 2 * np.arange(32))
  # 2080 steps per (batch, head) of 64 rows x H = 128 floats: 4.36 GB at B = 4, N = 16.
  case = bench.Case("x", 128, 64, True)
  assert bench.added_gb(case) == pytest.approx(2080 * 64 * 64 * 128 * 4e-9)


@pytest.mark.parametrize("case", bench.CASES[:2], ids=lambda c: c.label)
def test_kernel_lowers_for_cuda(case):
  text = bench.dq_adds(case).trace().lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_cpu_is_a_usage_error(capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    bench.main(["--out", str(tmp_path / "x.json")])
  assert e.value.code == 2
  assert "needs a GPU" in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()
