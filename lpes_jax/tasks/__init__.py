"""Lost-in-the-Middle tasks: key-value retrieval, multi-document QA, their metrics and splits."""

from lpes_jax.tasks.kv_retrieval import (
    KVConfig, KVExample, check_gold_index, kv_prompt, make_kv_example, make_kv_examples)
from lpes_jax.tasks.mdqa import Document, MDQAExample, mdqa_prompt, read_mdqa
from lpes_jax.tasks.metrics import (
    begin_middle_end, best_subspan_em, kv_match, normalize_answer, position_indices,
    split_examples)

__all__ = [
    "Document", "KVConfig", "KVExample", "MDQAExample", "begin_middle_end", "best_subspan_em",
    "check_gold_index", "kv_match", "kv_prompt", "make_kv_example", "make_kv_examples",
    "mdqa_prompt", "normalize_answer", "position_indices", "read_mdqa", "split_examples",
]
