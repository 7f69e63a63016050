"""One LPES task as the search and the evaluation see it: examples, prompts, scores.

    task = TaskConfig(task="kv", num_pairs=140)          # or task_config(args) from the flags
    examples = task_examples(task, gold=69, n=500, seed=1)
    ids = encode_prompt(tok, examples[0].prompt, task.chat)
    score(task, output_text, examples[0])                 # 1.0 or 0.0

KV examples are drawn from a seed; MDQA examples are read from a LitM .jsonl(.gz) file and the
gold document moved to the asked position.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from lpes_jax.tasks.kv_retrieval import KVConfig, make_kv_examples
from lpes_jax.tasks.mdqa import read_mdqa
from lpes_jax.tasks.metrics import best_subspan_em, kv_match

TASKS = ("kv", "mdqa")
# Search target prefix per task: the model's own continuation before the answer.
ANSWER_PREFIX = {"kv": ' "', "mdqa": " "}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
  """A lost-in-the-middle task.

  Attributes:
    task: "kv" (key-value retrieval) or "mdqa" (multi-document QA).
    num_pairs: KV records per prompt.
    key_length, value_length: KV key / value length (None: UUID4 strings).
    alphabet: characters of short keys and values.
    mdqa_file: LitM multi-document QA .jsonl(.gz) (needed for "mdqa").
    chat: wrap prompts in the model's chat template.
  """
  task: str = "kv"
  num_pairs: int = 140
  key_length: int | None = None
  value_length: int | None = None
  alphabet: str = "0123456789abcdef"
  mdqa_file: str | None = None
  chat: bool = False

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"TaskConfig.task must be one of {TASKS}, got {self.task!r}")


def add_task_flags(p: argparse.ArgumentParser) -> None:
  """The flags shared by the LPES search and evaluation CLIs (model, task, dtype, output)."""
  p.add_argument("--model", required=True, help="GGUF file or Hugging Face folder")
  p.add_argument("--task", choices=TASKS, default="kv",
                 help="kv: key-value retrieval; mdqa: multi-document QA (needs --mdqa-file)")
  p.add_argument("--num-pairs", type=int, default=140, help="KV records per prompt")
  p.add_argument("--key-length", type=int, default=None,
                 help="KV key length in characters (default: UUID4 keys)")
  p.add_argument("--value-length", type=int, default=None,
                 help="KV value length in characters (default: UUID4 values)")
  p.add_argument("--alphabet", default="0123456789abcdef",
                 help="characters of short KV keys and values")
  p.add_argument("--mdqa-file", default=None,
                 help="LitM multi-document QA .jsonl(.gz) (default: none; --task mdqa needs it)")
  p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="model weights and compute dtype")
  p.add_argument("--out", default="runs/lpes", help="run folder for the results")


def task_config(args: argparse.Namespace) -> TaskConfig:
  """The TaskConfig of the `add_task_flags` flags."""
  return TaskConfig(task=args.task, num_pairs=args.num_pairs, key_length=args.key_length,
                    value_length=args.value_length, alphabet=args.alphabet,
                    mdqa_file=args.mdqa_file, chat=args.chat)


def encode_prompt(tok, prompt: str, chat: bool) -> list[int]:
  """Token ids of a prompt: raw (BOS per the tokenizer) or in the chat template."""
  if chat:
    return tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
  return tok.encode(prompt)


def task_examples(task: TaskConfig, gold: int, n: int, seed: int) -> list:
  """n examples with the gold item at `gold`: KV drawn from the seed, MDQA from the file.

  Raises:
    ValueError: "mdqa" without `mdqa_file`.
  """
  if task.task == "kv":
    kvc = KVConfig(num_pairs=task.num_pairs, key_length=task.key_length,
                   value_length=task.value_length, alphabet=task.alphabet)
    return make_kv_examples(seed, n, kvc, gold)
  if not task.mdqa_file:
    raise ValueError("--task mdqa needs --mdqa-file")
  exs = read_mdqa(task.mdqa_file)
  rng = np.random.default_rng(seed)
  idx = rng.permutation(len(exs))[:n]
  return [exs[i].with_gold_at(gold) for i in idx]


def num_items(task: TaskConfig) -> int:
  """Records (KV) or documents (MDQA) per prompt."""
  if task.task == "kv":
    return task.num_pairs
  return len(read_mdqa(task.mdqa_file, limit=1)[0].documents)


def answer_text(task: TaskConfig, example) -> str:
  """The gold answer the search targets: the value (KV) or the first answer (MDQA)."""
  return example.value if task.task == "kv" else example.answers[0]


def score(task: TaskConfig, output: str, example) -> float:
  """LitM metric: KV value as a case-insensitive substring; MDQA best_subspan_em."""
  if task.task == "kv":
    return kv_match(output, example.value)
  return best_subspan_em(output, example.answers)
