"""Tokenizers for Llama-family checkpoints, built with the `tokenizers` library.

`load_tokenizer(path)` reads a Hugging Face folder (`tokenizer.json` + `tokenizer_config.json`) or
a GGUF file (GPT-2-style byte-level BPE rebuilt from the file's own vocab, merges and
pre-tokeniser name). BOS is added exactly once according to the checkpoint's add-BOS setting (never
a second time when the text, e.g. a rendered chat template, already starts with it). Chat templates
are rendered with jinja2 in a sandbox, like transformers' `apply_chat_template`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Any, Sequence

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from pope_jax import checks

# llama.cpp pre-tokeniser names (tokenizer.ggml.pre) → the splitting regex of the original tokenizer.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                   r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
                  r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "qwen2")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types.


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  if pre in ("default", "gpt2"):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":  # Digits one by one, then GPT-2 splitting (SmolLM's tokenizer.json).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=True)])
  pattern = _QWEN2_PATTERN if pre == "qwen2" else _LLAMA3_PATTERN
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False), byte_level])


@dataclasses.dataclass
class Tokenizer:
  """A `tokenizers.Tokenizer` plus the checkpoint's special-token settings.

  Attributes:
    backend: the `tokenizers.Tokenizer` (encodes without adding special tokens itself).
    bos_id, eos_ids, pad_id: special ids (bos/pad may be None).
    add_bos: whether `encode` prepends BOS by default.
    chat_template: jinja2 source, or None.
    bos_token, eos_token: their strings (for chat templates).
    model_vocab_size: the model's vocabulary size V when known; `encode` then checks its ids
      against it (a tokenizer larger than the model's embedding, or a stray BOS id, fails there
      rather than as NaN logits).
  """
  backend: tokenizers.Tokenizer
  bos_id: int | None
  eos_ids: tuple[int, ...]
  pad_id: int | None
  add_bos: bool
  chat_template: str | None = None
  bos_token: str | None = None
  eos_token: str | None = None
  model_vocab_size: int | None = None

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text`; BOS prepended once if `add_bos` (default: the checkpoint's setting).

    Raises:
      ValueError: an id outside [0, model_vocab_size), when that is known.
    """
    ids = self.backend.encode(text, add_special_tokens=False).ids
    add_bos = self.add_bos if add_bos is None else add_bos
    if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
      ids = [self.bos_id] + ids
    if self.model_vocab_size is not None:
      checks.check_token_ids(ids, self.model_vocab_size, argument="the encoded ids")
    return ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, str]], *,
                          add_generation_prompt: bool = True) -> str:
    """Renders `messages` ([{"role", "content"}]) with the checkpoint's jinja2 chat template.

    Raises:
      ValueError: the checkpoint has no chat template.
    """
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template")
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # Only chat needs jinja2.

    def raise_exception(message):
      raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "")

  def encode_chat(self, messages: list[dict[str, str]], *,
                  add_generation_prompt: bool = True) -> list[int]:
    """Chat-template ids; BOS once (kept if the template renders it, else per add_bos)."""
    return self.encode(self.apply_chat_template(messages,
                                                add_generation_prompt=add_generation_prompt))


def _special_token_string(value: Any) -> str | None:
  if isinstance(value, dict):
    return value.get("content")
  return value


def load_hf_tokenizer(folder: str) -> Tokenizer:
  """From `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja` when present).

  add_bos: `add_bos_token` from tokenizer_config.json if set, else whether the tokenizer's own
  post-processor adds BOS.

  Raises:
    FileNotFoundError: no tokenizer.json.
  """
  path = os.path.join(folder, "tokenizer.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{folder}: missing tokenizer.json")
  backend = tokenizers.Tokenizer.from_file(path)
  cfg: dict[str, Any] = {}
  cfg_path = os.path.join(folder, "tokenizer_config.json")
  if os.path.exists(cfg_path):
    with open(cfg_path) as fh:
      cfg = json.load(fh)
  template = cfg.get("chat_template")
  jinja_path = os.path.join(folder, "chat_template.jinja")
  if template is None and os.path.exists(jinja_path):
    with open(jinja_path) as fh:
      template = fh.read()
  if isinstance(template, list):  # [{"name": ..., "template": ...}]: take the default one.
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  bos_token = _special_token_string(cfg.get("bos_token"))
  eos_token = _special_token_string(cfg.get("eos_token"))
  pad_token = _special_token_string(cfg.get("pad_token"))
  bos_id = None if bos_token is None else backend.token_to_id(bos_token)
  eos_id = None if eos_token is None else backend.token_to_id(eos_token)
  if "add_bos_token" in cfg:
    add_bos = bool(cfg["add_bos_token"])
  else:
    probe = backend.encode("a", add_special_tokens=True).ids
    add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
  return Tokenizer(backend=backend, bos_id=bos_id, eos_ids=() if eos_id is None else (eos_id,),
                   pad_id=None if pad_token is None else backend.token_to_id(pad_token),
                   add_bos=add_bos, chat_template=template, bos_token=bos_token,
                   eos_token=eos_token)


def load_gguf_tokenizer(path: str) -> Tokenizer:
  """A byte-level BPE tokenizer rebuilt from a GGUF file's tokenizer.ggml.* metadata.

  Raises:
    ValueError: tokenizer model other than "gpt2" (e.g. SentencePiece "llama"), or an unknown
      pre-tokeniser name.
  """
  from lpes_jax.checkpoints import _open_gguf  # One place that opens GGUF files.
  reader = _open_gguf(path)
  field = lambda key, default=None: (reader.fields[key].contents() if key in reader.fields
                                     else default)
  kind = field("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' "
                     f"byte-level BPE)")
  pre = field("tokenizer.ggml.pre", "default")
  if pre not in GGUF_PRE_TOKENIZERS:
    raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; supported: "
                     f"{GGUF_PRE_TOKENIZERS}")
  tokens = field("tokenizer.ggml.tokens")
  merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
  types = field("tokenizer.ggml.token_type", [1] * len(tokens))
  backend = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                            merges=merges, fuse_unk=False, byte_fallback=False))
  backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                              for i, t in enumerate(types) if t == _CONTROL])
  backend.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                      for i, t in enumerate(types) if t == _USER_DEFINED])
  bos_id = field("tokenizer.ggml.bos_token_id")
  eos_id = field("tokenizer.ggml.eos_token_id")
  return Tokenizer(
      backend=backend, bos_id=bos_id, eos_ids=() if eos_id is None else (int(eos_id),),
      pad_id=field("tokenizer.ggml.padding_token_id"),
      add_bos=bool(field("tokenizer.ggml.add_bos_token", True)),
      chat_template=field("tokenizer.chat_template"),
      bos_token=None if bos_id is None else tokens[bos_id],
      eos_token=None if eos_id is None else tokens[eos_id])


def load_tokenizer(path: str, *, model_vocab_size: int | None = None) -> Tokenizer:
  """Tokenizer of a Hugging Face folder or a .gguf file (see module docstring).

  Args:
    path: the folder or file.
    model_vocab_size: the model's vocabulary size V, when known (`Tokenizer.model_vocab_size`).
  """
  tok = load_hf_tokenizer(path) if os.path.isdir(path) else load_gguf_tokenizer(path)
  return dataclasses.replace(tok, model_vocab_size=model_vocab_size)


def byte_tokenizer() -> Tokenizer:
  """A byte-level tokenizer without merges, for random-weight test models: ids 0–255 are the
  bytes (GPT-2's byte-to-character alphabet, sorted), 256 is BOS `<s>` (added once), 257 is EOS
  `</s>`; 258 ids in all."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)},
                                            merges=[], fuse_unk=False))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                              for t in ("<s>", "</s>")])
  return Tokenizer(backend=backend, bos_id=256, eos_ids=(257,), pad_id=None, add_bos=True,
                   bos_token="<s>", eos_token="</s>", model_vocab_size=258)
