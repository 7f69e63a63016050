"""Training loop for any experiment: optax AdamW, grain input, orbax checkpoints, data parallel.

`train_and_evaluate(model_config, train_config, train_source=..., eval_sources=..., workdir=...)`
trains a `pope_jax.Transformer` on records {"inputs": int32[T], "targets": int32[T],
"weights": float32[T]} from a grain random-access source. Records of packed documents also carry
"segment_ids" and "positions" int32[T] (`pope_jax.data.packing`), passed to the model so that no
token attends across a document boundary. The loss is the weighted mean next-token
cross-entropy (weights select e.g. the final target token of indirect indexing, or every token of
language modelling); evaluation reports "loss" (mean NLL per weighted token) and "accuracy"
(weighted argmax accuracy) per split.

Data order is a pure function of (seed, step): batch `i` is element `i` of a shuffled, repeated,
batched grain `MapDataset`, so `resume=True` continues from the latest orbax checkpoint with the
same data and dropout randomness as an uninterrupted run. Batches are sharded over a 1-D
`jax.sharding.Mesh` of all devices (axis "data"): data parallel, and one CPU device works.
Parameters and optimiser state are replicated, or with `TrainConfig.fsdp` sharded over the same
axis (each large leaf split along its largest divisible dimension; XLA inserts the gathers).

Checkpoint selection (`TrainConfig.select_split`, e.g. "valid"): each periodic evaluation
compares every seed's loss on that split with its best so far and keeps the better parameters in
`TrainState.best`, part of the same orbax checkpoint as the latest state (one atomic save, so a
resumed run continues with the same best and ends bitwise identical). The results then give every
split's metrics at each seed's best step as well as at the last step.

Several seeds can train side by side in one program (`seeds=(0, 1, 2)`): the train state gets a
leading member axis M and the step is `jax.vmap`ped over it, so small models fill a GPU; member m
uses seed m for init, dropout and data order, exactly as if it had been trained alone.

Shape letters: M seeds trained together, B global batch, C steps per jitted call, T sequence
length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import flax
from absl import flags as absl_flags
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from pope_jax import atomic
from pope_jax.config import ModelConfig, TrainConfig, config_diff
from pope_jax.model import Transformer
from pope_jax.run_lock import run_lock

Array = jax.Array
Batch = Mapping[str, Array]


class ResumeError(ValueError):
  """A run folder that does not fit the request: its saved run has other settings, or its
  run.json cannot be read. The message names the folder and the differing fields."""


@flax.struct.dataclass
class TrainState:
  step: Array          # [] int32, optimiser steps taken
  params: Any          # leaves [M, ...]
  opt_state: Any       # leaves [M, ...]
  # With TrainConfig.select_split: {"params": leaves [M, ...], "step": [M] int32 (-1 before the
  # first evaluation), "loss": [M] float32 (the split's loss at that step)}; else None.
  best: Any = None


@dataclasses.dataclass
class TrainResult:
  """One seed's outcome: final params (host), final metrics per split, history, speed.

  `steps_per_second` is measured over the steps this call trained; a run resumed after training
  had finished reports the speed logged by the run that trained it (NaN if none was logged).
  With `TrainConfig.select_split`, `best_step`, `best_params` and `best_metrics` (every split,
  whole) describe the parameters of the lowest periodic loss on that split; else they are None.
  """
  seed: int
  params: Any
  metrics: dict[str, dict[str, float]]
  history: list[dict[str, float]]
  steps_per_second: float
  best_step: int | None = None
  best_params: Any = None
  best_metrics: dict[str, dict[str, float]] | None = None


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


@jax.custom_vjp
def cross_entropy_with_integer_labels(logits: Array, labels: Array) -> Array:
  """Softmax cross-entropy -log softmax(logits)[label], computed in float32.

  The same values as `optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32),
  labels)`, with a hand-written gradient, softmax - one_hot(label), returned in the logits'
  dtype: the backward then reads the saved logits once and writes their gradient once, and no
  float32 copy of the logits is kept. With bfloat16 logits (`ModelConfig.logits_dtype="compute"`)
  this is the largest memory-bound part of a GPT-2-sized step.

  Args:
    logits: [..., V] any float dtype.
    labels: [...] int, in [0, V); values and gradients for labels outside it are undefined
      (mask such positions with weights, and give them a valid label such as 0).

  Returns:
    [...] float32 negative log-likelihoods.
  """
  return _cross_entropy_fwd(logits, labels)[0]


def _cross_entropy_fwd(logits, labels):
  x = logits.astype(jnp.float32)
  m = jax.lax.stop_gradient(x.max(axis=-1))
  lse = m + jnp.log(jnp.exp(x - m[..., None]).sum(axis=-1))
  label_logit = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
  return lse - label_logit, (logits, labels, lse)


def _cross_entropy_bwd(res, g):
  logits, labels, lse = res
  x = logits.astype(jnp.float32)
  # int32 on both sides: an arange in a narrow label dtype (uint8) would wrap around.
  one_hot = labels[..., None].astype(jnp.int32) == jnp.arange(x.shape[-1], dtype=jnp.int32)
  grad = (jnp.exp(x - lse[..., None]) - one_hot) * g[..., None]
  return grad.astype(logits.dtype), None


cross_entropy_with_integer_labels.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


# Record fields passed to the model beside the tokens, where a source gives them.
MODEL_INPUTS = ("positions", "segment_ids")


def apply_model(model: Transformer, params: Any, batch: Batch, **kw) -> Array:
  """Logits [B, T, V] of `batch["inputs"]` [B, T], with its positions and segment ids if any."""
  extra = {k: batch[k] for k in MODEL_INPUTS if k in batch}
  return model.apply({"params": params}, batch["inputs"], **extra, **kw)


def weighted_metrics(logits: Array, batch: Batch) -> dict[str, Array]:
  """Sums of weighted NLL, correct predictions and weights over a batch.

  Args:
    logits: [B, T, V] float32 or the model's compute dtype (NLL is computed in float32).
    batch: "targets" int32 [B, T] and "weights" float32 [B, T].
  """
  nll = cross_entropy_with_integer_labels(logits, batch["targets"])
  w = batch["weights"]
  correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
  return {"nll_sum": jnp.sum(nll * w), "correct_sum": jnp.sum(correct * w),
          "weight_sum": jnp.sum(w)}


def init_state(model: Transformer, cfg: TrainConfig, seeds: Sequence[int], seq_len: int,
               init_params: Any = None) -> TrainState:
  """Parameters and optimiser state of M = len(seeds) models, stacked on a leading axis.

  `init_params` (one model's tree) replaces the fresh init of every member (fine-tuning). With
  `cfg.select_split`, `best` starts as the initial parameters at step -1 and loss +inf.
  """
  def one(seed):
    params = (model.init(jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))["params"]
              if init_params is None else init_params)
    return params, make_optimizer(cfg).init(params)
  params, opt_state = jax.vmap(one)(jnp.asarray(seeds, jnp.uint32))
  best = None
  if cfg.select_split is not None:
    m = len(seeds)
    best = {"params": params, "step": jnp.full((m,), -1, jnp.int32),
            "loss": jnp.full((m,), jnp.inf, jnp.float32)}
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                    best=best)


def keep_best(best: dict, params: Any, loss: Array, step: Array) -> dict:
  """`TrainState.best` updated with an evaluation: member m takes `params[m]` where
  `loss[m]` (float32 [M]) is strictly below its best loss (a tie keeps the earlier step; NaN never
  wins); `step` [] int32 is the step evaluated."""
  better = loss < best["loss"]                                          # [M]
  pick = lambda new, old: jnp.where(better.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  return {"params": jax.tree.map(pick, params, best["params"]),
          "step": jnp.where(better, step, best["step"]),
          "loss": jnp.where(better, loss, best["loss"])}


def state_shardings(state: TrainState, mesh: Mesh, fsdp: bool):
  """Shardings of a train state: replicated, or FSDP over the mesh's "data" axis.

  Under FSDP a parameter or optimiser leaf [M, ...] of at least 2^14 elements is split along its
  largest dimension (after the seed axis M) that the device count divides; others stay replicated.
  """
  replicated = NamedSharding(mesh, P())
  if not fsdp or mesh.size == 1:
    return jax.tree.map(lambda _: replicated, state)

  def leaf(x):
    dims = [d for d in range(1, x.ndim) if x.shape[d] % mesh.size == 0]
    if not dims or math.prod(x.shape) < 2**14:
      return replicated
    spec = [None] * x.ndim
    spec[max(dims, key=lambda d: x.shape[d])] = "data"
    return NamedSharding(mesh, P(*spec))
  return jax.tree.map(leaf, state)


def make_train_step(model: Transformer, cfg: TrainConfig):
  """Returns `train_step(state, batches, seeds) -> (state, metrics)` for C = steps_per_call steps.

  batches: "inputs", "targets" int32 [M, C, B, T], "weights" float32 [M, C, B, T]; seeds: [M]
  uint32 (dropout randomness). Metrics are [M, C].
  """
  optimizer = make_optimizer(cfg)

  def loss_fn(params, batch, dropout_key):
    logits = apply_model(model, params, batch, deterministic=False,
                         rngs={"dropout": dropout_key})
    m = weighted_metrics(logits, batch)
    return m["nll_sum"] / jnp.maximum(m["weight_sum"], 1.0), m

  def member_steps(params, opt_state, batches, seed, step0):
    def one_step(carry, batch):
      params, opt_state, step = carry
      key = jax.random.fold_in(jax.random.key(seed + 1), step)
      grads, m = jax.grad(loss_fn, has_aux=True)(params, batch, key)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      m["grad_norm"] = optax.tree.norm(grads)
      return (optax.apply_updates(params, updates), opt_state, step + 1), m
    (params, opt_state, _), ms = jax.lax.scan(one_step, (params, opt_state, step0), batches)
    return params, opt_state, ms

  def train_step(state: TrainState, batches, seeds):
    params, opt_state, ms = jax.vmap(member_steps, in_axes=(0, 0, 0, 0, None))(
        state.params, state.opt_state, batches, seeds, state.step)
    return state.replace(step=state.step + batches["inputs"].shape[1], params=params,
                         opt_state=opt_state), ms

  return train_step


def make_eval_step(model: Transformer):
  """`eval_step(params [M, ...], batch [B, T]) -> metric sums [M]`."""
  def eval_step(params, batch):
    return weighted_metrics(apply_model(model, params, batch), batch)
  return jax.vmap(eval_step, in_axes=(0, None))


@functools.lru_cache(maxsize=4)   # Seeds trained one after another reuse one compile.
def _step_functions(model_config: ModelConfig, cfg: TrainConfig, mesh: Mesh, members: int,
                    seq_len: int):
  """(state shardings, jitted train step, jitted eval step, jitted `keep_best`) of M =
  `members` models.

  `cfg` comes with its seed and data_workers reset (neither enters the step), so every seed of a
  configuration shares these functions and their compiled programs within a process.
  """
  model = Transformer(model_config)
  abstract = jax.eval_shape(lambda: init_state(model, cfg, tuple(range(members)), seq_len))
  shardings = state_shardings(abstract, mesh, cfg.fsdp)
  train_step = jax.jit(make_train_step(model, cfg), donate_argnums=0,
                       out_shardings=(shardings, NamedSharding(mesh, P())))
  best = (None if shardings.best is None else
          jax.jit(keep_best, donate_argnums=0, out_shardings=shardings.best))
  return shardings, train_step, jax.jit(make_eval_step(model)), best


def _train_batches(source, cfg: TrainConfig, seed: int, start_call: int):
  """Iterator over stacked batches [C, B, T] of one seed from call `start_call` on (grain)."""
  ds = (grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
        .batch(cfg.batch_size, drop_remainder=True).batch(cfg.steps_per_call, drop_remainder=True))
  ds = ds.slice(slice(start_call, None)).to_iter_dataset(
      grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
  if cfg.data_workers:
    if not absl_flags.FLAGS.is_parsed():  # grain's workers read absl flags; CLIs here use argparse.
      absl_flags.FLAGS.mark_as_parsed()
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
             max_batches: int | None, shard) -> list[dict[str, dict[str, float]]]:
  """Per member: mean NLL per weighted token and weighted accuracy for each named source."""
  members = jax.tree.leaves(params)[0].shape[0]
  out = [{} for _ in range(members)]
  for name, source in sources.items():
    total = np.zeros((3, members))
    for batch in _eval_batches(source, batch_size, max_batches):
      m = jax.device_get(eval_step(params, shard(batch)))
      total += np.stack([m["nll_sum"], m["correct_sum"], m["weight_sum"]])
    for i in range(members):
      w = max(total[2, i], 1.0)
      out[i][name] = {"loss": float(total[0, i] / w), "accuracy": float(total[1, i] / w)}
  return out


def _read_history(path: Path, up_to: int) -> list[dict]:
  """Metrics lines logged up to the resumed step (later ones are recomputed).

  An unparseable last line (a record cut short by a crash) is dropped with a warning.

  Raises:
    ValueError: a line other than the last is not valid JSON.
  """
  if not path.exists():
    return []
  lines = path.read_text().splitlines()
  records = []
  for i, line in enumerate(lines):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if i < len(lines) - 1:
        raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e.msg}); the metrics log is "
                         f"corrupt") from e
      warnings.warn(f"{path}: dropping its last line, a record cut short ({e.msg})", stacklevel=2)
  return [r for r in records if r["step"] <= up_to]


# run.json fields that do not change results, so a resumed run may change them.
RESULT_NEUTRAL_FIELDS = ("train.data_workers",)


def has_checkpoints(workdir: Path) -> bool:
  """Whether `workdir/checkpoints` holds step folders (a run has begun there).

  Raises:
    NotADirectoryError: `workdir/checkpoints` exists but is not a folder.
  """
  path = (Path(workdir) / "checkpoints").absolute()
  if path.exists() and not path.is_dir():
    raise NotADirectoryError(f"{path} is not a folder: move it away or use another output folder")
  return path.is_dir() and any(p.name.isdigit() and p.is_dir() for p in path.iterdir())


def checkpoint_manager(workdir: Path, run_info: dict, *, resume: bool) -> ocp.CheckpointManager:
  """Orbax manager under `workdir/checkpoints`, refusing to mix a run with another one.

  `run_info` (configs and seeds) is written to `workdir/run.json` on a fresh start and compared
  on resume (except `RESULT_NEUTRAL_FIELDS`). Temporary folders of saves cut short
  (`*.orbax-checkpoint-tmp-*`) are deleted.

  Raises:
    FileExistsError: resume=False but checkpoints exist (pass resume or pick another workdir).
    FileNotFoundError: resume=True but the checkpoint folder is missing or empty.
    NotADirectoryError: `workdir/checkpoints` is a file.
    ValueError: resume=True with a configuration that differs from the checkpointed run's, or
      an unreadable run.json.
  """
  path = (workdir / "checkpoints").absolute()
  info_file = workdir / "run.json"
  exists = has_checkpoints(workdir)
  if resume and not exists:
    raise FileNotFoundError(f"--resume: no checkpoint found in {path}")
  if not resume and exists:
    raise FileExistsError(f"{path} already holds checkpoints: resume the run or use another "
                          f"output folder")
  info = json.loads(json.dumps(run_info, default=str))
  if resume:
    try:
      saved = json.loads(info_file.read_text()) if info_file.exists() else None
    except json.JSONDecodeError as e:
      raise ResumeError(f"cannot resume: {info_file} is not valid JSON ({e})") from e
    diff = [] if saved is None else config_diff(saved, info, RESULT_NEUTRAL_FIELDS)
    if diff:
      raise ResumeError(f"cannot resume {workdir}: its run.json differs in {', '.join(diff)}")
  elif jax.process_index() == 0:  # Multi-host: one writer of the shared folder's files.
    atomic.write_json(info_file, info)
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                         enable_async_checkpointing=False,
                                         cleanup_tmp_directories=True)
  # One (default) item, fixed up front: otherwise orbax infers the layout from the first step it
  # reads, and an empty step folder would make it misread every other step.
  return ocp.CheckpointManager(path, item_handlers=ocp.StandardCheckpointHandler(), options=options)


def _short_reason(e: BaseException, limit: int = 200) -> str:
  """The type and first line of an exception's message, cut to `limit` characters."""
  text = (str(e).strip().splitlines() or [""])[0]
  text = text if len(text) <= limit else text[:limit] + "..."
  return f"{type(e).__name__}: {text}"


def restore_state(manager: ocp.CheckpointManager, abstract: TrainState) -> TrainState:
  """Restores the latest readable checkpoint into `abstract`'s structure and shardings.

  A step that cannot be read (an empty or partly deleted folder, corrupt files) is reported with
  a warning and the next older step is tried. Once one restores, the unreadable newer step folders
  are renamed to `<step>.unreadable-<n>` (kept for inspection) so that training can save them anew.
  With several processes, all resume from the newest step that every process could read.

  Raises:
    ValueError: no checkpoint can be read (corrupt, or from another model/optimiser).
  """
  steps = sorted(manager.all_steps(), reverse=True)
  args = ocp.args.StandardRestore(abstract)
  state, restored, error = None, -1, None
  for step in steps:
    try:
      state, restored = manager.restore(step, args=args), step
      break
    except Exception as e:  # Orbax raises many types; name the folder and keep the cause.
      error = e
      warnings.warn(f"cannot read checkpoint {Path(manager.directory) / str(step)} "
                    f"({_short_reason(e)}); trying an older step", stacklevel=2)
  if jax.process_count() > 1:
    agreed = int(np.min(multihost_utils.process_allgather(np.int64(restored))))
    if agreed != restored and agreed >= 0:
      state, restored = manager.restore(agreed, args=args), agreed
    restored = agreed
  if restored < 0:
    cause = f" (step {steps[-1]}: {_short_reason(error)})" if steps and error else ""
    raise ValueError(f"cannot restore checkpoint from {manager.directory}: none of the steps "
                     f"{steps} can be read{cause}") from error
  bad = [s for s in steps if s > restored]
  if bad:  # Move them aside: orbax refuses to save a step whose folder exists.
    for b in bad if jax.process_index() == 0 else ():
      folder, n = Path(manager.directory) / str(b), 0
      while folder.with_name(f"{b}.unreadable-{n}").exists():
        n += 1
      folder.rename(folder.with_name(f"{b}.unreadable-{n}"))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("pope_jax.train.restore_state")
    manager.reload()
    warnings.warn(f"resuming from step {restored}; unreadable steps {bad} were renamed to "
                  f"<step>.unreadable-<n> in {manager.directory}", stacklevel=2)
  return state


def restore_params(workdir: str | Path, member: int = 0, *, best: bool = False) -> Any:
  """One seed's parameters from the latest checkpoint of a `train_and_evaluate` run folder.

  Only the parameters are read (no optimiser state), as host numpy arrays, so a run trained on
  any devices restores on the CPU.

  Args:
    workdir: the run folder (holds `checkpoints/`).
    member: m, the index of the seed among those trained together (`run.json`'s "seeds").
    best: the best-validation parameters kept beside the latest (`TrainConfig.select_split`)
      instead of the latest.

  Returns:
    The params tree of that seed (leaves without the member axis M).

  Raises:
    FileNotFoundError: workdir holds no checkpoint.
    IndexError: member outside 0..M-1.
    ValueError: best=True for a run that selected no checkpoint.
  """
  path = (Path(workdir) / "checkpoints").absolute()
  if not has_checkpoints(workdir):
    raise FileNotFoundError(f"no checkpoint in {path}")
  step = max(int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir())
  item = path / str(step) / "default"         # the manager's one item (`checkpoint_manager`)
  handler = ocp.PyTreeCheckpointHandler()
  tree = handler.metadata(item).tree
  if best and not isinstance(tree.get("best"), Mapping):
    handler.close()
    raise ValueError(f"{workdir} kept no best-validation parameters (trained without "
                     f"TrainConfig.select_split)")
  meta = tree["best"]["params"] if best else tree["params"]
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
  wrap = (lambda x: {"best": {"params": x}}) if best else (lambda x: {"params": x})
  restored = handler.restore(item, args=ocp.args.PyTreeRestore(
      item=wrap(meta), restore_args=wrap(as_numpy), partial_restore=True))
  params = restored["best"]["params"] if best else restored["params"]
  handler.close()
  members = jax.tree.leaves(params)[0].shape[0]
  if not 0 <= member < members:
    raise IndexError(f"member {member} is outside the {members} seeds trained in {workdir}")
  return jax.tree.map(lambda x: x[member], params)


def _open_metrics_log(path: Path, history: list[dict]):
  """The metrics log, rewritten to `history` atomically (temp file + rename), open for appending.

  A kill at any moment leaves either the old log or the rewritten one. Processes other than 0
  compute the same records and write them nowhere.
  """
  if jax.process_index() != 0:
    return open(os.devnull, "w")
  atomic.write_text(path, "".join(json.dumps(r) + "\n" for r in history))
  return path.open("a")


def train_and_evaluate(
    model_config: ModelConfig,
    train_config: TrainConfig,
    *,
    train_source,
    eval_sources: Mapping[str, Any],
    workdir: str | Path,
    resume: bool = False,
    seeds: Sequence[int] | None = None,
    progress: bool = True,
    init_params: Any = None,
    lock: bool = True,
) -> list[TrainResult]:
  """Trains Transformers (one per seed, side by side) and evaluates them periodically.

  Args:
    model_config, train_config: see `pope_jax.config`.
    train_source: grain random-access source of records (module docstring).
    eval_sources: split name → source, evaluated every `eval_every` steps and at the end (the
      final evaluation reads whole splits).
    workdir: folder for `checkpoints/` (orbax), `run.json` and `metrics.jsonl`.
    resume: continue from the latest checkpoint in workdir (same data order).
    seeds: seeds trained together (vmapped); default `(train_config.seed,)`.
    progress: show a tqdm bar.
    init_params: start every seed from these parameters (one model's tree; fine-tuning) instead
      of a fresh init; a resumed checkpoint takes precedence.
    lock: hold workdir's run lock (`pope_jax.run_lock`, process 0) for the whole call; False when
      the caller already holds it (the lock is not re-entrant).

  Returns:
    One TrainResult per seed, in order.

  Raises:
    RunLockedError: another run is writing workdir.
    ValueError: batch size not divisible by the device count, `select_split` not among
      eval_sources, or an unreadable checkpoint.
    FileExistsError / FileNotFoundError / NotADirectoryError: see `checkpoint_manager`.
  """
  cfg = train_config
  seeds = tuple(int(s) for s in (seeds if seeds is not None else (cfg.seed,)))
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise ValueError(f"seeds must be distinct, non-negative and non-empty, got {seeds}")
  if cfg.select_split is not None and cfg.select_split not in eval_sources:
    raise ValueError(f"TrainConfig.select_split={cfg.select_split!r} is not one of the "
                     f"evaluation splits {sorted(eval_sources)}")
  workdir = Path(workdir)
  with (run_lock(workdir) if lock and jax.process_index() == 0 else contextlib.nullcontext()):
    return _train_and_evaluate(model_config, cfg, train_source, eval_sources, workdir, resume,
                               seeds, progress, init_params)


def _train_and_evaluate(model_config, cfg, train_source, eval_sources, workdir, resume, seeds,
                        progress, init_params) -> list[TrainResult]:
  """`train_and_evaluate` once the seeds are checked and workdir is locked."""
  workdir.mkdir(parents=True, exist_ok=True)
  devices = jax.devices()
  if cfg.batch_size % len(devices):
    raise ValueError(f"TrainConfig.batch_size={cfg.batch_size} is not divisible by the "
                     f"{len(devices)} devices")
  mesh = Mesh(np.array(devices), ("data",))
  seq_len = train_source[0]["inputs"].shape[0]
  model = Transformer(model_config)

  manager = checkpoint_manager(workdir, {
      "model": dataclasses.asdict(model_config), "train": dataclasses.asdict(cfg),
      "seeds": list(seeds), "train_source": f"{type(train_source).__name__}[{len(train_source)}]"},
      resume=resume)
  shardings, train_step, eval_step, update_best = _step_functions(
      model_config, dataclasses.replace(cfg, seed=0, data_workers=0), mesh, len(seeds), seq_len)
  init = lambda p: init_state(model, cfg, seeds, seq_len, p)
  state = jax.jit(init, out_shardings=shardings)(init_params)
  if resume:
    state = restore_state(manager, state)
  start = int(state.step)
  if start % cfg.steps_per_call:
    raise ValueError(f"checkpoint step {start} is not a multiple of steps_per_call="
                     f"{cfg.steps_per_call}")

  def shard(batch, spec=P("data")):
    return jax.device_put(batch, NamedSharding(mesh, spec))

  streams = [_train_batches(train_source, cfg, s, start // cfg.steps_per_call) for s in seeds]
  seeds_array = jnp.asarray(seeds, jnp.uint32)
  history = _read_history(workdir / "metrics.jsonl", up_to=start)
  if jax.process_count() > 1:  # Every process has read the log before process 0 rewrites it.
    multihost_utils.sync_global_devices("pope_jax.train.read_history")
  metrics_file = _open_metrics_log(workdir / "metrics.jsonl", history)
  # A run resumed after training finished keeps the speed its final records logged.
  speed = next((h["steps_per_second"] for h in history if "steps_per_second" in h), math.nan)
  bar = tqdm(total=cfg.steps, initial=start, disable=not progress, desc=workdir.name,
             dynamic_ncols=True)
  t0, step = time.perf_counter(), start
  while step < cfg.steps:
    batches = jax.tree.map(lambda *b: np.stack(b), *[next(it) for it in streams])  # [M, C, B, T]
    state, m = train_step(state, shard(batches, P(None, None, "data")), seeds_array)
    step += cfg.steps_per_call
    bar.update(cfg.steps_per_call)
    records = None
    if step % cfg.log_every == 0 or step == cfg.steps:
      m = jax.device_get(m)
      lr = float(learning_rate_schedule(cfg)(step - 1))
      records = [{"step": step, "seed": s, "lr": lr,
                  "train_loss": float(m["nll_sum"][i, -1] / max(m["weight_sum"][i, -1], 1.0)),
                  "grad_norm": float(m["grad_norm"][i, -1])} for i, s in enumerate(seeds)]
      bar.set_postfix(loss=f"{np.mean([r['train_loss'] for r in records]):.3f}")
    if step == cfg.steps:    # The metrics above were fetched, so the device work is finished.
      speed = (step - start) / (time.perf_counter() - t0)
      for record in records:
        record["steps_per_second"] = speed
    if step % cfg.eval_every == 0 or step == cfg.steps:
      records = records or [{"step": step, "seed": s} for s in seeds]
      evals = evaluate(eval_step, state.params, eval_sources, cfg.batch_size, cfg.eval_batches,
                       shard)
      for record, em in zip(records, evals):
        record.update({f"{split}_{k}": v for split, d in em.items() for k, v in d.items()})
      if update_best is not None:
        loss = np.asarray([em[cfg.select_split]["loss"] for em in evals], np.float32)
        state = state.replace(best=update_best(state.best, state.params, loss, np.int32(step)))
    for record in records or ():
      history.append(record)
      metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    if step % cfg.checkpoint_every == 0 or step == cfg.steps:
      manager.save(step, args=ocp.args.StandardSave(state))
  manager.close()
  bar.close()
  metrics_file.close()
  final = evaluate(eval_step, state.params, eval_sources, cfg.batch_size, None, shard)
  params = jax.device_get(state.params)
  results = [TrainResult(seed=s, params=jax.tree.map(lambda x: x[i], params), metrics=final[i],
                         history=[h for h in history if h["seed"] == s], steps_per_second=speed)
             for i, s in enumerate(seeds)]
  if state.best is not None:
    at_best = evaluate(eval_step, state.best["params"], eval_sources, cfg.batch_size, None, shard)
    best = jax.device_get(state.best)
    for i, r in enumerate(results):
      r.best_step, r.best_metrics = int(best["step"][i]), at_best[i]
      r.best_params = jax.tree.map(lambda x: x[i], best["params"])
  return results
