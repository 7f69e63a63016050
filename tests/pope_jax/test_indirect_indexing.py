"""The indirect-indexing generator obeys its spec and is deterministic."""

import re

import numpy as np
import pytest

from pope_jax.data import indirect_indexing as task

CFG = task.IndirectIndexingConfig()


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_examples_obey_the_spec(split):
  for index in range(300):
    source, pos, shift, target = task.generate_example(CFG, 0, split, index)
    assert 20 <= len(source) <= 40
    assert len(set(source)) == len(source) and set(source) <= set(task.LETTERS)
    assert -15 <= shift <= 15 and 0 <= pos + shift < len(source)
    assert target == source[pos + shift]
    text = task.serialise(source, pos, shift, target)
    m = re.fullmatch(r"([A-Za-z]+), ([A-Za-z]), ([+-]\d+), ([A-Za-z])", text)
    src, char, sh, tgt = m.groups()
    assert src[src.index(char) + int(sh)] == tgt


def test_generation_is_deterministic_and_split_dependent():
  a = [task.generate_example(CFG, 3, "train", i) for i in range(50)]
  assert a == [task.generate_example(CFG, 3, "train", i) for i in range(50)]
  assert a != [task.generate_example(CFG, 3, "test", i) for i in range(50)]
  assert a != [task.generate_example(CFG, 4, "train", i) for i in range(50)]


def test_shifts_cover_the_range():
  shifts = {task.generate_example(CFG, 0, "train", i)[2] for i in range(3000)}
  assert shifts == set(range(-15, 16))
  no_zero = task.IndirectIndexingConfig(allow_zero_shift=False)
  assert 0 not in {task.generate_example(no_zero, 0, "train", i)[2] for i in range(500)}


def test_record_has_loss_only_on_the_target():
  src = task.IndirectIndexingSource(CFG, "test")
  assert len(src) == 10_000 and len(task.IndirectIndexingSource(CFG, "train")) == 1_000_000
  for i in range(20):
    r = src[i]
    assert r["inputs"].shape == r["targets"].shape == r["weights"].shape == (CFG.seq_len,)
    (where,) = np.nonzero(r["weights"])
    assert len(where) == 1
    text = task.serialise(*task.generate_example(CFG, 0, "test", i))
    assert task.decode(r["targets"][:where[0] + 1]) == text[1:]
    assert task.VOCAB[r["targets"][where[0]]] == text[-1]
    np.testing.assert_array_equal(r["inputs"][1:], r["targets"][:-1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_length=30, max_length=20), "min_length"),
    (dict(max_length=60), "max_length"),
    (dict(max_shift=0, allow_zero_shift=False), "max_shift"),
    (dict(split_sizes=(("dev", 5),)), "split_sizes"),
])
def test_bad_config_names_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    task.IndirectIndexingConfig(**kwargs)


def test_bad_split_and_index():
  with pytest.raises(ValueError, match="split"):
    task.IndirectIndexingSource(CFG, "dev")
  with pytest.raises(IndexError, match="out of range"):
    task.IndirectIndexingSource(CFG, "test")[10_000]
