"""Synthetic key-value retrieval in the "Lost in the Middle" format (Liu et al., 2023, §3).

A JSON object of `num_pairs` random key/value records; the question asks for the value of one key,
whose record (the gold record) is placed at a chosen index. Examples are generated from a seed, so a
search set and a held-out set are two seeds. Keys and values are UUID4 strings by default; shorter
strings over a smaller alphabet make the task feasible for small models.

The prompt is the one of nelson-liu/lost-in-the-middle (`kv_retrieval.prompt`), records formatted
one per line as that repository's `get_kv_retrieval_prompt` does.
"""

from __future__ import annotations

import dataclasses
import random
import uuid

KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."
HEX_ALPHABET = "0123456789abcdef"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVConfig:
  """How key-value examples are drawn.

  Attributes:
    num_pairs: records per JSON object (LitM: 75, 140 or 300).
    key_length: characters per key; None draws UUID4 strings (36 characters).
    value_length: characters per value; None draws UUID4 strings.
    alphabet: characters that keys and values of a fixed length are drawn from.
  """
  num_pairs: int
  key_length: int | None = None
  value_length: int | None = None
  alphabet: str = HEX_ALPHABET

  def __post_init__(self):
    if self.num_pairs < 1:
      raise ValueError(f"KVConfig.num_pairs must be >= 1, got {self.num_pairs}")
    for name in ("key_length", "value_length"):
      v = getattr(self, name)
      if v is not None and v < 1:
        raise ValueError(f"KVConfig.{name} must be >= 1 or None (UUID), got {v}")
    if len(set(self.alphabet)) < 2:
      raise ValueError(f"KVConfig.alphabet needs at least 2 distinct characters, got {self.alphabet!r}")
    if '"' in self.alphabet or "\\" in self.alphabet or "\n" in self.alphabet:
      raise ValueError("KVConfig.alphabet must not contain quotes, backslashes or newlines")
    if self.key_length is not None and len(set(self.alphabet)) ** self.key_length < self.num_pairs:
      raise ValueError(f"KVConfig: {len(set(self.alphabet))}^{self.key_length} distinct keys cannot "
                       f"hold num_pairs={self.num_pairs} unique keys")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVExample:
  """One retrieval question.

  Attributes:
    records: (key, value) pairs in prompt order.
    gold_index: index of the queried record in `records`.
  """
  records: tuple[tuple[str, str], ...]
  gold_index: int

  @property
  def key(self) -> str:
    return self.records[self.gold_index][0]

  @property
  def value(self) -> str:
    return self.records[self.gold_index][1]

  @property
  def answers(self) -> tuple[str, ...]:
    return (self.value,)

  @property
  def prompt(self) -> str:
    return kv_prompt(self.records, self.key)


def format_kv_records(records) -> str:
  """The records as one JSON object, one `"key": "value"` pair per line (LitM's formatting)."""
  lines = []
  for i, (k, v) in enumerate(records):
    start = "{" if i == 0 else " "
    end = ",\n" if i != len(records) - 1 else "}"
    lines.append(f'{start}"{k}": "{v}"{end}')
  return "".join(lines)


def kv_prompt(records, key: str) -> str:
  """The LitM key-value retrieval prompt.

  Returns:
    instruction, blank line, `JSON data:`, the records, blank line, `Key: "<key>"`,
    `Corresponding value:`.
  """
  return (f"{KV_INSTRUCTION}\n\nJSON data:\n{format_kv_records(records)}\n\n"
          f'Key: "{key}"\nCorresponding value:')


def _draw(rng: random.Random, length: int | None, alphabet: str) -> str:
  if length is None:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
  return "".join(rng.choice(alphabet) for _ in range(length))


def make_kv_example(rng: random.Random, config: KVConfig, gold_index: int) -> KVExample:
  """Draws one example with unique keys and the gold record at `gold_index`.

  Raises:
    ValueError: if gold_index is outside [0, num_pairs).
  """
  check_gold_index(gold_index, config.num_pairs)
  keys: list[str] = []
  seen = set()
  while len(keys) < config.num_pairs:
    k = _draw(rng, config.key_length, config.alphabet)
    if k not in seen:
      seen.add(k)
      keys.append(k)
  values = [_draw(rng, config.value_length, config.alphabet) for _ in keys]
  return KVExample(records=tuple(zip(keys, values)), gold_index=gold_index)


def make_kv_examples(seed: int, num_examples: int, config: KVConfig,
                     gold_index: int) -> list[KVExample]:
  """`num_examples` examples from `random.Random(seed, gold_index)`; the same seed at another gold
  index gives other records (so that positions are independent samples)."""
  rng = random.Random(f"kv:{seed}:{gold_index}:{config}")
  return [make_kv_example(rng, config, gold_index) for _ in range(num_examples)]


def check_gold_index(gold_index: int, num_items: int) -> None:
  """Raises ValueError unless 0 <= gold_index < num_items."""
  if not 0 <= gold_index < num_items:
    raise ValueError(f"gold index {gold_index} out of range for {num_items} items")
