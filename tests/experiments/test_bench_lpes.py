"""experiments.bench_lpes at tiny shapes on the CPU (its SmolLM2 case through the exported
folder, with and without weights), and experiments/lpes_transformers.py on that folder (only where
torch and transformers are installed)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import bench_lpes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def smoke_set(tmp_path_factory):
  """An exported tiny search set with its weights (6 examples x 2 candidates)."""
  folder = tmp_path_factory.mktemp("smoke_set")
  bench_lpes.main(["--preset", "smoke", "--export-smollm2", str(folder), "--with-weights"])
  return folder


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, smoke_set):
  out = tmp_path_factory.mktemp("bench_lpes")
  bench_lpes.main(["--preset", "smoke", "--smollm2", str(smoke_set), "--out", str(out),
                   "--reps", "1"])
  return out


def test_export_round_trips_the_search_set_and_config(tmp_path):
  """Without weights the folder is config.json + search_set.npz; read back, the rows, the
  candidates and the config are the exported ones and the weights are random, of that shape."""
  bench_lpes.main(["--preset", "smoke", "--export-smollm2", str(tmp_path), "--export-size", "5",
                   "3"])
  assert sorted(os.listdir(tmp_path)) == ["config.json", "search_set.npz"]
  config, params, batch, mults, what = bench_lpes.load_smollm2(str(tmp_path))
  ref_config, _, ref_batch, ref_mults = bench_lpes.smollm2_search_set(True, 5, 3)
  assert config == ref_config
  for name in bench_lpes.BATCH_FIELDS:
    np.testing.assert_array_equal(getattr(batch, name), getattr(ref_batch, name))
  np.testing.assert_allclose(mults, ref_mults, rtol=1e-7)
  assert what == "tiny shape, random rows, random weights"
  assert params["embed_tokens"]["embedding"].shape == (config.vocab_size, config.hidden_size)


def test_run_without_a_search_set_is_a_usage_error(tmp_path, capsys):
  with pytest.raises(SystemExit):
    bench_lpes.main(["--preset", "smoke", "--smollm2", str(tmp_path / "none"), "--out",
                     str(tmp_path)])
  assert "--export-smollm2" in capsys.readouterr().err


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
  assert results["cases"]["smollm2_kv"]["what"] == "tiny shape, random rows, its weights"
  bench_lpes.main(["--report", "--out", str(smoke_run)])
  text = capsys.readouterr().out
  assert "projected 7B search, llama7b_kv" in text and "paper: 3-4 h" in text


@pytest.mark.slow
def test_transformers_loop_counts_what_the_jax_fitness_counts(smoke_run, smoke_set):
  """The PyTorch loop on the exported tiny model, in float32, gives the JAX fitness's float32
  ("before") counts; with --random-weights it runs the folder's shape."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  with open(smoke_run / "results.json") as fh:
    ours = json.load(fh)["cases"]["smollm2_kv"]["before"]["counts"]
  script = os.path.join(ROOT, "experiments", "lpes_transformers.py")
  out = smoke_run / "transformers_smollm2.json"
  for flags in (["--random-weights"], []):
    subprocess.run([sys.executable, script, "--model", str(smoke_set), "--dtype", "float32",
                    "--out", str(out), *flags], check=True, cwd=ROOT, timeout=600)
    with open(out) as fh:
      theirs = json.load(fh)
    assert np.asarray(theirs["counts"]).shape == np.asarray(ours).shape
    assert theirs["source"].endswith("(random weights)") == bool(flags)
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
