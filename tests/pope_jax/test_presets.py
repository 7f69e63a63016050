"""Every experiment keeps its presets in one `PRESETS` dict of its task module, each a frozen
`ExperimentPreset` that describes itself for --help and results.md."""

import dataclasses

import pytest

from pope_jax.tasks import indirect_indexing, jsb, language_model, length_extrapolation
from pope_jax.tasks.preset import ExperimentPreset

TASKS = (indirect_indexing, jsb, language_model, length_extrapolation)


@pytest.mark.parametrize("task", TASKS, ids=[t.__name__.rsplit(".", 1)[1] for t in TASKS])
def test_presets_describe_themselves(task):
  assert {"smoke", "cpu"} <= set(task.PRESETS)
  for name, preset in task.PRESETS.items():
    assert isinstance(preset, ExperimentPreset), name
    assert preset.description and preset.expect, name
    with pytest.raises(dataclasses.FrozenInstanceError):
      preset.expect = ""
