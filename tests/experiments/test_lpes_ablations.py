"""The ablation CLI on the smoke preset: outputs, resume after a kill, MoICE as a baseline,
usage errors first; the vmapped multiplier-set decoding against the named methods."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from experiments import lpes_ablations
from lpes_jax import ablation, baselines, evaluate, moice, search
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import init_params
from lpes_jax.tasks.task import TaskConfig
from lpes_jax.tokenizer import byte_tokenizer


@pytest.mark.slow
def test_smoke_run_killed_then_resumed_skips_finished_stages(tmp_path, monkeypatch, capsys):
  out = tmp_path / "run"
  argv = ["--preset", "smoke", "--out", str(out)]
  real_eval = evaluate.evaluate_positions
  calls = {"eval": 0, "search": 0}

  def killed_on_third(*args, **kwargs):
    calls["eval"] += 1
    if calls["eval"] == 3:
      raise KeyboardInterrupt          # A kill in the middle of the evaluations.
    return real_eval(*args, **kwargs)
  monkeypatch.setattr(evaluate, "evaluate_positions", killed_on_third)
  with pytest.raises(KeyboardInterrupt):
    lpes_ablations.main(argv)
  assert not (out / "results.json").exists()
  finished = sorted(p.relative_to(out).as_posix() for p in (out / "eval").rglob("*.json"))
  assert finished == ["eval/pairs3/seed3/base.json", "eval/pairs3/seed3/ms_poe.json",
                      "eval/pairs3/seed3/searched.json", "eval/pairs3/seed4/searched.json"]
  stamps = {p: (out / p).stat().st_mtime_ns for p in finished}

  with pytest.raises(SystemExit):      # The folder holds a run: only --resume continues it.
    lpes_ablations.main(argv)
  assert "pass --resume" in capsys.readouterr().err

  real_search = search.run_search

  def counted(*args, **kwargs):
    calls["search"] += 1
    return real_search(*args, **kwargs)
  monkeypatch.setattr(search, "run_search", counted)
  monkeypatch.setattr(evaluate, "evaluate_positions", real_eval)
  lpes_ablations.main(argv + ["--resume"])
  log = capsys.readouterr().out
  assert calls["search"] == 0 and log.count("done, skipped") == 12 + 4   # 12 searches, 4 evals
  assert {p: (out / p).stat().st_mtime_ns for p in finished} == stamps
  for f in ("results.json", "results.md", "accuracy.png", "seeds_pairs3.png", "seeds_pairs4.png",
            "search/linear/seed2/results.json"):
    assert (out / f).stat().st_size > 0, f
  record = json.loads((out / "results.json").read_text())
  assert record["device"] and record["versions"]["jax"] == jax.__version__
  assert set(record["summary"]) == {"3", "4"}
  methods = record["summary"]["3"]["methods"]
  assert set(methods) == {"base", "ms_poe", "bezier", "linear", "free", "global",
                          "bezier_vs_linear"}
  assert set(methods["bezier"]["per_seed"]) == {"0", "1", "2"}
  for m in ablation.SEARCHED:          # One budget: 4 + 1 · 2 = 6 candidates × 6 examples.
    assert all(v["candidate_examples"] == 36 for v in record["budget"][m].values())
  bits = record["scores"]["4"]["4"]["free/seed1"]["3"]
  assert len(bits) == 2 and set(bits) <= {"0", "1"}
  md = (out / "results.md").read_text()
  assert "Does Bézier (C = 4) beat linear interpolation (C = 2) at 3 pairs?" in md
  assert "6 × 6 = 36" in md and "## 4 pairs (transfer)" in md

  with pytest.raises(SystemExit):      # A resume with other settings names what differs.
    lpes_ablations.main(argv + ["--resume", "--num-examples", "3"])
  assert "differs in num_examples" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--search-seeds", "0,1", "--heldout-seeds", "1,2"], "must be disjoint"),
    (["--methods", "bezier,spline"], "--methods: unknown"),
    (["--baselines", "ms_poe"], "must include base"),
    (["--baselines", "base,lpes"], "--baselines: unknown"),
    (["--num-pairs", "2"], "--num-pairs 2"),
    (["--transfer-pairs", "2"], "transfer_pairs must be 0 or >= 3"),
    (["--key-length", "1", "--num-pairs", "20"], "cannot hold num_pairs=20"),
    (["--grid", "1.5,2.0"], "no value 1.0"),
    (["--population", "1"], "num_parents must be >= 1"),
    (["--search-seeds", "a"], "comma-separated non-negative integers"),
    (["--baselines", "base,moice"], "--baselines moice needs --moice-routers"),
    (["--moice-routers", "no/such/folder"], "--moice-routers: no/such/folder is not a folder"),
])
def test_bad_flags_are_usage_errors_before_the_model_loads(model, tmp_path, capsys, flags,
                                                           message):
  with pytest.raises(SystemExit) as e:
    lpes_ablations.main(model + ["--preset", "smoke", "--out", str(tmp_path)] + flags)
  assert e.value.code == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "config.json").exists()


def _smoke_routers(path, num_layers: int):
  """Random MoICE routers for the smoke model's shape with `num_layers` layers, saved to path."""
  config = dataclasses.replace(LlamaConfig(**lpes_ablations.SMOKE_MODEL), num_layers=num_layers)
  mcfg = moice.paper_config(config.rope_theta)
  moice.save_routers(path, moice.init_routers(jax.random.key(0), config, mcfg), mcfg, config)
  return str(path)


@pytest.mark.slow
def test_moice_routers_add_moice_beside_the_baselines(tmp_path):
  out = tmp_path / "run"
  routers = _smoke_routers(tmp_path / "routers", 4)
  lpes_ablations.main(["--preset", "smoke", "--out", str(out), "--methods", "bezier",
                       "--search-seeds", "0", "--heldout-seeds", "3", "--transfer-pairs", "0",
                       "--no-progress", "--moice-routers", routers])
  record = json.loads((out / "results.json").read_text())
  assert record["config"]["baselines"] == ["base", "ms_poe", "moice"]
  moice_row = record["summary"]["3"]["methods"]["moice"]
  assert set(moice_row["accuracy"]) == {"0", "1", "2"} and "lo" in moice_row["middle_gain"]
  bits = record["scores"]["3"]["3"]["moice"]
  assert set(bits) == {"0", "1", "2"} and all(len(b) == 2 for b in bits.values())
  assert (out / "eval/pairs3/seed3/moice.json").is_file()
  md = (out / "results.md").read_text()
  assert "| MoICE |" in md and f"the routers in `{routers}`" in md


@pytest.mark.slow
def test_resume_with_moice_routers_adds_moice_to_a_finished_run(tmp_path, capsys):
  out = tmp_path / "run"
  argv = ["--preset", "smoke", "--out", str(out), "--methods", "bezier", "--search-seeds", "0",
          "--heldout-seeds", "3", "--transfer-pairs", "0", "--no-progress"]
  lpes_ablations.main(argv)
  base_eval = out / "eval/pairs3/seed3/base.json"
  before = base_eval.stat().st_mtime_ns
  routers = _smoke_routers(tmp_path / "routers", 4)
  capsys.readouterr()
  lpes_ablations.main(argv + ["--resume", "--moice-routers", routers])
  log = capsys.readouterr().out
  assert "seed 3, base: done, skipped" in log and "seed 3, searched: done, skipped" in log
  assert base_eval.stat().st_mtime_ns == before
  record = json.loads((out / "results.json").read_text())
  assert "moice" in record["summary"]["3"]["methods"]
  other = _smoke_routers(tmp_path / "other", 4)   # Other routers than the run's: refused.
  with pytest.raises(SystemExit):
    lpes_ablations.main(argv + ["--resume", "--moice-routers", other])
  assert "differs in moice_routers" in capsys.readouterr().err


def test_moice_routers_of_another_model_are_a_usage_error_before_the_run(tmp_path, capsys):
  routers = _smoke_routers(tmp_path / "routers", 3)
  with pytest.raises(SystemExit) as e:
    lpes_ablations.main(["--preset", "smoke", "--out", str(tmp_path / "run"),
                         "--moice-routers", routers])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--moice-routers" in err and "4 layers" in err
  assert not (tmp_path / "run" / lpes_ablations.CONFIG_FILE).exists()


@pytest.mark.slow
def test_multiplier_sets_decode_as_the_named_methods():
  # One vmapped call over [ones, 1/1.5] gives the tokens of base and PI (s = 1.5) decoded alone.
  config = LlamaConfig(**lpes_ablations.SMOKE_MODEL)
  params = init_params(config, jax.random.key(0), scale=0.3)
  tok = byte_tokenizer()
  task = TaskConfig(task="kv", num_pairs=3, key_length=2, value_length=2)
  ev = evaluate.EvalConfig(num_examples=3, batch_size=3, max_new_tokens=5, seed=3)
  exs, t, m = next(evaluate.held_out_batches(tok, config, task, 1, ev))
  mults = np.stack([np.ones(4), np.full(4, baselines.pi_multipliers(1.5))])
  both = np.asarray(evaluate.multipliers_generator(config, params)(mults, t, m, 5))
  for row, method in zip(both, ("base", "pi")):
    alone = evaluate.method_generator(config, params, evaluate.EvalConfig(method=method))
    np.testing.assert_array_equal(row, np.asarray(alone(t, m, 5)))
  assert not np.array_equal(both[0], both[1])       # The scale changes the random model's output.
  scores = evaluate.evaluate_multipliers(evaluate.multipliers_generator(config, params), tok,
                                         config, task, ev, mults, log=lambda _: None)
  assert set(scores) == {"0", "1", "2"} and scores["1"].shape == (2, 3)


@pytest.mark.slow
def test_reuse_record_evaluates_only_moice_on_the_recorded_examples(tmp_path, capsys):
  first = tmp_path / "first"
  argv = ["--preset", "smoke", "--methods", "bezier", "--search-seeds", "0", "--heldout-seeds",
          "3", "--transfer-pairs", "0", "--no-progress"]
  lpes_ablations.main(argv + ["--out", str(first)])
  record = tmp_path / "record"                   # Kept as docs/raw/lpes/ablations keeps a run.
  record.mkdir()
  for name in ("config.json", "results.json"):
    (record / name).write_text((first / name).read_text())
  (record / "search.json").write_text(json.dumps(
      {"bezier_seed0": json.loads((first / "search/bezier/seed0/results.json").read_text())}))
  routers = _smoke_routers(tmp_path / "routers", 4)
  capsys.readouterr()
  out = tmp_path / "again"
  lpes_ablations.main(argv + ["--out", str(out), "--reuse-record", str(record),
                              "--moice-routers", routers])
  log = capsys.readouterr().out
  assert "seed 3, base: done, skipped" in log and "seed 3, searched: done, skipped" in log
  assert "search bezier seed 0: done, skipped" in log
  old, new = (json.loads((d / "results.json").read_text()) for d in (first, out))
  assert new["scores"]["3"]["3"]["base"] == old["scores"]["3"]["3"]["base"]
  assert "moice" in new["summary"]["3"]["methods"]
  with pytest.raises(SystemExit):                 # A folder that holds a run is not overwritten.
    lpes_ablations.main(argv + ["--out", str(out), "--reuse-record", str(record)])
  assert "already holds an ablation run" in capsys.readouterr().err


def test_the_recorded_h100_run_seeds_a_run_folder(tmp_path):
  from pathlib import Path
  record = Path(__file__).resolve().parents[2] / "docs/raw/lpes/ablations"
  lpes_ablations.seed_from_record(str(record), str(tmp_path))
  scores = lpes_ablations._read_json(str(record / "results.json"))["scores"]
  base = json.loads((tmp_path / "eval/pairs10/seed4/base.json").read_text())
  assert base == {"base": scores["10"]["4"]["base"]}
  searched = json.loads((tmp_path / "eval/pairs6/seed3/searched.json").read_text())
  assert len(searched) == 12 and "bezier/seed2" in searched
  assert (tmp_path / "search/global/seed1/results.json").is_file()
