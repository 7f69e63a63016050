"""The LPES fitness on the fused path (cuDNN) of a Hopper GPU against the reference ("xla"), on the
real SmolLM2 KV search set in bfloat16.

    python -m pytest -m gpu -n 0 tests/gpu/test_lpes_fitness.py
"""

import dataclasses

import jax
import numpy as np
import pytest

from lpes_jax import evaluate, fitness
from lpes_jax.tasks.task import TaskConfig

pytestmark = [pytest.mark.gpu]

_device = jax.devices()[0]
if not (_device.platform == "gpu"
        and str(getattr(_device, "compute_capability", "")).startswith("9.")):
  pytest.skip(f"needs an NVIDIA Hopper GPU, not {_device.device_kind}", allow_module_level=True)


@pytest.fixture(scope="module")
def search_set():
  from lpes_jax import load_pretrained, load_tokenizer
  from lpes_jax.assets import smollm2_gguf
  try:
    path = smollm2_gguf()
  except RuntimeError as e:                      # No cached GGUF and no network.
    pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
  _, params, config = load_pretrained(path, dtype="bfloat16")
  task = TaskConfig(task="kv", num_pairs=6, key_length=4, value_length=4)
  batch = evaluate.search_batch(task, load_tokenizer(path), config, num_examples=60, seed=0)
  L = config.num_layers
  mults = np.stack([np.ones(L), 1 / np.linspace(1.3, 1.0, L), np.full(L, 1 / 1.1),
                    1 / np.linspace(1.0, 1.5, L)]).astype(np.float32)
  return config, params, batch, mults


def test_fused_fitness_runs_cudnn_and_differs_only_on_near_ties(search_set):
  config, params, batch, mults = search_set
  tokens, at, targets, tmask = fitness.teacher_forced_inputs(batch)
  logits, hlo = {}, {}
  for impl in ("xla", "cudnn"):                  # "cudnn" named: raises unless the call is plain
    forward = fitness.llama_fitness_fns(dataclasses.replace(
        config, attention_implementation=impl))[0]
    run = jax.jit(jax.vmap(forward, in_axes=(None, None, 0, None)))    # candidates vmapped
    hlo[impl] = run.lower(params, tokens, mults, at).compile().as_text()
    logits[impl] = np.asarray(run(params, tokens, mults, at))           # [P, E, W, V]
  assert "__cudnn$fmha" in hlo["cudnn"] and "__cudnn$fmha" not in hlo["xla"]
  hits = {k: np.all((v.argmax(-1) == targets) | ~tmask, -1) for k, v in logits.items()}
  ref = np.sort(logits["xla"], -1)
  margin = np.where(tmask, ref[..., -1] - ref[..., -2], np.inf).min(-1)
  differ = hits["xla"] != hits["cudnn"]
  assert hits["xla"].sum() > 0
  assert np.all(margin[differ] < 0.25), (margin[differ], differ.sum())
  # The population function (implementation None, examples in chunks) counts the same, up to the
  # near-ties (another batch size may round the matmuls differently).
  counts = fitness.make_fitness_fn(params, batch, forward=fitness.llama_fitness_fns(
      dataclasses.replace(config, attention_implementation=None))[0], example_batch=30)(mults)
  per_subset = np.stack([np.bincount(batch.subset[h], minlength=3) for h in hits["cudnn"]])
  off = np.abs(np.rint(counts * np.bincount(batch.subset)) - per_subset).sum()
  assert off <= (margin < 0.25).sum(), off
