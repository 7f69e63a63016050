"""LitM tasks: prompts, generation from a seed, the MDQA reader, metrics and position splits."""

import gzip
import json

import pytest

from lpes_jax.tasks import (KVConfig, begin_middle_end, best_subspan_em, kv_match, kv_prompt,
                            make_kv_examples, mdqa_prompt, normalize_answer, position_indices,
                            read_mdqa, split_examples)


def test_kv_prompt_exact():
  p = kv_prompt([("a1", "b1"), ("a2", "b2")], "a2")
  assert p == ('Extract the value corresponding to the specified key in the JSON object below.\n\n'
               'JSON data:\n{"a1": "b1",\n "a2": "b2"}\n\nKey: "a2"\nCorresponding value:')


def test_kv_examples_seeded_uuid_and_gold():
  cfg = KVConfig(num_pairs=10)
  a = make_kv_examples(0, 3, cfg, 4)
  assert a == make_kv_examples(0, 3, cfg, 4)
  assert a != make_kv_examples(1, 3, cfg, 4)
  for e in a:
    assert e.gold_index == 4 and len(e.records) == 10 and len(e.key) == 36 and e.key[14] == "4"
    assert len({k for k, _ in e.records}) == 10
    assert f'Key: "{e.key}"' in e.prompt and e.value == e.records[4][1]


def test_kv_short_keys_and_errors():
  e = make_kv_examples(0, 1, KVConfig(num_pairs=6, key_length=4, value_length=3, alphabet="xyz0"), 5)[0]
  assert all(len(k) == 4 and len(v) == 3 and set(k + v) <= set("xyz0") for k, v in e.records)
  with pytest.raises(ValueError, match="gold index 6 out of range"):
    make_kv_examples(0, 1, KVConfig(num_pairs=6), 6)
  with pytest.raises(ValueError, match="num_pairs"):
    KVConfig(num_pairs=300, key_length=2)          # 16^2 < 300 unique keys
  with pytest.raises(ValueError, match="alphabet"):
    KVConfig(num_pairs=2, key_length=2, alphabet='a"')


def _record(gold_at=1, n=3):
  return {"question": "who wrote hamlet", "answers": ["William Shakespeare", "Shakespeare"],
          "ctxs": [{"title": f"T{i}", "text": f"text {i}", "hasanswer": i == gold_at,
                    "isgold": i == gold_at} for i in range(n)]}


def test_mdqa_reader_prompt_and_move(tmp_path):
  path = tmp_path / "qa.jsonl.gz"
  with gzip.open(path, "wt") as f:
    f.write(json.dumps(_record()) + "\n\n" + json.dumps(_record(0)) + "\n")
  exs = read_mdqa(path)
  assert len(exs) == 2 and exs[0].gold_index == 1
  assert exs[0].prompt == (
      "Write a high-quality answer for the given question using only the provided search results "
      "(some of which might be irrelevant).\n\nDocument [1](Title: T0) text 0\n"
      "Document [2](Title: T1) text 1\nDocument [3](Title: T2) text 2\n\n"
      "Question: who wrote hamlet\nAnswer:")
  moved = exs[0].with_gold_at(2)
  assert [d.title for d in moved.documents] == ["T0", "T2", "T1"] and moved.gold_index == 2
  with pytest.raises(ValueError, match="out of range"):
    exs[0].with_gold_at(3)
  assert mdqa_prompt("q", moved.documents).endswith("Question: q\nAnswer:")


@pytest.mark.parametrize("broken,match", [
    (lambda r: r.pop("answers"), "missing field 'answers'"),
    (lambda r: r["ctxs"][2].pop("title"), r"ctxs\[2\] missing field 'title'"),
    (lambda r: r["ctxs"][0].update(isgold=True), "expected exactly one ctx"),
])
def test_mdqa_missing_fields_name_the_line(tmp_path, broken, match):
  bad = _record()
  broken(bad)
  path = tmp_path / "qa.jsonl"
  path.write_text(json.dumps(_record()) + "\n" + json.dumps(bad) + "\n")
  with pytest.raises(ValueError, match=rf"qa.jsonl:2: {match}"):
    read_mdqa(path)


def test_metrics():
  assert kv_match("The value is \"AbC-1\".", "abc-1") == 1.0
  assert kv_match("nothing\nabc-1", "abc-1") == 1.0                 # whole output
  assert kv_match("abc", "abc-1") == 0.0
  assert normalize_answer("The  Beatles!") == "beatles"
  assert best_subspan_em(" William Shakespeare wrote it.\nMarlowe", ["Shakespeare"]) == 1.0
  assert best_subspan_em("I think so.\nShakespeare", ["Shakespeare"]) == 0.0   # first line only
  assert best_subspan_em("anything", ["The", "!!"]) == 0.0           # normalises to "": no match
  assert best_subspan_em("an apple", ["Apple"]) == 1.0


def test_positions_and_splits():
  assert position_indices(20) == [0, 4, 9, 14, 19]
  assert position_indices(140) == [0, 34, 69, 104, 139]
  assert begin_middle_end(20) == {"begin": 0, "middle": 9, "end": 19}
  subsets = split_examples(lambda g, n: [g] * n, 10, 7)
  assert subsets == {"begin": [0, 0, 0], "middle": [4, 4], "end": [9, 9]}
