"""Shared fixtures: the tiny transformers checkpoints and the real SmolLM2 GGUF (cached per session)."""

import os

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "llama")
TINY_MODELS = ("llama_mha_llama3", "llama_gqa_tied_linear", "qwen2_bias")


@pytest.fixture(scope="session")
def smollm2_path():
  from lpes_jax.assets import smollm2_gguf
  return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
  """(model, params, config) of SmolLM2-135M-Instruct, dequantised to float32 once per session."""
  from lpes_jax import load_pretrained
  return load_pretrained(smollm2_path, attention_implementation="xla")  # the parity reference


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
  from lpes_jax import load_tokenizer
  return load_tokenizer(smollm2_path)
