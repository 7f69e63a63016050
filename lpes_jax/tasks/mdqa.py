"""Multi-document question answering in the "Lost in the Middle" format (Liu et al., 2023, §2).

Reads the LitM data files (JSON lines, optionally gzipped): each line holds `question`, `answers`
(list of strings) and `ctxs` (list of {`title`, `text`, `hasanswer`, `isgold`}), exactly one of
which is the gold document. The gold document can be moved to any index, distractors keeping their
order, as LitM's `get_qa_prompt` experiments do. The prompt is LitM's `qa.prompt`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os

from lpes_jax.tasks.kv_retrieval import check_gold_index

QA_INSTRUCTION = ("Write a high-quality answer for the given question using only the provided "
                  "search results (some of which might be irrelevant).")
_CTX_FIELDS = ("title", "text", "isgold")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Document:
  title: str
  text: str
  isgold: bool
  hasanswer: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class MDQAExample:
  """One question with its retrieved documents in prompt order.

  Attributes:
    question: the NQ-open question.
    answers: acceptable gold answers.
    documents: documents in prompt order.
  """
  question: str
  answers: tuple[str, ...]
  documents: tuple[Document, ...]

  @property
  def gold_index(self) -> int:
    return next(i for i, d in enumerate(self.documents) if d.isgold)

  @property
  def prompt(self) -> str:
    return mdqa_prompt(self.question, self.documents)

  def with_gold_at(self, gold_index: int) -> MDQAExample:
    """The same example with the gold document moved to `gold_index` (others keep their order).

    Raises:
      ValueError: gold_index outside [0, number of documents).
    """
    check_gold_index(gold_index, len(self.documents))
    gold = self.documents[self.gold_index]
    others = [d for i, d in enumerate(self.documents) if i != self.gold_index]
    docs = others[:gold_index] + [gold] + others[gold_index:]
    return dataclasses.replace(self, documents=tuple(docs))


def mdqa_prompt(question: str, documents) -> str:
  """The LitM multi-document QA prompt: instruction, blank line, `Document [i](Title: t) text`
  per line (i from 1), blank line, `Question: q`, `Answer:`."""
  docs = "\n".join(f"Document [{i}](Title: {d.title}) {d.text}" for i, d in enumerate(documents, 1))
  return f"{QA_INSTRUCTION}\n\n{docs}\n\nQuestion: {question}\nAnswer:"


def _parse_line(record, where: str) -> MDQAExample:
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  for name in ("question", "answers", "ctxs"):
    if name not in record:
      raise ValueError(f"{where}: missing field {name!r}")
  answers = record["answers"]
  if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers) or not answers:
    raise ValueError(f"{where}: 'answers' must be a non-empty list of strings")
  if not isinstance(record["ctxs"], list) or not record["ctxs"]:
    raise ValueError(f"{where}: 'ctxs' must be a non-empty list")
  docs = []
  for j, ctx in enumerate(record["ctxs"]):
    if not isinstance(ctx, dict):
      raise ValueError(f"{where}: ctxs[{j}] is not an object")
    for name in _CTX_FIELDS:
      if name not in ctx:
        raise ValueError(f"{where}: ctxs[{j}] missing field {name!r}")
    docs.append(Document(title=str(ctx["title"]), text=str(ctx["text"]),
                         isgold=bool(ctx["isgold"]), hasanswer=bool(ctx.get("hasanswer", False))))
  num_gold = sum(d.isgold for d in docs)
  if num_gold != 1:
    raise ValueError(f"{where}: expected exactly one ctx with isgold=true, found {num_gold}")
  return MDQAExample(question=str(record["question"]), answers=tuple(answers),
                     documents=tuple(docs))


def read_mdqa(path: str | os.PathLike, limit: int | None = None) -> list[MDQAExample]:
  """Reads a LitM multi-document QA file (`.jsonl` or `.jsonl.gz`).

  Args:
    path: the file.
    limit: read at most this many examples.

  Raises:
    FileNotFoundError: no such file.
    ValueError: a line that is not JSON or lacks a field; the message names file and line number.
  """
  path = os.fspath(path)
  opener = gzip.open if path.endswith(".gz") else open
  examples = []
  with opener(path, "rt", encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
      examples.append(_parse_line(record, where))
      if limit is not None and len(examples) >= limit:
        break
  if not examples:
    raise ValueError(f"{path}: no examples")
  return examples
