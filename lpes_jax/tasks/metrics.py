"""Metrics and position splits of the "Lost in the Middle" benchmarks (Liu et al., 2023).

* Key-value retrieval: 1 if the gold value occurs in the model output, case-insensitive, anywhere in
  the whole output (LitM `evaluate_kv_retrieval_responses`).
* Multi-document QA: best_subspan_em (LitM `metrics.py`): SQuAD normalisation (lowercase, strip
  punctuation, drop articles a/an/the, squeeze whitespace) of the first line of the output and of each
  gold answer; 1 if any normalised gold answer is a substring of the normalised prediction. A gold
  answer that normalises to "" never matches (the original would count it a match everywhere).
"""

from __future__ import annotations

import math
import re
import string


def kv_match(output: str, value: str) -> float:
  """1.0 if `value` is a case-insensitive substring of `output`, else 0.0."""
  return float(value.lower() in output.lower())


def normalize_answer(s: str) -> str:
  """SQuAD answer normalisation: lowercase, no punctuation, no articles, single spaces."""
  s = s.lower()
  s = "".join(ch for ch in s if ch not in set(string.punctuation))
  s = re.sub(r"\b(a|an|the)\b", " ", s)
  return " ".join(s.split())


def first_line(output: str) -> str:
  """The output up to its first newline, leading whitespace dropped (LitM takes the first line of
  the stripped response)."""
  return output.strip().split("\n")[0]


def best_subspan_em(output: str, answers) -> float:
  """1.0 if any normalised answer is a substring of the normalised first line of `output`."""
  prediction = normalize_answer(first_line(output))
  for answer in answers:
    gold = normalize_answer(answer)
    if gold and gold in prediction:
      return 1.0
  return 0.0


def position_indices(num_items: int, count: int = 5) -> list[int]:
  """`count` evenly spaced gold positions from first to last (LitM, 20 documents: 0, 4, 9, 14, 19;
  140 pairs: 0, 34, 69, 104, 139).

  Raises:
    ValueError: if count < 1 or num_items < 1.
  """
  if num_items < 1 or count < 1:
    raise ValueError(f"need num_items >= 1 and count >= 1, got {num_items}, {count}")
  if count == 1:
    return [0]
  idx = [math.floor(i * num_items / (count - 1) + 0.5) - 1 for i in range(count)]
  idx[0] = 0
  return sorted(set(min(max(i, 0), num_items - 1) for i in idx))


def begin_middle_end(num_items: int) -> dict[str, int]:
  """Gold indices of the three search subsets: first, middle ((n − 1) // 2) and last item."""
  if num_items < 1:
    raise ValueError(f"num_items must be >= 1, got {num_items}")
  return {"begin": 0, "middle": (num_items - 1) // 2, "end": num_items - 1}


def split_examples(make, num_items: int, num_examples: int) -> dict[str, list]:
  """The begin/middle/end subsets: `make(gold_index, n)` builds n examples with the gold item at
  gold_index; `num_examples` are spread over the three subsets (remainder to the first ones)."""
  subsets = {}
  positions = begin_middle_end(num_items)
  for j, (name, gold) in enumerate(positions.items()):
    n = num_examples // 3 + (1 if j < num_examples % 3 else 0)
    subsets[name] = make(gold, n)
  return subsets
