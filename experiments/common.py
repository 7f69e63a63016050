"""Flag helpers shared by the experiment CLIs (not a CLI itself): the parser every command
uses, flag types that reject bad values at parse time, the run-folder lock, overrides of a
preset's configs, the language-model flags, and output folders that do not fit a command as usage
errors."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Iterator, Mapping

import jax

from pope_jax import train
from pope_jax.reporting import write_json  # noqa: F401  (the LPES CLIs write through common)
from pope_jax.run_lock import RunLockedError, run_lock
from pope_jax.tasks import language_model as lm


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """Keeps the description's and epilog's line breaks and appends each flag's default to its
  help, unless the help already states it or there is none to show (None, False, required)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if ("default" in text or action.required or action.default is None
        or action.default is False or action.default is argparse.SUPPRESS):
      return text
    return f"{text} (default: %(default)s)"


def make_parser(name: str, doc: str, presets: Mapping[str, str] | None = None
                ) -> argparse.ArgumentParser:
  """The parser of `python -m experiments.NAME`: usage in that form, the module docstring as the
  description, and each preset with its one-line description in the epilog."""
  epilog = None
  if presets:
    width = max(map(len, presets))
    epilog = "presets:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in presets.items())
  return argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=doc,
                                 epilog=epilog, formatter_class=HelpFormatter)


def _number(kind, low: float, inclusive: bool, what: str):
  def parse(value: str):
    try:
      x = kind(value)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if not math.isfinite(x) or x < low or (x == low and not inclusive):
      raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
    return x
  parse.__name__ = what   # argparse names the type in some messages.
  return parse


positive_int = _number(int, 1, True, "a positive integer")
nonnegative_int = _number(int, 0, True, "a non-negative integer")
positive_float = _number(float, 0.0, False, "a positive finite number")
nonnegative_float = _number(float, 0.0, True, "a non-negative finite number")


def comma_list(item, what: str):
  """A flag type: comma-separated values, each parsed by `item` (an argparse type); `what` names
  the values in errors ("positive integers")."""
  def parse(value: str) -> tuple:
    try:
      return tuple(item(v.strip()) for v in value.split(","))
    except (argparse.ArgumentTypeError, ValueError):
      raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {value!r}") from None
  parse.__name__ = f"comma-separated {what}"
  return parse


def existing_path(value: str) -> str:
  """A flag type: a file or folder that exists."""
  if not Path(value).exists():
    raise argparse.ArgumentTypeError(f"{value} does not exist")
  return value


def existing_dir(value: str) -> Path:
  """A flag type: a folder that exists."""
  if not Path(value).is_dir():
    raise argparse.ArgumentTypeError(f"{value} is not a folder")
  return Path(value)


def encodings_list(parser: argparse.ArgumentParser, value: str, allowed: tuple[str, ...],
                   flag: str = "--encodings") -> list[str]:
  """The distinct names of a comma-separated --encodings, each one of `allowed`."""
  names = list(dict.fromkeys(e.strip() for e in value.split(",") if e.strip()))
  if not names:
    parser.error(f"{flag}: name at least one of {', '.join(allowed)}")
  for name in names:
    if name not in allowed:
      parser.error(f"{flag}: unknown encoding {name!r} (choose from {', '.join(allowed)})")
  return names


@contextlib.contextmanager
def locked(parser: argparse.ArgumentParser, *folders: str | Path, flag: str = "--out"
           ) -> Iterator[None]:
  """Holds the run lock of each folder (`pope_jax.run_lock`) for the block.

  A folder that cannot be locked (another run writes it, it is a file or read-only) is a usage
  error that names `flag` and, for a lock held, the holder; errors inside the block are not.
  Only process 0 of a multi-process job locks (the others write nothing there).
  """
  with contextlib.ExitStack() as stack:
    if jax.process_index() == 0:
      for folder in folders:
        try:
          stack.enter_context(run_lock(folder))
        except RunLockedError as e:
          parser.error(f"{flag}: {e}")
        except OSError as e:
          parser.error(f"{flag} {folder}: {e.strerror or e}")
    yield


def add_sampling_flags(parser: argparse.ArgumentParser, *, temperature: float) -> None:
  """--temperature, --top-k, --top-p and --seed of the sampling CLIs (`pope_jax.generation`)."""
  parser.add_argument("--temperature", type=nonnegative_float, default=temperature,
                      help="softmax temperature; 0 for greedy")
  parser.add_argument("--top-k", type=positive_int,
                      help="sample among the k most likely tokens (default: all)")
  parser.add_argument("--top-p", type=positive_float,
                      help="nucleus sampling: the smallest set with this probability (default: 1)")
  parser.add_argument("--seed", type=nonnegative_int, default=0,
                      help="seed of the jax.random key that drives sampling")


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


def parse_splits(value: str) -> dict[str, str]:
  """A flag type: --splits "train=a.bin,valid=b.bin" as a dict."""
  try:
    splits = dict(item.split("=", 1) for item in value.split(","))
  except ValueError:
    splits = {}
  if not splits or not all(k and v for k, v in splits.items()):
    raise argparse.ArgumentTypeError(f"expected split=file pairs such as "
                                     f"train=train.bin,valid=val.bin, got {value!r}")
  return splits


def add_lm_flags(parser: argparse.ArgumentParser, default_out: str) -> None:
  """The flags of the language-model CLIs (they share one --out and its trained models)."""
  parser.add_argument("--preset", choices=sorted(lm.PRESETS), default="cpu",
                      help="configuration to run (see presets below)")
  parser.add_argument("--encodings", default="rope,pope", help="comma-separated rope,pope")
  parser.add_argument("--steps", type=positive_int,
                      help="optimiser steps (default: the preset's)")
  parser.add_argument("--seed", type=nonnegative_int, default=0,
                      help="seed of each model's initialisation and data order")
  parser.add_argument("--data-dir", type=existing_dir,
                      help="folder of uint16 token files to use instead of Shakespeare "
                           "(default: Shakespeare, tokenised into OUT/data)")
  parser.add_argument("--splits", type=parse_splits,
                      help="split=file pairs in --data-dir, e.g. train=train.bin,valid=val.bin "
                           "(default: the files' names)")
  parser.add_argument("--out", type=Path, default=Path(default_out),
                      help="run folder: data, one subfolder per trained model, results")
  parser.add_argument("--resume", action="store_true",
                      help="continue unfinished runs from their checkpoints in --out")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
  parser.add_argument("--fsdp", action="store_true",
                      help="shard parameters and optimiser state over the devices (FSDP)")
  parser.add_argument("--distributed", action="store_true",
                      help="call jax.distributed.initialize() first (multi-host: run the same "
                           "command on every host); it finds the processes itself on SLURM and "
                           "TPU, elsewhere give --coordinator, --num-processes and --process-id")
  parser.add_argument("--coordinator", help="host:port of process 0 (multi-host)")
  parser.add_argument("--num-processes", type=positive_int,
                      help="number of processes (multi-host)")
  parser.add_argument("--process-id", type=nonnegative_int,
                      help="this process's index (multi-host)")
  add_init_std_flag(parser)


def add_seeds_flag(parser: argparse.ArgumentParser) -> None:
  """--seeds of the language-model CLIs: one model per encoding and seed, trained in turn."""
  parser.add_argument("--seeds", type=comma_list(nonnegative_int, "non-negative integers"),
                      help="comma-separated distinct seeds, one model per encoding and seed, "
                           "trained in turn: seed 0 in OUT/<encoding>, seed N in "
                           "OUT/<encoding>_seedN (default: --seed)")


def seeds_list(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
  """The seeds of --seeds (or [--seed]); repeated seeds are a usage error."""
  if args.seeds is None:
    return [args.seed]
  if len(set(args.seeds)) != len(args.seeds):
    parser.error(f"--seeds: expected distinct seeds, got {','.join(map(str, args.seeds))}")
  return list(args.seeds)


def lm_presets_help(presets: Mapping) -> dict[str, str]:
  """{name: one-line description} of presets that have a `description`."""
  return {name: p.description for name, p in sorted(presets.items())}


def resolve_lm_preset(args) -> lm.Preset:
  """The language-model preset with the flags applied (after `jax.distributed` with --distributed).

  Raises:
    ValueError: a config refuses a flag's value.
  """
  if args.process_id is not None and args.num_processes is not None and (
      args.process_id >= args.num_processes):
    raise ValueError(f"--process-id {args.process_id} must be below --num-processes "
                     f"{args.num_processes}")
  if args.distributed:
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)
  preset = lm.PRESETS[args.preset]
  train_cfg = dataclasses.replace(preset.train, seed=args.seed, fsdp=args.fsdp)
  if args.steps:
    train_cfg = with_steps(train_cfg, args.steps)
  return dataclasses.replace(preset, train=train_cfg,
                             model=with_init_std(preset.model, args.init_std))


def check_task_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Usage errors in the LPES task flags (`lpes_jax.tasks.task.add_task_flags`), found before
  any model loads: counts and lengths positive, files that exist."""
  if not Path(args.model).exists():
    parser.error(f"--model {args.model} does not exist")
  for flag in ("num_pairs", "key_length", "value_length"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
  if args.task == "kv":
    from lpes_jax.tasks.kv_retrieval import KVConfig
    try:
      KVConfig(num_pairs=args.num_pairs, key_length=args.key_length,
               value_length=args.value_length, alphabet=args.alphabet)
    except ValueError as e:
      parser.error(f"{e} (flags --num-pairs, --key-length, --value-length, --alphabet)")
  if args.task == "mdqa":
    if not args.mdqa_file:
      parser.error("--task mdqa needs --mdqa-file")
    if not Path(args.mdqa_file).is_file():
      parser.error(f"--mdqa-file {args.mdqa_file} is not a file")

