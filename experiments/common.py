"""Helpers shared by the experiment CLIs: run metadata, JSON/markdown/PNG outputs."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import jax


def run_metadata(seed: int | None = None) -> dict[str, Any]:
  """Versions, device and date recorded next to every result."""
  import flax
  import optax
  import orbax.checkpoint
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "seed": seed, "python": platform.python_version(), "jax": jax.__version__,
      "flax": flax.__version__, "optax": optax.__version__,
      "orbax_checkpoint": orbax.checkpoint.__version__,
      "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
  }


def to_jsonable(obj: Any) -> Any:
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return {k: to_jsonable(v) for k, v in dataclasses.asdict(obj).items()}
  if isinstance(obj, dict):
    return {str(k): to_jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [to_jsonable(v) for v in obj]
  return obj


def write_json(path: str | Path, obj: Any) -> None:
  """Writes JSON atomically (temp file + rename), so a crash never leaves half a file."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
    json.dump(to_jsonable(obj), f, indent=2)
  os.replace(f.name, path)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"
