"""Atomic file writes: a temp file in the same folder, fsync, then `os.replace`.

A reader (or a run killed at any moment) sees the old file or the new one, never half of one. Used
for run configs, metrics logs, search states and results.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text(path: str | os.PathLike, text: str) -> None:
  """Writes `text` to `path` atomically (creating its folder); permissions 0644."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> None:
  """Writes `obj` as standard JSON (NaN and infinities refused: ValueError) atomically."""
  write_text(path, json.dumps(obj, indent=indent, allow_nan=False))
