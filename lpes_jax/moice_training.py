"""Router-only training of MoICE (`lpes_jax.moice`): data, loss, jitted optax step, orbax loop.

    data = kv_training_data(task, tok, config, num_examples=896, seed=1000)
    result = train_routers(config, params, data, mcfg, RouterTrainConfig(...), workdir)

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
from lpes_jax.config import LlamaConfig
from lpes_jax.llama import Llama
from lpes_jax.tasks.task import (ANSWER_PREFIX, TaskConfig, answer_text, encode_prompt,
                                 num_items, task_examples)
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
    (loss [] float32, {"loss", "lm_loss", "aux_loss"}).
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
  return loss, {"loss": loss, "lm_loss": lm, "aux_loss": aux}


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
             {k: jnp.zeros((), jnp.float32) for k in ("loss", "lm_loss", "aux_loss")})
    (grads, metrics), _ = jax.lax.scan(micro, zeros, (tokens, mask))
    grads, metrics = jax.tree.map(lambda x: x / tokens.shape[0], (grads, metrics))
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, routers)
    return optax.apply_updates(routers, updates), opt_state, metrics

  return jax.jit(step)


def train_routers(config: LlamaConfig, params: Any, data: TrainData, mcfg: moice.MoiceConfig,
                  tcfg: RouterTrainConfig, workdir: str | Path, *, run_info: dict,
                  resume: bool = False, log: Callable[[str], None] = print) -> dict:
  """Trains the routers and writes `workdir/routers` + `moice.json` (`moice.save_routers`).

  Orbax checkpoints of the routers, optimiser state and step go to `workdir/checkpoints` after
  every step (`pope_jax.train.checkpoint_manager`: atomic, two kept); `resume` continues from
  the latest. Step s trains on sequences [s·B, (s+1)·B) of `data`.

  Args:
    run_info: what defines the run (configs, data); compared on resume.

  Returns:
    {"history": [{"step", "loss", "lm_loss", "aux_loss", "grad_norm"}, ...], "routers": ...}.

  Raises:
    ValueError: data with fewer than steps × batch_size sequences.
    FileExistsError, FileNotFoundError, pope_jax.train.ResumeError: see `checkpoint_manager`.
  """
  need = tcfg.steps * tcfg.batch_size
  if data.tokens.shape[0] < need:
    raise ValueError(f"{tcfg.steps} steps of {tcfg.batch_size} sequences need {need} "
                     f"sequences, got {data.tokens.shape[0]}")
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
    A = tcfg.batch_size // tcfg.micro_batch
    for s in range(int(state["step"]), tcfg.steps):
      rows = slice(s * tcfg.batch_size, (s + 1) * tcfg.batch_size)
      tokens = data.tokens[rows].reshape(A, tcfg.micro_batch, -1)
      mask = data.mask[rows].reshape(A, tcfg.micro_batch, -1)
      routers, opt_state, metrics = step_fn(state["routers"], state["opt_state"], params,
                                            tokens, mask)
      state = {"routers": routers, "opt_state": opt_state, "step": jnp.int32(s + 1)}
      manager.save(s + 1, args=ocp.args.StandardSave(state))
      history.append({"step": s + 1, **{k: float(v) for k, v in metrics.items()}})
      atomic.write_json(history_file, history)
      log(f"step {s + 1}/{tcfg.steps}  loss {history[-1]['loss']:.4f}  "
          f"lm {history[-1]['lm_loss']:.4f}  aux {history[-1]['aux_loss']:.4f}")
    manager.wait_until_finished()
  moice.save_routers(workdir, state["routers"], mcfg, config)
  return {"history": history, "routers": state["routers"]}
