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
  # PoPE's two cache layouts x fused and xla attention x two (context, batch) shapes.
  assert len(record["results"]) == 8
  assert {r["kv_cache_keys"] for r in record["results"]} == {"mapped", "raw"}
  for r in record["results"]:
    assert r["tokens_per_s"] > 0 and r["limit_tokens_per_s"] > 0 and r["step_bytes"] > 0
  mapped, raw = (next(r for r in record["results"] if r["kv_cache_keys"] == k) for k in
                 ("mapped", "raw"))
  assert mapped["cache_bytes"] > raw["cache_bytes"]        # Cartesian keys: 2H wide
  assert record["copy_bandwidth_bytes_per_s"] > 0
  assert "of limit" in (tmp_path / "results.md").read_text()
