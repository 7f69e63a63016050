"""The base of every experiment's presets: each task module keeps its experiment's presets in one
`PRESETS: dict[str, Preset]`, its `Preset` a frozen keyword-only dataclass built on this one, so
that the command line (`--preset`, its help) and results.md read the same two lines."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentPreset:
  """What every preset says of itself.

  Attributes:
    description: one line for `--help` and results.md: the budget and where it runs.
    expect: one line for results.md: what the results can show at this budget, in words (the
      measured numbers belong to the results pages, docs/*.md).
  """
  description: str = ""
  expect: str = ""
