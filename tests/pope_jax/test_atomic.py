"""pope_jax.atomic: whole files or nothing."""

import json
import math

import pytest

from pope_jax import atomic


def test_write_json_replaces_whole_file_and_leaves_no_temp(tmp_path):
  path = tmp_path / "sub" / "a.json"
  atomic.write_json(path, {"x": 1})
  atomic.write_json(path, {"x": 2})
  assert json.loads(path.read_text()) == {"x": 2}
  assert [p.name for p in path.parent.iterdir()] == ["a.json"]


def test_failed_write_keeps_the_old_file(tmp_path):
  path = tmp_path / "a.json"
  atomic.write_json(path, {"x": 1})
  with pytest.raises(ValueError):
    atomic.write_json(path, {"x": math.nan})          # non-standard JSON is refused
  assert json.loads(path.read_text()) == {"x": 1}
  assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
