"""Small vocabularies and GGUF files built in the tests, the way the real tools write them.

* `train_sentencepiece`: a SentencePiece BPE model with Llama-2's trainer settings (identity
  normalisation, byte fallback, split digits, whitespace-only pieces, "▁" prefix).
* `train_byte_level_bpe`: a byte-level BPE `tokenizers.Tokenizer` with Qwen2's (or Llama-3's)
  tokenizer.json pre-tokeniser and Qwen2's special tokens; its ids are the reference.
* `write_gguf`: a tiny random-weight Llama-family GGUF with a given vocabulary, written with the
  `gguf` package's GGUFWriter as llama.cpp's converter lays it out.
"""

import io
import json
import random

import gguf
import gguf.quants
import numpy as np
import sentencepiece as spm
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers


WORDS = ("the quick brown fox jumps over a lazy dog while the model reads long prompts and "
          "answers questions about retrieval keys values llama vicuna chat café naïve Zürich "
          "élève façade über straße année привет мир").split()
SPM_USER_DEFINED, SPM_CONTROL = "<tool>", "<|sep|>"
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def corpus(seed: int = 0, lines: int = 300) -> list[str]:
  """A few KB of sentences with words, accents, Cyrillic and numbers."""
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
          + f" {rng.randint(0, 99999)}." for _ in range(lines)]


def train_sentencepiece(vocab_size: int = 400, **overrides) -> bytes:
  """A serialized SentencePiece BPE ModelProto trained on `corpus()`: ids 0 <unk>, 1 <s>, 2 </s>,
  then the control piece `SPM_CONTROL`, the user-defined piece `SPM_USER_DEFINED`, 256 byte
  pieces and the learnt pieces."""
  buf = io.BytesIO()
  options = dict(model_type="bpe", vocab_size=vocab_size, byte_fallback=True,
                 normalization_rule_name="identity", remove_extra_whitespaces=False,
                 split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
                 add_dummy_prefix=True, control_symbols=[SPM_CONTROL],
                 user_defined_symbols=[SPM_USER_DEFINED], minloglevel=2)
  spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=buf,
                                 **(options | overrides))
  return buf.getvalue()


def sentencepiece_vocabulary(model: bytes) -> dict:
  """GGUF tokenizer metadata of a SentencePiece model, as llama.cpp's converter writes it
  (pieces, scores, token types; no add-BOS key: Llama-2 style)."""
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(model)
  return dict(model="llama", tokens=[p.piece for p in proto.pieces],
              scores=[p.score for p in proto.pieces], types=[p.type for p in proto.pieces],
              bos=proto.trainer_spec.bos_id, eos=proto.trainer_spec.eos_id,
              unk=proto.trainer_spec.unk_id)


# The split patterns as the models' tokenizer.json files write them.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                 r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                  r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_byte_level_bpe(vocab_size: int = 400, pattern: str = QWEN2_PATTERN) -> tokenizers.Tokenizer:
  """A byte-level BPE with Qwen2's pre-tokeniser (regex split, then bytes) and special tokens
  (`pattern=LLAMA3_PATTERN`: Llama-3's pre-tokeniser)."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(QWEN2_SPECIALS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(corpus(seed=1), trainer=trainer)
  return tok


def bpe_vocabulary(tok: tokenizers.Tokenizer, pre: str | None) -> dict:
  """GGUF tokenizer metadata of a byte-level BPE tokenizer (tokens, merges, control types)."""
  state = json.loads(tok.to_str())
  vocab = state["model"]["vocab"]
  tokens = sorted(vocab, key=vocab.get)
  assert [vocab[t] for t in tokens] == list(range(len(tokens)))
  merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
  specials = {t["content"] for t in state["added_tokens"] if t["special"]}
  return dict(model="gpt2", pre=pre, tokens=tokens, merges=merges,
              types=[3 if t in specials else 1 for t in tokens])


def write_gguf(path, arch: str, vocab: dict, *, keys: dict | None = None, seed: int = 0,
               biases: bool = False, qtype: str = "F32") -> None:
  """A random-weight GGUF: 2 layers, D 32, N 4, K 2, H 8, F 64, V = len(vocab["tokens"]).

  Args:
    path: the file to write.
    arch: general.architecture (llama, qwen2, ...).
    vocab: from `sentencepiece_vocabulary` or `bpe_vocabulary`; its "bos"/"eos"/"unk" entries
      become token-id keys, and nothing is written for add_bos_token.
    keys: extra tokenizer keys, e.g. {"add_bos_token": False, "bos_token_id": 3}.
    seed: weights' seed.
    biases: write q/k/v and output biases (qwen2 always has q/k/v biases).
    qtype: the GGML type of the matrices (quantised with `gguf.quants.quantize`); norms and
      biases stay F32.
  """
  rng = np.random.default_rng(seed)
  v, d, n, k, h, f, layers = len(vocab["tokens"]), 32, 4, 2, 8, 64, 2
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(layers)
  w.add_context_length(256)
  w.add_embedding_length(d)
  w.add_feed_forward_length(f)
  w.add_head_count(n)
  w.add_head_count_kv(k)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model(vocab["model"])
  if vocab.get("pre"):
    w.add_tokenizer_pre(vocab["pre"])
  w.add_token_list(vocab["tokens"])
  w.add_token_types(vocab["types"])
  if "scores" in vocab:
    w.add_token_scores(vocab["scores"])
  if "merges" in vocab:
    w.add_token_merges(vocab["merges"])
  for name in ("bos", "eos", "unk"):
    if vocab.get(name) is not None:
      getattr(w, f"add_{name}_token_id")(vocab[name])
  for key, value in (keys or {}).items():
    getattr(w, f"add_{key}")(value)
  normal = lambda *shape: (rng.normal(size=shape) * 0.2).astype(np.float32)
  quant = gguf.GGMLQuantizationType[qtype]

  def matrix(name, *shape):
    x = normal(*shape)
    if qtype == "F32":
      w.add_tensor(name, x)
    else:
      w.add_tensor(name, gguf.quants.quantize(x, quant), raw_dtype=quant)

  matrix("token_embd.weight", v, d)
  w.add_tensor("output_norm.weight", np.ones(d, np.float32))
  matrix("output.weight", v, d)
  for i in range(layers):
    b = f"blk.{i}"
    for name, shape in (("attn_norm", (d,)), ("ffn_norm", (d,))):
      w.add_tensor(f"{b}.{name}.weight", np.ones(shape, np.float32))
    for name, shape in (("attn_q", (n * h, d)), ("attn_k", (k * h, d)), ("attn_v", (k * h, d)),
                        ("attn_output", (d, n * h)), ("ffn_gate", (f, d)), ("ffn_up", (f, d)),
                        ("ffn_down", (d, f))):
      matrix(f"{b}.{name}.weight", *shape)
      if ((biases or arch == "qwen2") and name in ("attn_q", "attn_k", "attn_v")
          or biases and name == "attn_output"):
        w.add_tensor(f"{b}.{name}.bias", normal(shape[0]))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
