"""Helpers shared by the experiment CLIs: run metadata, JSON/markdown/PNG outputs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import platform
from pathlib import Path
from typing import Any

import jax

from pope_jax import atomic, train


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
  """Dataclasses and tuples as dicts and lists; NaN and infinities as None (JSON null)."""
  if isinstance(obj, float) and not math.isfinite(obj):
    return None
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return {k: to_jsonable(v) for k, v in dataclasses.asdict(obj).items()}
  if isinstance(obj, dict):
    return {str(k): to_jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [to_jsonable(v) for v in obj]
  return obj


def fmt(value: float | None, spec: str) -> str:
  """`format(value, spec)`, or "n/a" for a value that was not measured (None or NaN)."""
  return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def write_json(path: str | Path, obj: Any) -> None:
  """Writes standard JSON (NaN as null) atomically: temp file + rename, never half a file."""
  atomic.write_json(path, to_jsonable(obj))


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


ENCODING_COLORS = {"rope": "tab:blue", "pope": "tab:red", "none": "tab:gray"}


def write_results(out: str | Path, *, title: str, table: str, note: str, record: Any,
                  runs: list[dict], plot: str, metric: str, ylabel: str,
                  scale: float = 1.0) -> None:
  """An experiment's outputs: OUT/results.md (title, table, note), OUT/results.json (record) and
  OUT/<plot> (`metric` vs step per run); prints the table. Process 0 alone writes (multi-host)."""
  out = Path(out)
  if jax.process_index() == 0:
    (out / "results.md").write_text(f"# {title}\n\n{table}\n{note}\n")
    write_json(out / "results.json", record)
    plot_history(runs, out / plot, metric=metric, ylabel=ylabel, title=title, scale=scale)
  print(table)


def plot_history(runs: list[dict], path: str | Path, *, metric: str, ylabel: str, title: str,
                 scale: float = 1.0) -> None:
  """One curve per run of `metric` from its history (evaluation steps only) to a PNG.

  Args:
    runs: dicts with "encoding", "history" (list of per-step dicts) and optionally "seed".
    metric: history key, e.g. "validation_accuracy" or "valid_loss".
    scale: multiplies the values (100 for percentages).
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for r in runs:
    pts = [(h["step"], scale * h[metric]) for h in r["history"] if metric in h]
    if pts:
      label = r["encoding"] + (f" seed {r['seed']}" if "seed" in r else "")
      ax.plot(*zip(*pts), marker=".", alpha=0.85, label=label,
              color=ENCODING_COLORS.get(r["encoding"]))
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def add_init_std_flag(parser) -> None:
  """--init-std: GPT-2-style std (a positive float) or 'flax' (`ModelConfig.init_std=None`)."""
  def parse(value: str) -> float | str:
    if value == "flax":
      return value
    try:
      return float(value)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a float or 'flax', got {value!r}") from None
  parser.add_argument("--init-std", type=parse,
                      help="GPT-2-style init std (default 0.02), or 'flax' for Flax's defaults")


def with_init_std(model, value: float | str | None):
  """`model` with --init-std applied (None: flag not given). Raises ModelConfig's ValueError."""
  if value is None:
    return model
  return dataclasses.replace(model, init_std=None if value == "flax" else value)


def with_steps(train, steps: int):
  """`train` (a TrainConfig) shortened or lengthened to about `steps` optimiser steps.

  Steps are rounded down to a multiple of steps_per_call (at least one call), and the eval,
  checkpoint and log cadences are capped at a quarter of the run so short runs still report.
  """
  if steps <= 0:
    raise ValueError(f"--steps must be positive, got {steps}")
  spc = train.steps_per_call
  steps = max(spc, steps // spc * spc)
  every = max(spc, (steps // 4) // spc * spc)
  return dataclasses.replace(train, steps=steps, eval_every=min(train.eval_every, every),
                             checkpoint_every=min(train.checkpoint_every, every),
                             log_every=min(train.log_every, every))


@contextlib.contextmanager
def usage_errors(parser: argparse.ArgumentParser):
  """Reports an output folder that does not fit the command (`train.ResumeError`: a saved run
  with other settings; FileExistsError: checkpoints without --resume) as a usage error that
  names the folder, not as a traceback."""
  try:
    yield
  except (train.ResumeError, FileExistsError) as e:
    parser.error(str(e))
