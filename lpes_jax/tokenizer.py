"""Tokenizers for Llama-family checkpoints, built with the `tokenizers` library.

`load_tokenizer(path)` reads
  * a Hugging Face folder: `tokenizer.json`, or only a SentencePiece `tokenizer.model` (older
    Llama-2 / Vicuna uploads), with `tokenizer_config.json` for BOS/EOS and the chat template;
  * a GGUF file: its `tokenizer.ggml.*` vocabulary, either SentencePiece (`model = "llama"`:
    Llama-2, Vicuna, Mistral, TinyLlama) or GPT-2-style byte-level BPE (`model = "gpt2"`: Llama-3,
    Qwen2, SmolLM), with llama.cpp's defaults where the file is silent.
SentencePiece BPE vocabularies become a `tokenizers` BPE whose merges are ordered by the merged
piece's score, with byte fallback (`<0x..>` pieces), as transformers' `LlamaConverter` /
`GGUFLlamaConverter` build them. BOS is added exactly once according to the checkpoint's add-BOS
setting (never a second time when the text, e.g. a rendered chat template, already starts with
it). Special (control) and user-defined tokens written in the text are matched as whole tokens.
Chat templates are rendered with jinja2 in a sandbox, like transformers' `apply_chat_template`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Any, Sequence

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from pope_jax import checks

# llama.cpp pre-tokeniser names (tokenizer.ggml.pre) → the splitting regex of the original tokenizer.
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                   r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
                  r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe")
GGUF_PRE_TOKENIZERS = ("default", "gpt2", "gpt-2", "smollm", *_LLAMA3_NAMES, "qwen2")
GGUF_VOCABULARIES = ("llama", "gpt2")   # tokenizer.ggml.model: SentencePiece, byte-level BPE.
# Token types: llama.cpp's llama_token_type, the numbering of sentencepiece's
# ModelProto.SentencePiece.Type (0 is llama.cpp's "undefined").
_UNDEFINED, _NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = range(7)
_SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space inside pieces.


def llama_cpp_defaults(model: str, pre: str | None) -> tuple[bool, int, int]:
  """(add_bos, bos_id, eos_id) that llama.cpp assumes when a GGUF file has no
  `tokenizer.ggml.add_bos_token` / `bos_token_id` / `eos_token_id` key.

  The rule of `llama_vocab::impl::load` (llama.cpp, src/llama-vocab.cpp):
    * SentencePiece (`model = "llama"`): BOS is added; BOS id 1, EOS id 2.
    * Byte-level BPE (`model = "gpt2"`): BOS id 11, EOS id 11; BOS is added only for the
      Llama-3 pre-tokenisers (`pre` = llama3, llama-v3, llama-bpe), not for qwen2, smollm,
      gpt-2, default or a missing `pre`.

  Args:
    model: `tokenizer.ggml.model`, one of GGUF_VOCABULARIES.
    pre: `tokenizer.ggml.pre`, or None when absent.
  """
  if model == "llama":
    return True, 1, 2
  return pre in _LLAMA3_NAMES, 11, 11


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  if pre in ("default", "gpt2", "gpt-2"):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":  # Digits one by one, then GPT-2 splitting (SmolLM's tokenizer.json).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=True)])
  pattern = _QWEN2_PATTERN if pre == "qwen2" else _LLAMA3_PATTERN
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False), byte_level])


def _score_ordered_merges(pieces: Sequence[str], scores: Sequence[float],
                          types: Sequence[int]) -> list[tuple[str, str]]:
  """BPE merges of a SentencePiece vocabulary: every split (left, right) of a normal piece into
  two pieces, ordered by the merged piece's score, highest first (ties: vocabulary order).

  Merging the best-ranked pair first is SentencePiece BPE's rule, and llama.cpp's
  (`llm_tokenizer_spm_session`): repeatedly join the adjacent pair whose join is the
  highest-scoring piece. transformers' `SentencePieceExtractor` builds the same list.
  """
  ids: dict[str, int] = {}
  for i, piece in enumerate(pieces):
    ids.setdefault(piece, i)
  ranked = []
  for i, piece in enumerate(pieces):
    if types[i] not in (_UNDEFINED, _NORMAL):
      continue
    splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))
              if piece[:k] in ids and piece[k:] in ids]
    splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
    ranked += [(-float(scores[i]), pair) for pair in splits]
  ranked.sort(key=lambda item: item[0])   # Stable: equal scores keep vocabulary order.
  return [pair for _, pair in ranked]


def _sentencepiece_bpe(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                       unk_id: int | None, add_space_prefix: bool,
                       prefix_every_segment: bool = True) -> tokenizers.Tokenizer:
  """A SentencePiece BPE vocabulary as a `tokenizers.Tokenizer` (transformers' `LlamaConverter`).

  Spaces become "▁"; a "▁" is put before the text when `add_space_prefix` (SentencePiece's
  add_dummy_prefix); characters that are no piece fall back to their UTF-8 bytes' `<0xXX>`
  pieces, else to the unknown piece. Control pieces (type 3) are special tokens and user-defined
  pieces (type 4) added tokens, both matched whole in the text.

  Args:
    pieces, scores, types: the vocabulary (id order), its scores and token types.
    unk_id: the unknown piece, or None.
    add_space_prefix: prefix the text with "▁".
    prefix_every_segment: also after each special or user-defined token in the text, as llama.cpp
      (`llama_vocab::impl::tokenize`, SPM: "prefix with space if previous is special") and
      transformers' legacy Llama tokenizer do; False: no prefix here, `Tokenizer.space_prefix`
      puts it at the start of the text only (transformers' `legacy=False`).
  """
  backend = tokenizers.Tokenizer(models.BPE(
      vocab={piece: i for i, piece in reversed(list(enumerate(pieces)))},
      merges=_score_ordered_merges(pieces, scores, types),
      unk_token=None if unk_id is None else pieces[unk_id], fuse_unk=True, byte_fallback=True))
  backend.normalizer = normalizers.Sequence(
      ([normalizers.Prepend(_SPACE)] if add_space_prefix and prefix_every_segment else [])
      + [normalizers.Replace(" ", _SPACE)])
  backend.decoder = decoders.Sequence(
      [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
      + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
  _add_special_tokens(backend, pieces, types)
  return backend


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str],
                        types: Sequence[int]) -> None:
  """Control tokens as special tokens, user-defined tokens as added tokens (matched whole)."""
  backend.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                              for i, t in enumerate(types) if t == _CONTROL])
  backend.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                      for i, t in enumerate(types) if t == _USER_DEFINED])


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
    space_prefix: prepend a space to the text before encoding, dropping the lone "▁" it gives
      before a special token (SentencePiece with transformers' `legacy=False`: "▁" at the start
      of the text only).
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
  space_prefix: bool = False

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text`; BOS prepended once if `add_bos` (default: the checkpoint's setting).

    Raises:
      ValueError: an id outside [0, model_vocab_size), when that is known.
    """
    if self.space_prefix and text:
      ids = self.backend.encode(" " + text, add_special_tokens=False).ids
      special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
      if len(ids) > 1 and ids[0] == self.backend.token_to_id(_SPACE) and ids[1] in special:
        ids = ids[1:]
    else:
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


def _sentencepiece_model(path: str, *, legacy: bool) -> tuple[tokenizers.Tokenizer, Any]:
  """A SentencePiece `tokenizer.model` (protobuf, read with sentencepiece's own schema) as a
  `tokenizers.Tokenizer`; also the parsed model (its trainer_spec names BOS/EOS ids).

  Raises:
    ValueError: not a SentencePiece model; a model type other than BPE (Llama, Mistral and Vicuna
      use BPE); a normalizer other than identity without extra-whitespace removal.
  """
  from sentencepiece import sentencepiece_model_pb2  # Only tokenizer.model folders need it.
  proto = sentencepiece_model_pb2.ModelProto()
  try:
    with open(path, "rb") as fh:
      proto.ParseFromString(fh.read())
  except Exception as e:  # protobuf's DecodeError.
    raise ValueError(f"{path}: not a SentencePiece model ({e})") from None
  if not proto.pieces:
    raise ValueError(f"{path}: not a SentencePiece model (no pieces)")
  spec = proto.trainer_spec
  if spec.model_type != spec.BPE:
    raise ValueError(f"{path}: SentencePiece model_type "
                     f"{spec.ModelType.Name(spec.model_type)} is not supported (only BPE)")
  norm = proto.normalizer_spec
  if norm.precompiled_charsmap or norm.remove_extra_whitespaces:
    raise ValueError(f"{path}: SentencePiece normalizer {norm.name!r} (remove_extra_whitespaces="
                     f"{norm.remove_extra_whitespaces}) is not supported (only identity, as "
                     f"Llama's tokenizer.model uses)")
  types = [p.type for p in proto.pieces]
  backend = _sentencepiece_bpe(
      [p.piece for p in proto.pieces], [p.score for p in proto.pieces], types,
      unk_id=spec.unk_id if 0 <= spec.unk_id < len(types) else None,
      add_space_prefix=norm.add_dummy_prefix, prefix_every_segment=legacy)
  return backend, proto


def load_hf_tokenizer(folder: str) -> Tokenizer:
  """From `tokenizer.json`, or else a SentencePiece `tokenizer.model`, plus
  `tokenizer_config.json` and `chat_template.jinja` when present.

  add_bos: `add_bos_token` from tokenizer_config.json if set; else, with tokenizer.json, whether
  its post-processor adds BOS, and with tokenizer.model True (transformers' `LlamaTokenizer`
  default). With tokenizer.model, BOS/EOS tokens not named in tokenizer_config.json are the
  model's own (trainer_spec bos_id / eos_id), and `"legacy": false` puts "▁" only at the start of
  the text, not after special tokens (transformers' `LlamaTokenizer(legacy=False)`).

  Raises:
    FileNotFoundError: neither tokenizer.json nor tokenizer.model.
    ValueError: a tokenizer.model that does not load (see `_sentencepiece_model`); a BOS/EOS
      token that is not in the vocabulary.
  """
  cfg: dict[str, Any] = {}
  cfg_path = os.path.join(folder, "tokenizer_config.json")
  if os.path.exists(cfg_path):
    with open(cfg_path) as fh:
      cfg = json.load(fh)
  json_path, spm_path = (os.path.join(folder, n) for n in ("tokenizer.json", "tokenizer.model"))
  bos_token = _special_token_string(cfg.get("bos_token"))
  eos_token = _special_token_string(cfg.get("eos_token"))
  space_prefix = False
  if os.path.exists(json_path):
    backend = tokenizers.Tokenizer.from_file(json_path)
  elif os.path.exists(spm_path):
    legacy = bool(cfg.get("legacy", True))
    backend, proto = _sentencepiece_model(spm_path, legacy=legacy)
    space_prefix = not legacy and proto.normalizer_spec.add_dummy_prefix
    piece = lambda i: proto.pieces[i].piece if 0 <= i < len(proto.pieces) else None
    bos_token = piece(proto.trainer_spec.bos_id) if bos_token is None else bos_token
    eos_token = piece(proto.trainer_spec.eos_id) if eos_token is None else eos_token
    cfg.setdefault("add_bos_token", True)
  else:
    raise FileNotFoundError(f"{folder}: missing tokenizer.json (or a SentencePiece "
                            f"tokenizer.model)")
  template = cfg.get("chat_template")
  jinja_path = os.path.join(folder, "chat_template.jinja")
  if template is None and os.path.exists(jinja_path):
    with open(jinja_path) as fh:
      template = fh.read()
  if isinstance(template, list):  # [{"name": ..., "template": ...}]: take the default one.
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  pad_token = _special_token_string(cfg.get("pad_token"))
  bos_id = None if bos_token is None else backend.token_to_id(bos_token)
  eos_id = None if eos_token is None else backend.token_to_id(eos_token)
  for name, token, token_id in (("bos_token", bos_token, bos_id), ("eos_token", eos_token, eos_id)):
    if token is not None and token_id is None:
      raise ValueError(f"{cfg_path}: {name} {token!r} is not in the vocabulary")
  if "add_bos_token" in cfg:
    add_bos = bool(cfg["add_bos_token"])
  else:
    probe = backend.encode("a", add_special_tokens=True).ids
    add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
  return Tokenizer(backend=backend, bos_id=bos_id, eos_ids=() if eos_id is None else (eos_id,),
                   pad_id=None if pad_token is None else backend.token_to_id(pad_token),
                   add_bos=add_bos, chat_template=template, bos_token=bos_token,
                   eos_token=eos_token, space_prefix=space_prefix)


def load_gguf_tokenizer(path: str) -> Tokenizer:
  """The tokenizer of a GGUF file, rebuilt from its tokenizer.ggml.* metadata.

  `model = "llama"`: SentencePiece BPE (`_sentencepiece_bpe`, from tokens, scores and token
  types; "▁" prefix per `add_space_prefix`, default true). `model = "gpt2"`: byte-level BPE from
  tokens and merges, split by the `pre` tokeniser's regex. Keys the file lacks (add_bos_token,
  bos/eos_token_id) take llama.cpp's defaults (`llama_cpp_defaults`).

  Raises:
    ValueError: a tokenizer model other than GGUF_VOCABULARIES, a pre-tokeniser other than
      GGUF_PRE_TOKENIZERS, a missing token list, scores (SentencePiece) or merges (BPE), or a
      BOS/EOS id outside the vocabulary.
  """
  from lpes_jax.checkpoints import _open_gguf  # One place that opens GGUF files.
  reader = _open_gguf(path)
  field = lambda key, default=None: (reader.fields[key].contents() if key in reader.fields
                                     else default)

  def required(key):
    if key not in reader.fields:
      raise ValueError(f"{path}: missing tokenizer metadata key {key!r}")
    return field(key)

  kind = field("tokenizer.ggml.model")
  if kind not in GGUF_VOCABULARIES:
    raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: "
                     f"{GGUF_VOCABULARIES}")
  pre = field("tokenizer.ggml.pre")
  tokens = required("tokenizer.ggml.tokens")
  types = field("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
  if kind == "llama":
    unk_id = field("tokenizer.ggml.unknown_token_id", 0)
    backend = _sentencepiece_bpe(tokens, required("tokenizer.ggml.scores"), types,
                                 unk_id=unk_id if 0 <= unk_id < len(tokens) else None,
                                 add_space_prefix=bool(field("tokenizer.ggml.add_space_prefix",
                                                             True)))
  else:
    if (pre or "default") not in GGUF_PRE_TOKENIZERS:
      raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; supported: "
                       f"{GGUF_PRE_TOKENIZERS}")
    merges = [tuple(m.split(" ", 1)) for m in required("tokenizer.ggml.merges")]
    backend = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                              merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre or "default")
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, types)
  add_bos, default_bos, default_eos = llama_cpp_defaults(kind, pre)

  def special_id(key: str, default: int) -> int | None:
    """The key's id; a default outside the vocabulary means none (an explicit one is an error)."""
    if key not in reader.fields:
      return default if default < len(tokens) else None
    value = int(field(key))
    if not 0 <= value < len(tokens):
      raise ValueError(f"{path}: {key} {value} is outside the vocabulary [0, {len(tokens)})")
    return value

  bos_id = special_id("tokenizer.ggml.bos_token_id", default_bos)
  eos_id = special_id("tokenizer.ggml.eos_token_id", default_eos)
  return Tokenizer(
      backend=backend, bos_id=bos_id, eos_ids=() if eos_id is None else (int(eos_id),),
      pad_id=field("tokenizer.ggml.padding_token_id"),
      add_bos=bool(field("tokenizer.ggml.add_bos_token", add_bos)),
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
