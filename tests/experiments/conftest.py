"""Fixtures shared by the command-line tests."""

import pytest

from experiments import (bench_llama, lpes_ablations, lpes_eval, lpes_generate, lpes_latency,
                         lpes_search)
from lpes_jax import moice_training


def never(*args, **kwargs):
  raise AssertionError("work started before a usage error")


@pytest.fixture
def model(tmp_path, monkeypatch):
  """A model file that exists; loading or building any model or tokenizer fails the test."""
  path = tmp_path / "model.gguf"
  path.write_bytes(b"")
  for module, name in ((lpes_search, "load_checkpoint"), (lpes_eval, "load_checkpoint"),
                       (lpes_eval, "load_tokenizer"), (moice_training, "load_checkpoint"),
                       (moice_training, "load_tokenizer"), (lpes_generate, "load_pretrained"),
                       (lpes_latency, "init_params"), (bench_llama, "init_params"),
                       (lpes_ablations, "load_model")):
    monkeypatch.setattr(module, name, never)
  return ["--model", str(path)]
