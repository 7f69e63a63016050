"""A model preset's train step timed with PoPE and with RoPE, its MFU and, optionally, where the
time goes (a helper, no CLI; `experiments.bench_attention --train-step`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from experiments import _profiling
from experiments._attention_paths import PEAK_TFLOPS, SPEC_PEAK_TFLOPS


def train_step_ratio(time_ms, batch: int, *, preset: str = "gpt2_124m", seq_len: int = 1024,
                     breakdown: bool = False, profile: bool = False,
                     logits_dtype: str = "float32") -> dict:
  """Train step of a model preset (default GPT-2-124M; value_and_grad + AdamW), [batch, seq_len]
  tokens, bf16 (logits in `logits_dtype`, see `ModelConfig`): PoPE vs RoPE. `time_ms(fn, *args)`
  gives the ms per call of a jitted fn (as `bench_attention` times).

  MFU counts 6·params·tokens plus causal attention (12·L·B·T²·d_model / 2: only the unmasked
  half) against the datasheet peak (SPEC_PEAK_TFLOPS); "mfu_palm" uses the PaLM convention
  (Chowdhery et al. 2022, App. B; nanoGPT's `estimate_mfu`): 6·params + 12·L·d_model·T per
  token, the full attention matrix. Both count RoPE's attention width for PoPE too (PoPE's q'k'
  are 2H wide), so the MFU ratio is the inverse time ratio. "mfu_of_measured_peak" uses the
  measured matmul peak instead of the datasheet's. With
  `breakdown`, also times the forward loss alone ("loss_ms"), the forward and backward
  ("grad_ms"; the optimizer is step - grad) and, once, the tied head and cross-entropy alone,
  forward and backward, on random final hidden states ("head_and_loss_ms").
  """
  import optax
  from pope_jax import config as config_lib
  from pope_jax.model import Transformer
  result = {}
  base = config_lib.MODEL_PRESETS[preset]
  for enc in ("rope", "pope"):
    cfg = dataclasses.replace(base, pos_encoding=enc, dtype="bfloat16", logits_dtype=logits_dtype)
    model = Transformer(cfg)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq_len + 1), 0, cfg.vocab_size)
    params = model.init(jax.random.key(1), tokens[:, :-1])["params"]
    opt = optax.adamw(1e-4)
    opt_state = opt.init(params)

    def loss_fn(p, tokens):
      return _next_token_loss(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    @jax.jit
    def step(p, s, tokens):
      loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
      updates, s = opt.update(grads, s, p)
      return optax.apply_updates(p, updates), s, loss

    ms = time_ms(step, params, opt_state, tokens)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    attention_flops = 12 * cfg.num_layers * batch * seq_len**2 * cfg.d_model
    flops = 6 * n_params * batch * seq_len + attention_flops / 2
    flops_palm = 6 * n_params * batch * seq_len + attention_flops
    result[enc] = {"ms": ms, "mfu": flops / (ms * 1e-3) / (SPEC_PEAK_TFLOPS * 1e12),
                   "mfu_palm": flops_palm / (ms * 1e-3) / (SPEC_PEAK_TFLOPS * 1e12),
                   "mfu_of_measured_peak": flops / (ms * 1e-3) / (PEAK_TFLOPS * 1e12),
                   "batch": batch,
                   "tokens_per_second": batch * seq_len / (ms * 1e-3)}
    result[enc]["logits_dtype"] = logits_dtype
    print(f"train step {preset} {enc} batch {batch} logits {logits_dtype}: {ms:.2f} ms, MFU "
          f"{result[enc]['mfu']:.3f} (PaLM convention {result[enc]['mfu_palm']:.3f}) of "
          f"{SPEC_PEAK_TFLOPS} TFLOP/s", flush=True)
    if breakdown:
      result[enc]["loss_ms"] = time_ms(jax.jit(loss_fn), params, tokens)
      result[enc]["grad_ms"] = time_ms(jax.jit(jax.value_and_grad(loss_fn)), params, tokens)
      print(f"  {enc}: forward loss {result[enc]['loss_ms']:.2f} ms, forward+backward "
            f"{result[enc]['grad_ms']:.2f} ms, optimizer {ms - result[enc]['grad_ms']:.2f} ms",
            flush=True)
    if profile:
      rows = _profiling.op_times(step, params, opt_state, tokens, iters=3)
      result[enc]["profile"] = {
          "summary": _profiling.summarize(rows, f"{preset} {enc} train step, batch {batch}",
                                           top=25),
          "ops": rows[:60]}
  result["pope_over_rope"] = result["pope"]["ms"] / result["rope"]["ms"]
  print(f"PoPE/RoPE train-step time ratio: {result['pope_over_rope']:.3f}")
  if breakdown:
    result["head_and_loss_ms"] = _head_and_loss_ms(time_ms, base, batch, seq_len, logits_dtype)
    print(f"tied head + cross-entropy alone, forward+backward: {result['head_and_loss_ms']:.2f} ms")
  return result


def _next_token_loss(logits, labels):
  """Mean cross-entropy (the training loop's) of logits [B, T, V] against int labels [B, T]."""
  from pope_jax.train import cross_entropy_with_integer_labels
  return cross_entropy_with_integer_labels(logits, labels).mean()


def _head_and_loss_ms(time_ms, cfg, batch: int, seq_len: int,
                      logits_dtype: str = "float32") -> float:
  """Forward+backward time of the model's tied head (`nn.Embed.attend` in bf16, logits then
  cast to float32 unless `logits_dtype` is "compute", as the model does) and the training
  loop's cross-entropy, on random final hidden states [batch, seq_len, d_model], isolated."""
  from flax import linen as nn
  keys = jax.random.split(jax.random.key(3), 3)
  head = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.bfloat16)
  hidden = jax.random.normal(keys[0], (batch, seq_len, cfg.d_model), jnp.bfloat16)
  params = head.init(keys[1], jnp.zeros((1,), jnp.int32))
  labels = jax.random.randint(keys[2], (batch, seq_len), 0, cfg.vocab_size)

  def loss(hidden, params):
    logits = head.apply(params, hidden, method=nn.Embed.attend)
    return _next_token_loss(logits if logits_dtype == "compute" else logits.astype(jnp.float32),
                            labels)

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  return time_ms(grad, hidden, params)
