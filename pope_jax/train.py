"""Training loop for any experiment: optax AdamW, grain input, orbax checkpoints, data parallel.

`train_and_evaluate(model_config, train_config, train_source=..., eval_sources=..., workdir=...)`
trains a `pope_jax.Transformer` on records {"inputs": int32[T], "targets": int32[T],
"weights": float32[T]} from a grain random-access source. The loss is the weighted mean next-token
cross-entropy (weights select e.g. the final target token of indirect indexing, or every token of
language modelling); evaluation reports "loss" (mean NLL per weighted token) and "accuracy"
(weighted argmax accuracy) per split.

Data order is a pure function of (seed, step): batch `i` is element `i` of a shuffled, repeated,
batched grain `MapDataset`, so `resume=True` continues from the latest orbax checkpoint with the same
data and dropout randomness as an uninterrupted run. Parameters are replicated and batches sharded
over a 1-D `jax.sharding.Mesh` of all devices (axis "data"): data parallel, and one CPU device works.

Shape letters: B global batch, C steps per jitted call, T sequence length, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Mapping

import flax
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from pope_jax.config import ModelConfig, TrainConfig
from pope_jax.model import Transformer

Array = jax.Array
Batch = Mapping[str, Array]


@flax.struct.dataclass
class TrainState:
  step: Array          # [] int32, optimiser steps taken
  params: Any
  opt_state: Any


@dataclasses.dataclass
class TrainResult:
  """What `train_and_evaluate` returns: final params, final metrics per split, and the history."""
  params: Any
  metrics: dict[str, dict[str, float]]
  history: list[dict[str, float]]
  steps_per_second: float


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """Linear warm-up to `learning_rate`, then cosine decay to `min_learning_rate` at `steps`."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.min_learning_rate)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping followed by AdamW with the warm-up + cosine schedule."""
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                  weight_decay=cfg.weight_decay))


def weighted_metrics(logits: Array, batch: Batch) -> dict[str, Array]:
  """Sums of weighted NLL, correct predictions and weights over a batch.

  Args:
    logits: [B, T, V] float32.
    batch: "targets" int32 [B, T] and "weights" float32 [B, T].
  """
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  w = batch["weights"]
  correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
  return {"nll_sum": jnp.sum(nll * w), "correct_sum": jnp.sum(correct * w),
          "weight_sum": jnp.sum(w)}


def init_state(model: Transformer, cfg: TrainConfig, seq_len: int, params=None) -> TrainState:
  """Fresh optimiser state around `params` (default: a new init from `cfg.seed`)."""
  if params is None:
    params = model.init(jax.random.key(cfg.seed), jnp.zeros((1, seq_len), jnp.int32))["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=make_optimizer(cfg).init(params))


def make_train_step(model: Transformer, cfg: TrainConfig):
  """Returns `train_step(state, batches) -> (state, metrics)` running C = steps_per_call steps.

  batches: "inputs", "targets" int32 [C, B, T], "weights" float32 [C, B, T].
  """
  optimizer = make_optimizer(cfg)
  dropout_key = jax.random.key(cfg.seed + 1)

  def loss_fn(params, batch, step):
    logits = model.apply({"params": params}, batch["inputs"], deterministic=False,
                         rngs={"dropout": jax.random.fold_in(dropout_key, step)})
    m = weighted_metrics(logits, batch)
    return m["nll_sum"] / jnp.maximum(m["weight_sum"], 1.0), m

  def one_step(state: TrainState, batch):
    grads, m = jax.grad(loss_fn, has_aux=True)(state.params, batch, state.step)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    m["grad_norm"] = optax.global_norm(grads)
    return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state), m

  def train_step(state, batches):
    state, ms = jax.lax.scan(one_step, state, batches)
    return state, ms                                   # metrics stacked over C

  return train_step


def make_eval_step(model: Transformer):
  def eval_step(params, batch):
    return weighted_metrics(model.apply({"params": params}, batch["inputs"]), batch)
  return eval_step


def _train_batches(source, cfg: TrainConfig, start_call: int):
  """Iterator over stacked batches [C, B, T] from call index `start_call` on (grain)."""
  ds = (grain.MapDataset.source(source).shuffle(seed=cfg.seed).repeat(None)
        .batch(cfg.batch_size, drop_remainder=True).batch(cfg.steps_per_call, drop_remainder=True))
  ds = ds.slice(slice(start_call, None)).to_iter_dataset(
      grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
  if cfg.data_workers:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.data_workers))
  return iter(ds)


def _eval_batches(source, batch_size: int, max_batches: int | None):
  """Yields full [B, T] batches of a split; the last one padded with zero-weight records."""
  ds = grain.MapDataset.source(source).batch(batch_size, drop_remainder=False)
  n = len(ds) if max_batches is None else min(len(ds), max_batches)
  for i in range(n):
    batch = ds[i]
    pad = batch_size - batch["inputs"].shape[0]
    if pad:
      batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
               for k, v in batch.items()}
    yield batch


def evaluate(eval_step, params, sources: Mapping[str, Any], batch_size: int,
             max_batches: int | None, shard) -> dict[str, dict[str, float]]:
  """Mean NLL per weighted token and weighted accuracy for each named source."""
  out = {}
  for name, source in sources.items():
    total = {"nll_sum": 0.0, "correct_sum": 0.0, "weight_sum": 0.0}
    for batch in _eval_batches(source, batch_size, max_batches):
      m = jax.device_get(eval_step(params, shard(batch)))
      total = {k: total[k] + float(m[k]) for k in total}
    w = max(total["weight_sum"], 1.0)
    out[name] = {"loss": total["nll_sum"] / w, "accuracy": total["correct_sum"] / w}
  return out


def checkpoint_manager(workdir: Path, cfg: TrainConfig, *, resume: bool) -> ocp.CheckpointManager:
  """Orbax manager under `workdir/checkpoints`, refusing to mix a fresh run with an old one.

  Raises:
    FileExistsError: resume=False but checkpoints exist (pass resume or pick another workdir).
    FileNotFoundError: resume=True but the checkpoint folder is missing or empty.
  """
  path = (workdir / "checkpoints").absolute()
  exists = path.is_dir() and any(p.name.isdigit() for p in path.iterdir())
  if resume and not exists:
    raise FileNotFoundError(f"--resume: no checkpoint found in {path}")
  if not resume and exists:
    raise FileExistsError(f"{path} already holds checkpoints: resume the run or use another "
                          f"output folder")
  return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
      max_to_keep=2, create=True, enable_async_checkpointing=False))


def restore_state(manager: ocp.CheckpointManager, abstract: TrainState) -> TrainState:
  """Restores the latest checkpoint into `abstract`'s structure and shardings.

  Raises:
    ValueError: the checkpoint cannot be read (corrupt, or from another model/optimiser).
  """
  step = manager.latest_step()
  try:
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # Orbax raises many types; name the folder and keep the cause.
    raise ValueError(f"cannot restore checkpoint step {step} from {manager.directory}: {e}") from e


def train_and_evaluate(
    model_config: ModelConfig,
    train_config: TrainConfig,
    *,
    train_source,
    eval_sources: Mapping[str, Any],
    workdir: str | Path,
    resume: bool = False,
    progress: bool = True,
    init_params: Any = None,
) -> TrainResult:
  """Trains a Transformer and evaluates it periodically and at the end.

  Args:
    model_config, train_config: see `pope_jax.config`.
    train_source: grain random-access source of records (module docstring).
    eval_sources: split name → source, evaluated every `eval_every` steps and at the end.
    workdir: folder for `checkpoints/` (orbax) and `metrics.jsonl`.
    resume: continue from the latest checkpoint in workdir (same data order).
    progress: show a tqdm bar.
    init_params: start from these parameters (fine-tuning) instead of a fresh init; ignored
      when resuming from a checkpoint.

  Returns:
    TrainResult with final params (host), final metrics per split and the logged history.

  Raises:
    ValueError: batch size not divisible by the device count, or an unreadable checkpoint.
    FileExistsError / FileNotFoundError: see `checkpoint_manager`.
  """
  cfg = train_config
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  devices = jax.devices()
  if cfg.batch_size % len(devices):
    raise ValueError(f"TrainConfig.batch_size={cfg.batch_size} is not divisible by the "
                     f"{len(devices)} devices")
  mesh = Mesh(np.array(devices), ("data",))
  replicated = NamedSharding(mesh, P())
  seq_len = train_source[0]["inputs"].shape[0]
  model = Transformer(model_config)

  state = jax.jit(lambda p: init_state(model, cfg, seq_len, p), out_shardings=replicated)(
      init_params)
  manager = checkpoint_manager(workdir, cfg, resume=resume)
  if resume:
    state = restore_state(manager, state)
  start = int(state.step)
  if start % cfg.steps_per_call:
    raise ValueError(f"checkpoint step {start} is not a multiple of steps_per_call="
                     f"{cfg.steps_per_call}")

  def shard(batch, spec=P("data")):
    return jax.device_put(batch, NamedSharding(mesh, spec))

  train_step = jax.jit(make_train_step(model, cfg), donate_argnums=0, out_shardings=(replicated, replicated))
  eval_step = jax.jit(make_eval_step(model))
  batches = _train_batches(train_source, cfg, start // cfg.steps_per_call)
  history: list[dict[str, float]] = []
  metrics_file = (workdir / "metrics.jsonl").open("a")
  bar = tqdm(total=cfg.steps, initial=start, disable=not progress, desc=str(workdir.name),
             dynamic_ncols=True)
  t0, step = time.perf_counter(), start
  while step < cfg.steps:
    state, m = train_step(state, shard(next(batches), P(None, "data")))
    step += cfg.steps_per_call
    bar.update(cfg.steps_per_call)
    record = None
    if step % cfg.log_every == 0 or step == cfg.steps:
      m = jax.device_get(m)
      record = {"step": step, "train_loss": float(m["nll_sum"][-1] / max(m["weight_sum"][-1], 1)),
                "grad_norm": float(m["grad_norm"][-1]),
                "lr": float(learning_rate_schedule(cfg)(step - 1))}
      bar.set_postfix(loss=f"{record['train_loss']:.3f}")
    if step % cfg.eval_every == 0 or step == cfg.steps:
      record = record or {"step": step}
      for split, em in evaluate(eval_step, state.params, eval_sources, cfg.batch_size,
                                cfg.eval_batches, shard).items():
        record.update({f"{split}_{k}": v for k, v in em.items()})
    if record:
      history.append(record)
      metrics_file.write(json.dumps(record) + "\n")
      metrics_file.flush()
    if step % cfg.checkpoint_every == 0 or step == cfg.steps:
      manager.save(step, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  bar.close()
  metrics_file.close()
  elapsed = time.perf_counter() - t0
  final = evaluate(eval_step, state.params, eval_sources, cfg.batch_size, None, shard)
  return TrainResult(params=jax.device_get(state.params), metrics=final, history=history,
                     steps_per_second=(cfg.steps - start) / elapsed if elapsed > 0 else math.nan)
