"""The MoICE command lines: moice_train's smoke preset end to end (with resume), and usage errors
of moice_train and `lpes_eval --method moice` before any model loads."""

import json
import shutil

import pytest

from experiments import lpes_eval, moice_train
from lpes_jax import moice
from lpes_jax.config import LlamaConfig


@pytest.fixture(scope="module")
def gguf():
  from lpes_jax.assets import smollm2_gguf
  return smollm2_gguf()


def _usage_error(capsys, main, argv) -> str:
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  return capsys.readouterr().err


@pytest.mark.slow
def test_smoke_training_writes_routers_and_resumes_to_the_same_history(gguf, tmp_path, capsys):
  out = tmp_path / "run"
  args = ["--model", gguf, "--preset", "smoke", "--out", str(out)]
  moice_train.main(args)
  record = json.loads((out / "results.json").read_text())
  assert [h["step"] for h in record["history"]] == [1, 2]
  assert record["moice"]["bases"][0] == 100000.0 and record["moice"]["top_k"] == 7
  mcfg, meta = moice.load_moice_config(out)
  assert (meta["num_layers"], meta["head_dim"], mcfg.num_experts) == (2, 16, 7)
  for name in ("results.md", "loss.png", "history.json"):
    assert (out / name).is_file()
  # Lose the last checkpoint: --resume trains step 2 again, to the same loss.
  shutil.rmtree(out / "checkpoints" / "2")
  moice_train.main(args + ["--resume"])
  assert "resumed at step 1" in capsys.readouterr().out
  again = json.loads((out / "results.json").read_text())
  assert again["history"] == record["history"]
  # Without --resume the folder is refused.
  err = _usage_error(capsys, moice_train.main, args)
  assert "already holds checkpoints" in err


@pytest.mark.parametrize("flags, message", [
    (["--micro-batch", "3"], "batch_size (128) must be a multiple of micro_batch (3)"),
    (["--steps", "0"], "--steps: expected a positive integer, got '0'"),
    (["--learning-rate", "-1"], "--learning-rate: expected a positive finite number"),
    (["--task", "mdqa", "--mdqa-file", __file__], "--task: MoICE trains on KV retrieval"),
    (["--preset", "big"], "--preset: invalid choice: 'big'"),
])
def test_moice_train_flags(model, capsys, tmp_path, flags, message):
  err = _usage_error(capsys, moice_train.main, model + ["--out", str(tmp_path / "o")] + flags)
  assert message in err
  assert not (tmp_path / "o").exists()


def test_moice_eval_needs_a_routers_folder(model, capsys, tmp_path):
  out = ["--out", str(tmp_path / "o")]
  err = _usage_error(capsys, lpes_eval.main, model + ["--method", "moice"] + out)
  assert "--method moice needs --moice-routers" in err
  err = _usage_error(capsys, lpes_eval.main, model + ["--method", "moice", "--moice-routers",
                                                      str(tmp_path / "none")] + out)
  assert "--moice-routers" in err and "is not a folder" in err
  err = _usage_error(capsys, lpes_eval.main, model + ["--method", "moice", "--moice-routers",
                                                      str(tmp_path)] + out)
  assert "--moice-routers" in err and "holds no trained routers" in err


def test_moice_eval_refuses_routers_of_another_model(capsys, tmp_path, monkeypatch):
  import jax
  from tests.lpes_jax.conftest import FIXTURES
  three_layers = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3,
                             num_heads=4, num_kv_heads=2, head_dim=16)
  mcfg = moice.paper_config(500.0)
  moice.save_routers(tmp_path / "r", moice.init_routers(jax.random.key(0), three_layers, mcfg),
                     mcfg, three_layers)
  monkeypatch.setattr(lpes_eval, "load_tokenizer", lambda path: None)
  err = _usage_error(capsys, lpes_eval.main, [
      "--model", f"{FIXTURES}/llama_gqa_tied_linear", "--method", "moice", "--moice-routers",
      str(tmp_path / "r"), "--num-pairs", "2", "--out", str(tmp_path / "o")])
  assert "--moice-routers" in err and "2 layers" in err


def test_sweep_chooses_the_lr_per_budget_then_the_budget_by_heldout_loss():
  from experiments import moice_sweep
  history = lambda losses: [{"step": s, "heldout_loss": l} for s, l in losses.items()]
  runs = [{"learning_rate": 1e-4, "history": history({7: 3.0, 50: 2.9, 200: 2.8})},
          {"learning_rate": 1e-3, "history": history({7: 2.95, 50: 2.7, 200: 2.85})}]
  record = moice_sweep.choose(runs, (7, 50, 200))
  assert {b: g["learning_rate"] for b, g in record["per_budget"].items()} == {
      7: 1e-3, 50: 1e-3, 200: 1e-4}
  assert (record["best"]["budget"], record["best"]["learning_rate"]) == (50, 1e-3)
  assert len(record["grid"]) == 6


@pytest.mark.slow
def test_sweep_smoke_writes_the_grid_and_the_best_routers(gguf, tmp_path, capsys):
  from experiments import moice_sweep
  out = tmp_path / "sweep"
  argv = ["--model", gguf, "--preset", "smoke", "--out", str(out), "--resume"]
  moice_sweep.main(argv + ["--learning-rates", "0.01"])      # One learning rate per command,
  first = (out / "lr_0.01" / "history.json").read_text()
  record = moice_sweep.main(argv)                             # then all: the first is reused.
  assert (out / "lr_0.01" / "history.json").read_text() == first
  assert "resumed at step 3" in capsys.readouterr().out
  assert {(g["learning_rate"], g["budget"]) for g in record["grid"]} == {
      (1e-2, 1), (1e-2, 3), (3e-2, 1), (3e-2, 3)}
  for g in record["grid"]:
    assert 0 < g["heldout_router_entropy"] <= 1.9460 and g["heldout_loss"] > 0
  moice.load_moice_config(out / "best")
  for name in ("results.md", "results.json", "loss.png", "heldout.png"):
    assert (out / name).is_file()


@pytest.mark.parametrize("flags, message", [
    (["--heldout-seed", "1000"], "--heldout-seed must differ from --seed"),
    (["--budgets", "7,0"], "--budgets: expected comma-separated positive integers"),
    (["--learning-rates", "1e-3,-1"], "--learning-rates: expected comma-separated positive numbers"),
    (["--task", "mdqa", "--mdqa-file", __file__], "--task: MoICE trains on KV retrieval"),
])
def test_moice_sweep_flags(model, capsys, tmp_path, flags, message):
  from experiments import moice_sweep
  err = _usage_error(capsys, moice_sweep.main, model + ["--out", str(tmp_path / "o")] + flags)
  assert message in err
  assert not (tmp_path / "o").exists()
