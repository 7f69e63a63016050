"""One writer per run folder: a second run on the same --out refuses at start and names the
holder; a lock left by a killed run is taken over with a warning."""

import json
import os
import socket
import subprocess
import sys

import pytest

from experiments import indirect_indexing, lpes_search
from lpes_jax import bezier, genomes, search
from pope_jax import config, train
from pope_jax.run_lock import RunLockedError, run_lock

HOLD = ("import sys, time\nfrom pope_jax.run_lock import run_lock\n"
        "with run_lock(sys.argv[1]):\n  print('held', flush=True)\n  time.sleep(120)\n")


@pytest.fixture
def holder(tmp_path):
  """Another process that holds a folder's lock: holder(folder) → its pid."""
  procs = []

  def hold(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                            text=True)
    procs.append(proc)
    assert proc.stdout.readline().strip() == "held"
    return proc.pid
  yield hold
  for proc in procs:
    proc.kill()
    proc.wait()


def _stale_lock(folder):
  """A lock as a killed run leaves it: its pid is gone."""
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, ".lock"), "w") as f:
    json.dump({"pid": int(dead), "host": socket.gethostname(),
               "started": "2026-01-01T00:00:00+00:00"}, f)
  return int(dead)


def test_second_search_on_one_out_refuses_before_the_model_loads(holder, tmp_path, capsys,
                                                                  monkeypatch):
  model = tmp_path / "model.gguf"
  model.write_bytes(b"")
  monkeypatch.setattr(lpes_search, "load_checkpoint", lambda *a, **k: pytest.fail("loaded"))
  pid = holder(tmp_path / "out")
  with pytest.raises(SystemExit) as e:
    lpes_search.main(["--model", str(model), "--out", str(tmp_path / "out")])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--out: run folder" in err and f"pid {pid} on host {socket.gethostname()}" in err


def test_second_indirect_indexing_run_refuses_and_names_the_holder(holder, tmp_path, capsys,
                                                                    monkeypatch):
  monkeypatch.setattr(indirect_indexing.ii, "run_encoding", lambda *a, **k: pytest.fail("ran"))
  pid = holder(tmp_path / "pope")          # The other run trains PoPE: RoPE alone may run.
  with pytest.raises(SystemExit) as e:
    indirect_indexing.main(["--preset", "smoke", "--seeds", "1", "--out", str(tmp_path)])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"is in use by another run (pid {pid} on host" in err
  assert not (tmp_path / "rope" / ".lock").exists()       # Locks taken so far are released.


def test_search_refuses_a_locked_folder_and_takes_over_a_stale_lock(tmp_path):
  toy = lambda m: [[1.0, 0.5, 0.0]] * len(m)
  bez = genomes.BezierSpace(bezier.BezierConfig(num_layers=8))
  cfg = search.SearchConfig(num_generations=2, population_size=8, num_parents=4,
                            num_mutations=2, num_crossovers=2)
  with run_lock(tmp_path):
    with pytest.raises(RunLockedError, match="in use by another run"):
      search.run_search(toy, bez, cfg, str(tmp_path), progress=False)
  search.run_search(toy, bez, cfg, str(tmp_path), progress=False, stop_after=0)
  dead = _stale_lock(tmp_path)
  with pytest.warns(UserWarning, match=f"taking over the lock .*pid {dead}"):
    result = search.run_search(toy, bez, cfg, str(tmp_path), progress=False, resume=True)
  assert len(result.history) == 2 and not (tmp_path / ".lock").exists()


def test_train_and_evaluate_refuses_a_locked_workdir(tmp_path):
  with run_lock(tmp_path):
    with pytest.raises(RunLockedError, match="in use by another run"):
      train.train_and_evaluate(config.ModelConfig(vocab_size=8, num_layers=1, d_model=8,
                                                  num_heads=1),
                               config.TrainConfig(steps=2, batch_size=1, learning_rate=1e-3,
                                                  min_learning_rate=1e-4, warmup_steps=1),
                               train_source=None,
                               eval_sources={}, workdir=tmp_path)


@pytest.mark.slow
def test_resume_after_a_killed_run_takes_over_its_lock(tmp_path, capsys):
  argv = ["--preset", "smoke", "--encodings", "rope", "--out", str(tmp_path), "--no-progress"]
  dead = _stale_lock(tmp_path / "rope")
  with pytest.warns(UserWarning, match=f"taking over the lock of a run .*pid {dead}"):
    summary = indirect_indexing.main(argv + ["--resume"])
  assert set(summary) == {"rope"} and not (tmp_path / "rope" / ".lock").exists()
