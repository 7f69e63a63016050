"""`experiments.sample_text` on a PoPE model trained with the smoke preset."""

import pytest

from experiments import language_model, sample_text


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("lm")
  language_model.main(["--preset", "smoke", "--encodings", "pope", "--out", str(out),
                       "--no-progress"])
  return out / "pope"


@pytest.mark.slow
def test_sample_text_smoke(run_dir, capsys):
  args = ["--run", str(run_dir), "--prompt", "To be", "--max-new-tokens", "6", "--top-k", "20",
          "--top-p", "0.9", "--num-samples", "2", "--seed", "3"]
  samples = sample_text.main(args)
  assert len(samples) == 2 and all(s.startswith("To be") for s in samples)
  assert "--- sample 1 ---" in capsys.readouterr().out
  assert sample_text.main(args + ["--no-progress"]) == samples            # same seed, same text
  greedy = sample_text.main(["--run", str(run_dir), "--prompt", "To be", "--temperature", "0",
                             "--max-new-tokens", "4", "--num-samples", "2", "--no-progress"])
  assert greedy[0] == greedy[1]


def test_sample_text_usage_errors(run_dir, tmp_path):
  with pytest.raises(SystemExit):
    sample_text.main(["--run", str(tmp_path)])
  with pytest.raises(SystemExit):
    sample_text.main(["--run", str(run_dir), "--top-p", "0"])


@pytest.mark.slow
def test_bench_decode_smoke(tmp_path):
  from experiments import bench_decode
  record = bench_decode.main(["--preset", "smoke", "--encodings", "pope", "--out", str(tmp_path)])
  assert len(record["results"]) == 4
  assert all(r["cached"] > 0 and r["recompute"] > 0 for r in record["results"])
  assert "cached tokens/s" in (tmp_path / "results.md").read_text()
