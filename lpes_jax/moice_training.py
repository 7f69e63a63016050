"""Router-only training of MoICE (`lpes_jax.moice`): data, loss, jitted optax step, orbax loop.

    data = kv_training_data(task, tok, config, num_examples=896, seed=1000)
    result = train_routers(config, params, data, mcfg, RouterTrainConfig(...), workdir,
                           run_info=..., heldout=heldout_data, snapshot_steps=(7, 50))

The released recipe (github.com/p1nksnow/MoICE `training/train.sh`): the model frozen, only the
routers trained, the causal LM loss on every token of prompt + answer (`--pretrain_loss True`)
plus 0.3 × the load-balancing loss, AdamW (lr 1e-4 constant, weight decay 0, gradient norm
clipped at 1 as the Hugging Face Trainer does), 7 steps of 128 sequences of OpenHermes-2.5
instructions with their answers and EOS.

Here the sequences are KV-retrieval prompts with their gold answers (`<answer prefix><value>`
and EOS), drawn from a seed disjoint from the LPES search seed (0) and the held-out seeds; gold
positions cycle over every position. OpenHermes is not available here, and this is the same
kind of data the LPES search sees. Other differences: the model runs in the CLI's --dtype
(float32 by default, as lpes_eval; the released run is bf16), and the 128 sequences of a step are
micro-batches in one `lax.scan` instead of 32 accumulation steps on 4 GPUs (the same average).

Shape letters: B sequences per step, A micro-batches per step, T tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from lpes_jax import moice
from lpes_jax.checkpoints import load_checkpoint
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import Llama, init_params
from lpes_jax.tasks.task import (ANSWER_PREFIX, TaskConfig, answer_text, encode_prompt,
                                 num_items, task_examples)
from lpes_jax.tokenizer import load_tokenizer
from pope_jax import atomic, generation
from pope_jax import train as pope_train

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterTrainConfig:
  """Router training settings (defaults: the released recipe).

  Attributes:
    steps: optimiser steps.
    batch_size: sequences per step (B).
    micro_batch: sequences per forward/backward pass; B % micro_batch == 0 (gradients averaged).
    learning_rate: AdamW learning rate (constant).
    max_grad_norm: global gradient-norm clip.
    init_seed: seed of the router initialisation.
  """
  steps: int = 7
  batch_size: int = 128
  micro_batch: int = 16
  learning_rate: float = 1e-4
  max_grad_norm: float = 1.0
  init_seed: int = 0

  def __post_init__(self):
    for name in ("steps", "batch_size", "micro_batch"):
      if getattr(self, name) < 1:
        raise ValueError(f"RouterTrainConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.batch_size % self.micro_batch:
      raise ValueError(f"RouterTrainConfig.batch_size ({self.batch_size}) must be a multiple of "
                       f"micro_batch ({self.micro_batch})")
    if not self.learning_rate > 0 or not self.max_grad_norm > 0:
      raise ValueError(f"RouterTrainConfig.learning_rate and max_grad_norm must be > 0, got "
                       f"{self.learning_rate}, {self.max_grad_norm}")


# A random 2-layer Llama for plumbing checks (`load_model(tiny=True)`), with a real tokenizer.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=100000.0, max_position_embeddings=8192)


def load_model(model: str, *, tiny: bool = False, dtype: str = "float32"):
  """(tokenizer, LlamaConfig, params) of the checkpoint `model` (GGUF or Hugging Face folder),
  or with `tiny` a random `TINY_LLAMA` with that checkpoint's tokenizer."""
  tok = load_tokenizer(model)
  if not tiny:
    config, params = load_checkpoint(model, dtype=dtype)
    return tok, config, params
  config = LlamaConfig(vocab_size=tok.vocab_size, dtype=dtype, eos_token_ids=tuple(tok.eos_ids),
                       pad_token_id=tok.pad_id, **TINY_LLAMA)
  return tok, config, init_params(config, jax.random.key(0), scale=0.1)


@dataclasses.dataclass(frozen=True)
class TrainData:
  """Training sequences, left-padded. tokens [M, T] int32; mask [M, T] bool (False: pad)."""
  tokens: np.ndarray
  mask: np.ndarray


def kv_training_data(task: TaskConfig, tok, config: LlamaConfig, *, num_examples: int,
                     seed: int) -> TrainData:
  """Prompt + `<answer prefix><answer>` + EOS sequences, gold positions cycling over all items,
  shuffled, left-padded to a multiple of 32 tokens.

  Raises:
    ValueError: num_examples < 1, or a sequence longer than the model's context.
  """
  if num_examples < 1:
    raise ValueError(f"num_examples must be >= 1, got {num_examples}")
  items = num_items(task)
  per_gold = -(-num_examples // items)
  eos = list(config.eos_token_ids[:1])
  seqs = []
  for gold in range(items):
    for e in task_examples(task, gold, per_gold, seed):
      seqs.append(encode_prompt(tok, e.prompt, task.chat)
                  + tok.encode(ANSWER_PREFIX[task.task] + answer_text(task, e), add_bos=False)
                  + eos)
  order = np.random.default_rng(seed).permutation(len(seqs))[:num_examples]
  seqs = [seqs[i] for i in order]
  longest = max(map(len, seqs))
  if longest > config.max_position_embeddings:
    raise ValueError(f"a training sequence of {longest} tokens exceeds the model's context of "
                     f"{config.max_position_embeddings}: use fewer pairs")
  tokens, mask = generation.left_pad(seqs, -(-longest // 32) * 32, config.pad_token_id or 0)
  return TrainData(np.asarray(tokens, np.int32), np.asarray(mask, bool))


def lm_loss(logits: Array, tokens: Array, mask: Array) -> Array:
  """Mean next-token cross-entropy over the real tokens: logits [B, T, V], tokens and mask
  [B, T]; position t predicts t + 1 where both are real. [] float32."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  w = (mask[:, :-1] & mask[:, 1:]).astype(jnp.float32)
  return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def moice_loss(routers: moice.Routers, params: Any, tokens: Array, mask: Array,
               config: LlamaConfig, mcfg: moice.MoiceConfig) -> tuple[Array, dict]:
  """LM loss + aux_loss_coef × load-balancing loss of the MoICE model (released `forward`).

  Args:
    routers: trained leaves; params: the frozen model; tokens [B, T] int32, mask [B, T] bool.

  Returns:
    (loss [] float32, {"loss", "lm_loss", "aux_loss", "router_entropy"}), the entropy in nats
    (`moice.router_entropy`; log E = uniform routing).
  """
  logits, state = Llama(config).apply(
      {"params": params}, tokens, attention_mask=mask,
      attention=moice.moice_attention(routers, config, mcfg), mutable=["intermediates"])
  inter = state["intermediates"]
  router_logits = jnp.stack([inter[f"layers_{i}"]["self_attn"]["router_logits"][0]
                             for i in range(config.num_layers)])         # [L, B, T, N, E]
  lm = lm_loss(logits, tokens, mask)
  aux = moice.load_balancing_loss(router_logits, mcfg.top_k, mask)
  loss = lm + mcfg.aux_loss_coef * aux
  entropy = jax.lax.stop_gradient(moice.router_entropy(router_logits, mask))
  return loss, {"loss": loss, "lm_loss": lm, "aux_loss": aux, "router_entropy": entropy}


METRICS = ("loss", "lm_loss", "aux_loss", "router_entropy")


def make_optimizer(tcfg: RouterTrainConfig) -> optax.GradientTransformation:
  """Clip the global gradient norm, then AdamW (betas 0.9, 0.999, eps 1e-8, no weight decay)."""
  return optax.chain(optax.clip_by_global_norm(tcfg.max_grad_norm),
                     optax.adamw(tcfg.learning_rate, b1=0.9, b2=0.999, eps=1e-8,
                                 weight_decay=0.0))


def make_train_step(config: LlamaConfig, mcfg: moice.MoiceConfig,
                    optimizer: optax.GradientTransformation) -> Callable:
  """Jitted `step(routers, opt_state, params, tokens, mask) -> (routers, opt_state, metrics)`.

  tokens, mask: [A, B/A, T]; the gradients (with respect to the routers only) and the metrics
  are averaged over the A micro-batches (`lax.scan`); params are never updated.
  """
  grad_fn = jax.value_and_grad(moice_loss, has_aux=True)

  def step(routers, opt_state, params, tokens, mask):
    def micro(carry, batch):
      (_, metrics), grads = grad_fn(routers, params, *batch, config, mcfg)
      return jax.tree.map(jnp.add, carry, (grads, metrics)), None

    zeros = (jax.tree.map(jnp.zeros_like, routers),
             {k: jnp.zeros((), jnp.float32) for k in METRICS})
    (grads, metrics), _ = jax.lax.scan(micro, zeros, (tokens, mask))
    grads, metrics = jax.tree.map(lambda x: x / tokens.shape[0], (grads, metrics))
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, routers)
    return optax.apply_updates(routers, updates), opt_state, metrics

  return jax.jit(step)


def make_eval_step(config: LlamaConfig, mcfg: moice.MoiceConfig) -> Callable:
  """Jitted `evaluate(routers, params, tokens, mask) -> metrics`: `METRICS` averaged over the
  A micro-batches of tokens, mask [A, b, T] (no update)."""
  def evaluate(routers, params, tokens, mask):
    def micro(carry, batch):
      _, metrics = moice_loss(routers, params, *batch, config, mcfg)
      return jax.tree.map(jnp.add, carry, metrics), None
    total, _ = jax.lax.scan(micro, {k: jnp.zeros((), jnp.float32) for k in METRICS},
                            (tokens, mask))
    return jax.tree.map(lambda x: x / tokens.shape[0], total)
  return jax.jit(evaluate)


def _micro_batches(data: TrainData, rows, micro_batch: int):
  """tokens, mask of `data[rows]` as [A, micro_batch, T]."""
  return (data.tokens[rows].reshape(-1, micro_batch, data.tokens.shape[1]),
          data.mask[rows].reshape(-1, micro_batch, data.mask.shape[1]))


def train_routers(config: LlamaConfig, params: Any, data: TrainData, mcfg: moice.MoiceConfig,
                  tcfg: RouterTrainConfig, workdir: str | Path, *, run_info: dict,
                  resume: bool = False, log: Callable[[str], None] = print,
                  heldout: TrainData | None = None, eval_every: int | None = None,
                  snapshot_steps: tuple[int, ...] = (), checkpoint_every: int = 1) -> dict:
  """Trains the routers and writes `workdir/routers` + `moice.json` (`moice.save_routers`).

  Orbax checkpoints of the routers, optimiser state and step go to `workdir/checkpoints` every
  `checkpoint_every` steps and at the end (`pope_jax.train.checkpoint_manager`: atomic, two
  kept), with `workdir/history.json`; `resume` continues from the latest. Step s trains on sequences [s·B, (s+1)·B) of `data`, taken modulo its length (a
  pool smaller than steps × B is seen several times, in the same order each time). The learning
  rate is constant, so the state after s steps is that of a run of budget s: one run serves
  every budget up to `tcfg.steps` (`snapshot_steps`).

  Args:
    run_info: what defines the run (configs, data); compared on resume.
    heldout: sequences kept out of training; their mean metrics (`METRICS`, prefixed
      "heldout_") are logged at every step in `snapshot_steps`, every `eval_every` steps and at
      the end. Its length must be a multiple of micro_batch.
    eval_every: see heldout (None: only at snapshots and the end).
    snapshot_steps: steps after which the routers are also saved to `workdir/step_<s>`.
    checkpoint_every: steps between checkpoints.

  Returns:
    {"history": [{"step", "loss", "lm_loss", "aux_loss", "router_entropy", "grad_norm",
    ["heldout_loss", ...]}, ...], "routers": ...}.

  Raises:
    ValueError: data with fewer than batch_size sequences or not a multiple of it, held-out data
      not a multiple of micro_batch, or a snapshot step outside 1..steps.
    FileExistsError, FileNotFoundError, pope_jax.train.ResumeError: see `checkpoint_manager`.
  """
  pool = data.tokens.shape[0]
  if pool < tcfg.batch_size or pool % tcfg.batch_size:
    raise ValueError(f"the training data ({pool} sequences) must be a positive multiple of "
                     f"batch_size {tcfg.batch_size}")
  if heldout is not None and heldout.tokens.shape[0] % tcfg.micro_batch:
    raise ValueError(f"the held-out data ({heldout.tokens.shape[0]} sequences) must be a "
                     f"multiple of micro_batch {tcfg.micro_batch}")
  if any(not 1 <= s <= tcfg.steps for s in snapshot_steps):
    raise ValueError(f"snapshot_steps {snapshot_steps} must lie in 1..{tcfg.steps}")
  workdir = Path(workdir)
  optimizer = make_optimizer(tcfg)
  routers = moice.init_routers(jax.random.key(tcfg.init_seed), config, mcfg)
  state = {"routers": routers, "opt_state": optimizer.init(routers),
           "step": jnp.zeros((), jnp.int32)}
  history_file = workdir / "history.json"
  history = []
  with pope_train.checkpoint_manager(workdir, run_info, resume=resume) as manager:
    if resume:
      state = pope_train.restore_state(manager, state)
      history = [h for h in json.loads(history_file.read_text()) if h["step"] <= int(state["step"])]
      log(f"resumed at step {int(state['step'])}")
    step_fn = make_train_step(config, mcfg, optimizer)
    eval_fn = make_eval_step(config, mcfg) if heldout is not None else None
    heldout_batches = (None if heldout is None else
                       _micro_batches(heldout, slice(None), tcfg.micro_batch))
    for s in range(int(state["step"]), tcfg.steps):
      start = (s * tcfg.batch_size) % pool
      tokens, mask = _micro_batches(data, slice(start, start + tcfg.batch_size),
                                    tcfg.micro_batch)
      routers, opt_state, metrics = step_fn(state["routers"], state["opt_state"], params,
                                            tokens, mask)
      state = {"routers": routers, "opt_state": opt_state, "step": jnp.int32(s + 1)}
      record = {"step": s + 1, **{k: float(v) for k, v in metrics.items()}}
      if eval_fn is not None and (s + 1 in snapshot_steps or s + 1 == tcfg.steps or (
          eval_every and (s + 1) % eval_every == 0)):
        held = eval_fn(routers, params, *heldout_batches)
        record.update({f"heldout_{k}": float(v) for k, v in held.items()})
      if s + 1 in snapshot_steps:
        moice.save_routers(workdir / f"step_{s + 1}", routers, mcfg, config)
      history.append(record)
      if (s + 1) % checkpoint_every == 0 or s + 1 == tcfg.steps:
        manager.save(s + 1, args=ocp.args.StandardSave(state))
        atomic.write_json(history_file, history)
      log(f"step {s + 1}/{tcfg.steps}  loss {record['loss']:.4f}  lm {record['lm_loss']:.4f}  "
          f"aux {record['aux_loss']:.4f}  router entropy {record['router_entropy']:.4f}"
          + (f"  held-out loss {record['heldout_loss']:.4f}" if "heldout_loss" in record
             else ""))
    manager.wait_until_finished()
  moice.save_routers(workdir, state["routers"], mcfg, config)
  return {"history": history, "routers": state["routers"]}
