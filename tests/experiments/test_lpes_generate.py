"""experiments.lpes_generate end to end on tiny random-weight GGUF files: a Llama-2-style
SentencePiece vocabulary (no add-BOS key) and a Qwen2 byte-level BPE."""

import os
import subprocess
import sys

import pytest

from experiments import lpes_generate
from lpes_jax import greedy_generate, load_pretrained, load_tokenizer
from tests.lpes_jax import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "The quick brown fox 42"


@pytest.fixture(scope="module", params=["llama2", "qwen2"])
def gguf_file(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
  if request.param == "llama2":
    vocab = synthetic.sentencepiece_vocabulary(synthetic.train_sentencepiece())
    synthetic.write_gguf(path, "llama", vocab)
  else:
    vocab = synthetic.bpe_vocabulary(synthetic.train_byte_level_bpe(), "qwen2")
    synthetic.write_gguf(path, "qwen2", vocab)
  return request.param, str(path)


def _expected(path, max_new_tokens):
  """The continuation computed with the library directly."""
  _, params, config = load_pretrained(path)
  tok = load_tokenizer(path)
  ids = tok.encode(PROMPT)
  out = greedy_generate(config, params, [ids], max_new_tokens=max_new_tokens,
                        eos_ids=tuple(dict.fromkeys(config.eos_token_ids + tok.eos_ids)))[0]
  return ids, tok.decode(out)


def test_generates_from_a_synthetic_gguf(gguf_file, capsys):
  name, path = gguf_file
  ids, expected = _expected(path, 3)
  assert (ids[0] == 1) == (name == "llama2")          # SentencePiece adds BOS, Qwen2 does not.
  lpes_generate.main(["--model", path, "--prompt", PROMPT, "--max-new-tokens", "3"])
  assert capsys.readouterr().out == expected + "\n"


@pytest.mark.slow
def test_python_m_lpes_generate(gguf_file):
  _, path = gguf_file
  result = subprocess.run([sys.executable, "-m", "experiments.lpes_generate", "--model", path,
                           "--prompt", PROMPT, "--max-new-tokens", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  assert result.stdout == _expected(path, 5)[1] + "\n"
