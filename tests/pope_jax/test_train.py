"""Training loop: loss goes down, resume is exact, checkpoints are guarded, seeds vmap exactly."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pope_jax import ModelConfig, TrainConfig
from pope_jax.data import indirect_indexing as task
from pope_jax import config
from pope_jax import model as model_lib
from pope_jax import train as train_lib
from pope_jax.train import train_and_evaluate

TASK = task.IndirectIndexingConfig(min_length=6, max_length=10, max_shift=3, split_sizes=(
    ("train", 4000), ("validation", 64), ("test", 32)))
# Flax's default initialisers: with GPT-2's std 0.02 a model this narrow starts at uniform logits
# and needs far more than these few steps to move (the training loop is what is under test).
MODEL = ModelConfig(vocab_size=len(task.VOCAB), num_layers=1, d_model=32, num_heads=2,
                    dropout_rate=0.1, init_std=None)
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


SHORT = dataclasses.replace(TRAIN, steps=8, eval_every=4, checkpoint_every=4, log_every=4)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished SHORT run (checkpoints 4 and 8) and its result; tests work on copies."""
  workdir = tmp_path_factory.mktemp("finished") / "run"
  (result,) = _run(workdir, train=SHORT)
  return workdir, result


def _copy(finished, tmp_path):
  return Path(shutil.copytree(finished[0], tmp_path / "run"))


def test_training_lowers_the_loss_and_logs(tmp_path):
  (r,) = _run(tmp_path, train=dataclasses.replace(TRAIN, steps=60, eval_every=60,
                                                  checkpoint_every=60))
  losses = [h["train_loss"] for h in r.history if "train_loss" in h]
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert lines[-1]["step"] == 60 and "validation_accuracy" in lines[-1]
  assert set(r.metrics) == {"validation"}


@pytest.mark.slow
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
  with pytest.warns(UserWarning, match="taking over the lock of a run that is no longer alive"):
    (resumed,) = _run(tmp_path / "resumed", resume=True)   # The killed run's lock is stale.
  for a, b in zip(_leaves(full.params), _leaves(resumed.params)):
    np.testing.assert_array_equal(a, b)
  assert [h["step"] for h in resumed.history] == [h["step"] for h in full.history]


class _WrongTargets:
  """The validation split scored against a wrong target, the pad token, where the answer letter
  belongs: its loss rises as the model learns, so the best checkpoint is an early one."""

  def __init__(self, source):
    self.source = source

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    r = dict(self.source[i])
    r["targets"] = np.zeros_like(r["targets"])
    return r


SELECT = dataclasses.replace(TRAIN, select_split="wrong", eval_every=4)


def _run_selecting(workdir, **kw):
  valid = task.IndirectIndexingSource(TASK, "validation")
  return train_and_evaluate(
      MODEL, SELECT, train_source=task.IndirectIndexingSource(TASK, "train"),
      eval_sources={"validation": valid, "wrong": _WrongTargets(valid)}, workdir=workdir,
      progress=False, **kw)


@pytest.mark.slow
def test_best_checkpoint_is_the_lowest_periodic_loss_and_restores(tmp_path):
  results = _run_selecting(tmp_path, seeds=(0, 1))
  for m, r in enumerate(results):
    evals = [(h["wrong_loss"], h["step"]) for h in r.history if "wrong_loss" in h]
    assert r.best_step == min(evals)[1] < SELECT.steps      # The earliest of equal losses.
    assert r.best_metrics["wrong"]["loss"] < r.metrics["wrong"]["loss"]
    for a, b in zip(_leaves(r.best_params), _leaves(train_lib.restore_params(tmp_path, m,
                                                                              best=True))):
      np.testing.assert_array_equal(a, b)
    assert not np.array_equal(_leaves(r.best_params)[0], _leaves(r.params)[0])


@pytest.mark.slow
def test_best_checkpoint_survives_kill_and_resume(tmp_path):
  (full,) = _run_selecting(tmp_path / "full")
  assert full.best_step <= 12       # Kept in the step-12 checkpoint that the resume reads.
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
t._run_selecting({str(tmp_path / 'resumed')!r})
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert proc.returncode == 3, proc.stderr[-2000:]
  with pytest.warns(UserWarning, match="taking over the lock"):
    (resumed,) = _run_selecting(tmp_path / "resumed", resume=True)
  assert resumed.best_step == full.best_step and resumed.best_metrics == full.best_metrics
  for a, b in zip(_leaves((full.params, full.best_params)),
                  _leaves((resumed.params, resumed.best_params))):
    np.testing.assert_array_equal(a, b)


def test_select_split_must_be_evaluated_and_best_needs_selection(finished, tmp_path):
  with pytest.raises(ValueError, match=r"select_split='valid' is not one of .*'validation'"):
    _run(tmp_path, train=dataclasses.replace(SHORT, select_split="valid"))
  with pytest.raises(ValueError, match="kept no best-validation parameters"):
    train_lib.restore_params(finished[0], best=True)
  assert finished[1].best_step is None and finished[1].best_params is None


@pytest.mark.slow
def test_seeds_trained_together_equal_seeds_trained_alone(tmp_path):
  together = _run(tmp_path / "together", seeds=(0, 5))
  (alone,) = _run(tmp_path / "alone", train=dataclasses.replace(TRAIN, seed=5))
  for a, b in zip(_leaves(together[1].params), _leaves(alone.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert together[1].metrics["validation"]["loss"] == pytest.approx(
      alone.metrics["validation"]["loss"], rel=1e-4)
  assert together[0].seed == 0 and together[1].seed == 5


@pytest.mark.slow
def test_seeds_trained_in_turn_share_one_compile(tmp_path, monkeypatch):
  """A second seed of the same config reuses the jitted step (no new trace or compile) and trains
  exactly as a freshly compiled one."""
  train_lib._step_functions.cache_clear()
  calls = []
  make = train_lib.make_train_step
  monkeypatch.setattr(train_lib, "make_train_step", lambda *a: calls.append(a) or make(*a))
  (first,) = _run(tmp_path / "first", train=SHORT)
  (second,) = _run(tmp_path / "second", train=dataclasses.replace(SHORT, seed=3))
  assert len(calls) == 1
  train_lib._step_functions.cache_clear()
  (fresh,) = _run(tmp_path / "fresh", train=dataclasses.replace(SHORT, seed=3))
  assert len(calls) == 2
  for a, b in zip(_leaves(second.params), _leaves(fresh.params)):
    np.testing.assert_array_equal(a, b)
  assert second.metrics == fresh.metrics
  assert not np.array_equal(_leaves(first.params)[0], _leaves(second.params)[0])


def test_resume_without_checkpoint_names_the_folder(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    _run(tmp_path, resume=True)


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path):
  _run(tmp_path, train=dataclasses.replace(TRAIN, steps=4, eval_every=4, checkpoint_every=4,
                                           log_every=4))
  with pytest.raises(FileExistsError, match="checkpoints"):
    _run(tmp_path)


def test_resume_with_other_config_names_the_field(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  with pytest.raises(ValueError, match=r"differs in model\.d_model$"):
    _run(workdir, train=SHORT, model=dataclasses.replace(MODEL, d_model=64), resume=True)
  with pytest.raises(ValueError, match=r"differs in train\.batch_size, train\.learning_rate$"):
    _run(workdir, train=dataclasses.replace(SHORT, batch_size=8, learning_rate=1e-3), resume=True)
  # The number of data workers does not change results: a resume may change it.
  info = json.loads((workdir / "run.json").read_text())
  info["train"]["data_workers"] = 3
  train_lib.checkpoint_manager(workdir, info, resume=True).close()


def _garbage(folder):
  for f in folder.rglob("*"):
    if f.is_file():
      f.write_bytes(b"garbage")


@pytest.mark.parametrize("damage", ["empty", "item_deleted", "data_corrupt"])
def test_unreadable_latest_checkpoint_falls_back_to_the_older_step(finished, tmp_path, damage):
  workdir = _copy(finished, tmp_path)
  ckpt = workdir / "checkpoints"
  # A newer step 12 that cannot be read, next to the finished run's step 8.
  if damage == "empty":
    (ckpt / "12").mkdir()
  else:
    shutil.copytree(ckpt / "8", ckpt / "12")
    if damage == "item_deleted":
      shutil.rmtree(ckpt / "12" / "default")
    else:
      _garbage(ckpt / "12" / "default" / "ocdbt.process_0" / "d")
  with pytest.warns(UserWarning) as record:
    (r,) = _run(workdir, train=SHORT, resume=True)
  message, renamed = [str(w.message) for w in record]
  assert message.startswith(f"cannot read checkpoint {ckpt / '12'} (")
  assert "\n" not in message and len(message) < 400, message
  assert renamed.startswith("resuming from step 8; unreadable steps [12] were renamed")
  assert sorted(p.name for p in ckpt.iterdir()) == ["12.unreadable-0", "4", "8"]
  for a, b in zip(_leaves(finished[1].params), _leaves(r.params)):
    np.testing.assert_array_equal(a, b)


def test_fallback_resume_retrains_and_saves_the_unreadable_step_anew(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  ckpt = workdir / "checkpoints"
  shutil.rmtree(ckpt / "8" / "default")
  with pytest.warns(UserWarning) as record:
    (r,) = _run(workdir, train=SHORT, resume=True)
  assert "resuming from step 4" in str(record[-1].message)
  assert sorted(p.name for p in ckpt.iterdir()) == ["4", "8", "8.unreadable-0"]
  assert [h["step"] for h in r.history] == [h["step"] for h in finished[1].history]
  for a, b in zip(_leaves(finished[1].params), _leaves(r.params)):
    np.testing.assert_array_equal(a, b)


def test_no_readable_checkpoint_names_the_folder_and_steps(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  _garbage(workdir / "checkpoints")
  with pytest.warns(UserWarning), pytest.raises(ValueError) as e:
    _run(workdir, train=SHORT, resume=True)
  assert "cannot restore checkpoint from " + str(workdir / "checkpoints") in str(e.value)
  assert "none of the steps [8, 4] can be read" in str(e.value) and len(str(e.value)) < 500


def test_leftover_orbax_tmp_folder_is_removed_on_resume_and_never_loaded(finished, tmp_path,
                                                                       monkeypatch):
  workdir = _copy(finished, tmp_path)
  ckpt = workdir / "checkpoints"
  (ckpt / "8").rename(ckpt / "8.orbax-checkpoint-tmp-1234")  # The save of step 8 was cut short.
  restored = []
  orig = train_lib.ocp.CheckpointManager.restore
  def restore(self, step, *a, **k):
    restored.append(step)
    return orig(self, step, *a, **k)
  monkeypatch.setattr(train_lib.ocp.CheckpointManager, "restore", restore)
  (r,) = _run(workdir, train=SHORT, resume=True)
  assert restored == [4]
  assert sorted(p.name for p in ckpt.iterdir()) == ["4", "8"]
  for a, b in zip(_leaves(finished[1].params), _leaves(r.params)):
    np.testing.assert_array_equal(a, b)


def test_metrics_log_with_a_cut_short_last_line_or_corruption(tmp_path):
  path = tmp_path / "metrics.jsonl"
  good = [json.dumps({"step": s, "seed": 0}) for s in (4, 8, 12)]
  path.write_text("\n".join(good) + '\n{"step": 16, "se')
  with pytest.warns(UserWarning, match="last line"):
    assert [r["step"] for r in train_lib._read_history(path, up_to=8)] == [4, 8]
  path.write_text("\n".join([good[0], "{oops", good[1]]) + "\n")
  with pytest.raises(ValueError, match=f"{path}: line 2 is not valid JSON"):
    train_lib._read_history(path, up_to=8)


def test_corrupt_run_json_is_named(finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  (workdir / "run.json").write_text('{"model": ')
  with pytest.raises(ValueError, match=f"{workdir / 'run.json'} is not valid JSON"):
    _run(workdir, train=SHORT, resume=True)


@pytest.mark.parametrize("resume", [False, True])
def test_checkpoints_path_that_is_a_file_is_refused_at_start(tmp_path, resume):
  (tmp_path / "checkpoints").write_text("not a folder")
  with pytest.raises(NotADirectoryError, match=str(tmp_path / "checkpoints")):
    _run(tmp_path, train=SHORT, resume=resume)


def test_resume_after_training_finished_keeps_the_measured_speed(finished, tmp_path):
  assert math.isfinite(finished[1].steps_per_second) and finished[1].steps_per_second > 0
  workdir = _copy(finished, tmp_path)
  (r,) = _run(workdir, train=SHORT, resume=True)
  assert r.steps_per_second == finished[1].steps_per_second
  assert r.metrics == finished[1].metrics
  # A log without the speed (an older run): unknown, NaN (written as null by experiments).
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  (workdir / "metrics.jsonl").write_text("".join(
      json.dumps({k: v for k, v in l.items() if k != "steps_per_second"}) + "\n" for l in lines))
  (r,) = _run(workdir, train=SHORT, resume=True)
  assert math.isnan(r.steps_per_second)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_init_params_starts_every_seed_from_given_parameters(tmp_path):
  from pope_jax.model import Transformer
  given = Transformer(MODEL).init(jax.random.key(99), np.zeros((1, 8), np.int32))["params"]
  zero_lr = dataclasses.replace(TRAIN, steps=4, eval_every=4, checkpoint_every=4,
                                learning_rate=1e-12, min_learning_rate=1e-12, weight_decay=0.0)
  results = _run(tmp_path, train=zero_lr, seeds=(5, 6), init_params=given)
  for r in results:            # A vanishing learning rate leaves the given parameters in place.
    for a, b in zip(_leaves(r.params), _leaves(given)):
      np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.slow
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


def test_metrics_log_is_rewritten_atomically_then_appended(tmp_path):
  log = tmp_path / "metrics.jsonl"
  log.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
  with train_lib._open_metrics_log(log, [{"step": 1}, {"step": 2}]) as f:
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2]
    f.write(json.dumps({"step": 3}) + "\n")
  assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_matches_optax_in_value_and_gradient(dtype):
  keys = jax.random.split(jax.random.key(0), 3)
  logits = (4 * jax.random.normal(keys[0], (3, 5, 37))).astype(dtype)
  labels = jax.random.randint(keys[1], (3, 5), 0, 37)
  weights = jax.random.uniform(keys[2], (3, 5))

  def ours(x):
    return (train_lib.cross_entropy_with_integer_labels(x, labels) * weights).sum()

  def reference(x):
    nll = optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels)
    return (nll * weights).sum()

  assert train_lib.cross_entropy_with_integer_labels(logits, labels).dtype == jnp.float32
  np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
  g, g_ref = jax.grad(ours)(logits), jax.grad(reference)(logits)
  assert g.dtype == dtype
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32), atol=tol)


@pytest.mark.slow
def test_compute_dtype_logits_train_like_float32_logits():
  cfg = config.ModelConfig(vocab_size=11, num_layers=1, d_model=16, num_heads=2, dtype="bfloat16")
  tokens = jax.random.randint(jax.random.key(0), (2, 6), 0, 11)
  batch = {"targets": tokens, "weights": jnp.ones(tokens.shape)}
  params = model_lib.Transformer(cfg).init(jax.random.key(1), tokens)["params"]

  def loss(p, logits_dtype):
    m = model_lib.Transformer(dataclasses.replace(cfg, logits_dtype=logits_dtype))
    logits = m.apply({"params": p}, tokens)
    assert logits.dtype == (jnp.float32 if logits_dtype == "float32" else jnp.bfloat16)
    return train_lib.weighted_metrics(logits, batch)["nll_sum"]

  (l32, g32), (l16, g16) = (jax.value_and_grad(loss)(params, d) for d in ("float32", "compute"))
  np.testing.assert_allclose(l16, l32, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3)


def test_bad_logits_dtype_is_named():
  with pytest.raises(ValueError, match="logits_dtype"):
    config.ModelConfig(vocab_size=11, num_layers=1, d_model=16, num_heads=2, logits_dtype="bf16")


def test_cross_entropy_gradient_with_narrow_label_dtype():
  logits = jnp.zeros((1, 300))
  labels = jnp.array([5], jnp.uint8)
  g = jax.grad(lambda x: train_lib.cross_entropy_with_integer_labels(x, labels).sum())(logits)
  np.testing.assert_array_equal(np.nonzero(np.asarray(g[0]) < -0.5)[0], [5])
