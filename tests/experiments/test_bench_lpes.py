"""experiments.bench_lpes at tiny shapes on the CPU, and experiments/lpes_transformers.py against
the export it reads (only where torch and transformers are installed)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import bench_lpes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench_lpes")
  bench_lpes.main(["--preset", "smoke", "--out", str(out), "--reps", "1"])
  return out


@pytest.mark.slow
def test_smoke_preset_times_every_case_and_projects(smoke_run, capsys):
  with open(smoke_run / "results.json") as fh:
    results = json.load(fh)
  assert set(results["cases"]) == {"smollm2_kv", "llama7b_kv", "llama7b_mdqa"}
  assert "before" in results["cases"]["llama7b_kv"]
  for case in results["cases"].values():
    for name in {"before", "fused"} & set(case):
      assert case[name]["candidate_examples_per_s"] > 0
      assert np.asarray(case[name]["counts"]).shape == (case["candidates"], 3)
  assert (smoke_run / "smollm2_hf" / "model.safetensors").exists()
  bench_lpes.main(["--report", "--out", str(smoke_run)])
  text = capsys.readouterr().out
  assert "projected 7B search, llama7b_kv" in text and "paper: 3-4 h" in text


@pytest.mark.slow
def test_transformers_loop_counts_what_the_jax_fitness_counts(smoke_run):
  """The PyTorch loop on the exported tiny model, in float32, gives the JAX fitness's float32
  ("before") counts, and bench_lpes --report reads its JSON."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  out = smoke_run / "transformers_smollm2.json"
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "lpes_transformers.py"),
                  "--model", str(smoke_run / "smollm2_hf"), "--examples",
                  str(smoke_run / "smollm2_examples.npz"), "--dtype", "float32", "--out",
                  str(out)], check=True, cwd=ROOT, timeout=600)
  with open(out) as fh:
    theirs = json.load(fh)
  with open(smoke_run / "results.json") as fh:
    ours = json.load(fh)["cases"]["smollm2_kv"]["before"]["counts"]
  assert theirs["counts"] == ours


def test_transformers_script_imports_torch_only_inside():
  """The project does not depend on torch: the script's module level imports none of it."""
  src = open(os.path.join(ROOT, "experiments", "lpes_transformers.py")).read()
  top = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
  assert not any("torch" in line or "transformers" in line for line in top), top


def test_report_without_results_is_a_usage_error(tmp_path, capsys):
  with pytest.raises(SystemExit):
    bench_lpes.main(["--report", "--out", str(tmp_path)])
  assert "no " in capsys.readouterr().err
