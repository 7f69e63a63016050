"""Experiment outputs: run metadata, strict JSON, markdown tables, results pages and plots.

Every experiment writes OUT/results.json (resolved config, seed, versions, device), OUT/results.md
(what ran, the table, the chance level, the paper's number and what to expect at this budget) and
a PNG. Process 0 alone writes (multi-host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import jax

from pope_jax import atomic

ENCODING_COLORS = {"rope": "tab:blue", "pope": "tab:red", "none": "tab:gray"}


def run_metadata(seed: int | None = None) -> dict[str, Any]:
  """Date, seed, library versions, backend and device kinds, recorded next to every result."""
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


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
  """(mean, sample standard deviation (n - 1)) of per-seed values; the sd is 0 for one value.

  Raises:
    ValueError: no values.
  """
  if not values:
    raise ValueError("mean_sd needs at least one value")
  return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt_mean_sd(values: Sequence[float], spec: str) -> str:
  """"mean ± sd" of per-seed values in `spec` (the sd without a sign), or the value alone for one
  seed."""
  mean, sd = mean_sd(values)
  return format(mean, spec) + (f" ± {format(sd, spec.replace('+', ''))}" if len(values) > 1
                               else "")


@contextlib.contextmanager
def timed(stage: str, timings: dict[str, float] | None = None):
  """Prints the wall-clock seconds a block took ("[  12.3 s] stage") and records them in
  `timings[stage]` when given."""
  start = time.perf_counter()
  yield
  seconds = time.perf_counter() - start
  if timings is not None:
    timings[stage] = seconds
  print(f"[{seconds:7.1f} s] {stage}", flush=True)


def write_json(path: str | Path, obj: Any) -> None:
  """Writes standard JSON (NaN as null) atomically: temp file + rename, never half a file."""
  atomic.write_json(path, to_jsonable(obj))


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
  """A GitHub markdown table, one line per row, ending in a newline."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def what_ran(*, preset: str, description: str, params: int | None, steps: int,
             batch: str, data: str, periodic: str | None = None, chance: str | None = None,
             paper: str, expect: str) -> str:
  """The "what ran" section of a results page as markdown bullets.

  Args:
    preset, description: the preset's name and one-line description.
    params: model size in parameters (None: not known).
    steps, batch: optimiser steps and the batch (e.g. "64 sequences of 41 tokens").
    data: the data set and its splits.
    periodic: how the periodic (per-step) metric is computed, naming a subsample as one.
    chance: the chance level, where there is one.
    paper: the paper's number at its budget.
    expect: what to expect at this budget.
  """
  size = "n/a" if params is None else f"{params / 1e6:.2f}M parameters"
  lines = [f"- Preset `{preset}`: {description}.", f"- Model: {size}.",
           f"- Training: {steps} steps of {batch}.", f"- Data: {data}."]
  lines += [f"- Curves: {periodic}."] if periodic else []
  lines += [f"- Chance level: {chance}."] if chance else []
  lines += [f"- Paper: {paper}.", f"- At this budget: {expect}."]
  return "\n".join(lines) + "\n"


def write_results(out: str | Path, *, title: str, about: str, table: str, record: Any,
                  runs: Sequence[dict], plot: str, metric: str, ylabel: str,
                  scale: float = 1.0) -> None:
  """OUT/results.md (title, `about`, table), OUT/results.json (record) and OUT/<plot> (`metric`
  vs step per run); prints the table. Process 0 alone writes (multi-host)."""
  out = Path(out)
  if jax.process_index() == 0:
    atomic.write_text(out / "results.md", f"# {title}\n\n{about}\n{table}")
    write_json(out / "results.json", record)
    plot_history(runs, out / plot, metric=metric, ylabel=ylabel, title=title, scale=scale)
  print(table)


def plot_history(runs: Sequence[dict], path: str | Path, *, metric: str, ylabel: str, title: str,
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
