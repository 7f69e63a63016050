"""Logits parity with Hugging Face transformers (fixtures from scripts/make_llama_fixtures.py)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpes_jax import greedy_generate, load_pretrained
from tests.lpes_jax.conftest import FIXTURES, TINY_MODELS

TOL = 1e-3


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_logits_and_greedy_match_transformers(name):
  model, params, config = load_pretrained(os.path.join(FIXTURES, name),
                                         attention_implementation="xla")
  fx = np.load(os.path.join(FIXTURES, f"{name}.npz"))
  logits = model.apply({"params": params}, jnp.asarray(fx["input_ids"]),
                       attention_mask=jnp.asarray(fx["attention_mask"]))
  valid = fx["attention_mask"].astype(bool)
  err = np.abs(np.asarray(logits) - fx["logits"])[valid].max()
  assert err <= TOL, f"{name}: max |Δlogit| = {err}"
  prompts = [row[m].tolist() for row, m in zip(fx["input_ids"], valid)]
  out = greedy_generate(config, params, prompts, max_new_tokens=8, eos_ids=(), bucket=16)
  np.testing.assert_array_equal(np.array(out), fx["greedy"])


def test_smollm2_logits_match_transformers(smollm2):
  model, params, _ = smollm2
  fx = np.load(os.path.join(FIXTURES, "smollm2.npz"))
  logits = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, jnp.asarray(fx["input_ids"]))
  err = np.abs(np.asarray(logits) - fx["logits"]).max()
  assert err <= TOL, f"max |Δlogit| = {err}"
  np.testing.assert_array_equal(np.argmax(logits, -1), np.argmax(fx["logits"], -1))


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2, smollm2_tokenizer):
  _, params, config = smollm2
  tok = smollm2_tokenizer
  fx = np.load(os.path.join(FIXTURES, "smollm2.npz"))
  ids = tok.encode("The capital of France is")
  assert ids == fx["input_ids"][0].tolist()
  out = greedy_generate(config, params, [ids], max_new_tokens=4, eos_ids=tok.eos_ids)[0]
  assert out == fx["greedy"][0, :4].tolist()
  assert tok.decode(out).startswith(" Paris")


def test_smollm2_tokenizer_matches_transformers(smollm2_tokenizer):
  tok = smollm2_tokenizer
  fx = np.load(os.path.join(FIXTURES, "smollm2.npz"))
  for i, text in enumerate(json.loads(str(fx["sample_texts"]))):
    assert tok.encode(text) == fx[f"text_{i}"].tolist(), text
  chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
  assert chat == str(fx["chat"])
