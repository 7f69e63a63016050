"""Training loop: loss goes down, resume is exact, checkpoints are guarded, seeds vmap exactly."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from pope_jax import ModelConfig, TrainConfig
from pope_jax.data import indirect_indexing as task
from pope_jax.train import train_and_evaluate

TASK = task.IndirectIndexingConfig(min_length=6, max_length=10, max_shift=3, split_sizes=(
    ("train", 4000), ("validation", 64), ("test", 32)))
MODEL = ModelConfig(vocab_size=len(task.VOCAB), num_layers=1, d_model=32, num_heads=2,
                    dropout_rate=0.1)
TRAIN = TrainConfig(steps=24, batch_size=16, learning_rate=3e-3, min_learning_rate=3e-4,
                    warmup_steps=4, eval_every=12, eval_batches=2, checkpoint_every=12,
                    log_every=4, steps_per_call=4)


def _run(workdir, train=TRAIN, model=MODEL, **kw):
  return train_and_evaluate(
      model, train, train_source=task.IndirectIndexingSource(TASK, "train"),
      eval_sources={"validation": task.IndirectIndexingSource(TASK, "validation")},
      workdir=workdir, progress=False, **kw)


def _leaves(params):
  return jax.tree.leaves(params)


def test_training_lowers_the_loss_and_logs(tmp_path):
  (r,) = _run(tmp_path, train=dataclasses.replace(TRAIN, steps=60, eval_every=60,
                                                  checkpoint_every=60))
  losses = [h["train_loss"] for h in r.history if "train_loss" in h]
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert lines[-1]["step"] == 60 and "validation_accuracy" in lines[-1]
  assert set(r.metrics) == {"validation"}


def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
  (full,) = _run(tmp_path / "full")
  # An interrupted run: a process that stops after its first checkpoint (step 12).
  code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import tests.pope_jax.test_train as t
import pope_jax.train as tr
orig = tr.ocp.CheckpointManager.save
def save_then_die(self, step, *a, **k):
  orig(self, step, *a, **k)
  if step == 12:
    self.wait_until_finished(); import os; os._exit(3)
tr.ocp.CheckpointManager.save = save_then_die
t._run({str(tmp_path / 'resumed')!r})
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert proc.returncode == 3, proc.stderr[-2000:]
  (resumed,) = _run(tmp_path / "resumed", resume=True)
  for a, b in zip(_leaves(full.params), _leaves(resumed.params)):
    np.testing.assert_array_equal(a, b)
  assert [h["step"] for h in resumed.history] == [h["step"] for h in full.history]


def test_seeds_trained_together_equal_seeds_trained_alone(tmp_path):
  together = _run(tmp_path / "together", seeds=(0, 5))
  (alone,) = _run(tmp_path / "alone", train=dataclasses.replace(TRAIN, seed=5))
  for a, b in zip(_leaves(together[1].params), _leaves(alone.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert together[1].metrics["validation"]["loss"] == pytest.approx(
      alone.metrics["validation"]["loss"], rel=1e-4)
  assert together[0].seed == 0 and together[1].seed == 5


def test_resume_without_checkpoint_names_the_folder(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    _run(tmp_path, resume=True)


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path):
  _run(tmp_path, train=dataclasses.replace(TRAIN, steps=4, eval_every=4, checkpoint_every=4,
                                           log_every=4))
  with pytest.raises(FileExistsError, match="checkpoints"):
    _run(tmp_path)


def test_resume_with_other_config_or_corrupt_checkpoint_is_refused(tmp_path):
  short = dataclasses.replace(TRAIN, steps=8, eval_every=4, checkpoint_every=4, log_every=4)
  _run(tmp_path, train=short)
  with pytest.raises(ValueError, match="model"):
    _run(tmp_path, train=short, model=dataclasses.replace(MODEL, d_model=64), resume=True)
  for f in (tmp_path / "checkpoints" / "8").rglob("*"):
    if f.is_file():
      f.write_bytes(b"garbage")
  with pytest.raises(ValueError, match="cannot restore checkpoint"):
    _run(tmp_path, train=short, resume=True)


def test_batch_not_divisible_by_devices_is_named():
  code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import dataclasses, tests.pope_jax.test_train as t
import tempfile
try:
  t._run(tempfile.mkdtemp(), train=dataclasses.replace(t.TRAIN, batch_size=6))
except ValueError as e:
  print("ERR", e)
"""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
  assert "batch_size=6" in out.stdout, out.stderr[-2000:]


def test_data_parallel_over_four_devices_matches_one_device(tmp_path):
  code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import jax, numpy as np, tests.pope_jax.test_train as t
assert len(jax.devices()) == 4
(r,) = t._run({str(tmp_path / 'four')!r})
np.save({str(tmp_path / 'four.npy')!r}, np.concatenate([np.ravel(x) for x in jax.tree.leaves(r.params)]))
"""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (one,) = _run(tmp_path / "one")
  flat = np.concatenate([np.ravel(x) for x in _leaves(one.params)])
  np.testing.assert_allclose(np.load(tmp_path / "four.npy"), flat, rtol=2e-4, atol=2e-5)


def test_init_params_starts_every_seed_from_given_parameters(tmp_path):
  from pope_jax.model import Transformer
  given = Transformer(MODEL).init(jax.random.key(99), np.zeros((1, 8), np.int32))["params"]
  zero_lr = dataclasses.replace(TRAIN, steps=4, eval_every=4, checkpoint_every=4,
                                learning_rate=1e-12, min_learning_rate=1e-12, weight_decay=0.0)
  results = _run(tmp_path, train=zero_lr, seeds=(5, 6), init_params=given)
  for r in results:            # A vanishing learning rate leaves the given parameters in place.
    for a, b in zip(_leaves(r.params), _leaves(given)):
      np.testing.assert_allclose(a, b, atol=1e-6)


def test_fsdp_over_four_devices_matches_one_device(tmp_path):
  code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import dataclasses, jax, numpy as np, tests.pope_jax.test_train as t
from jax.sharding import Mesh
from pope_jax.model import Transformer
from pope_jax.train import init_state, state_shardings
model = dataclasses.replace(t.MODEL, d_model=64, mlp_dim=256)
train = dataclasses.replace(t.TRAIN, fsdp=True)
abstract = jax.eval_shape(lambda: init_state(Transformer(model), train, [0], 8))
specs = [s.spec for s in jax.tree.leaves(state_shardings(abstract, Mesh(np.array(jax.devices()), ("data",)), True))]
assert any("data" in tuple(s) for s in specs), specs
(r,) = t._run({str(tmp_path / 'fsdp')!r}, train=train, model=model)
np.save({str(tmp_path / 'fsdp.npy')!r}, np.concatenate([np.ravel(x) for x in jax.tree.leaves(r.params)]))
"""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (one,) = _run(tmp_path / "one", model=dataclasses.replace(MODEL, d_model=64, mlp_dim=256))
  flat = np.concatenate([np.ravel(x) for x in _leaves(one.params)])
  np.testing.assert_allclose(np.load(tmp_path / "fsdp.npy"), flat, rtol=2e-4, atol=2e-5)
