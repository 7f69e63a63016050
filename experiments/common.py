"""Flag helpers shared by the experiment CLIs (not a CLI itself): overrides of a preset's configs,
the language-model flags, and output folders that do not fit a command as usage errors."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path

import jax

from pope_jax import train
from pope_jax.reporting import write_json  # noqa: F401  (the LPES CLIs write through common)
from pope_jax.tasks import language_model as lm


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


def parse_splits(value: str | None) -> dict[str, str] | None:
  """--splits "train=a.bin,valid=b.bin" as a dict (None when not given)."""
  if not value:
    return None
  try:
    return dict(item.split("=", 1) for item in value.split(","))
  except ValueError:
    raise SystemExit(f"--splits must look like train=train.bin,valid=val.bin, got {value!r}")


def add_lm_flags(parser: argparse.ArgumentParser, default_out: str) -> None:
  """The flags of the language-model CLIs (they share one --out and its trained models)."""
  parser.add_argument("--preset", choices=sorted(lm.PRESETS), default="cpu")
  parser.add_argument("--encodings", default="rope,pope", help="comma-separated rope,pope")
  parser.add_argument("--steps", type=int, help="override the preset's optimiser steps")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--data-dir", type=Path, help="folder of uint16 token files to use instead")
  parser.add_argument("--splits", help="split=file pairs in --data-dir, e.g. "
                                       "train=train.bin,valid=val.bin")
  parser.add_argument("--out", type=Path, default=Path(default_out))
  parser.add_argument("--resume", action="store_true",
                      help="continue unfinished runs from their checkpoints in --out")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--fsdp", action="store_true",
                      help="shard parameters and optimiser state over the devices (FSDP)")
  parser.add_argument("--distributed", action="store_true",
                      help="call jax.distributed.initialize() first (multi-host: run the same "
                           "command on every host); auto-detected on SLURM/TPU, else give:")
  parser.add_argument("--coordinator", help="host:port of process 0 (multi-host)")
  parser.add_argument("--num-processes", type=int, help="number of processes (multi-host)")
  parser.add_argument("--process-id", type=int, help="this process's index (multi-host)")
  add_init_std_flag(parser)


def resolve_lm_preset(args) -> lm.Preset:
  """The language-model preset with the flags applied (after `jax.distributed` with --distributed).

  Raises:
    ValueError: a config refuses a flag's value.
  """
  if args.distributed:
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)
  preset = lm.PRESETS[args.preset]
  train_cfg = dataclasses.replace(preset.train, seed=args.seed, fsdp=args.fsdp)
  if args.steps:
    train_cfg = with_steps(train_cfg, args.steps)
  return dataclasses.replace(preset, train=train_cfg,
                             model=with_init_std(preset.model, args.init_std))
