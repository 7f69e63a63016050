"""Every `python -m experiments.NAME ...` command in README.md runs as written: each one's
`--help` exits 0, and the cheap ones (`--preset smoke`) run for real into a temporary --out."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Code blocks (indented or fenced) and inline code; a comment ends the command.
COMMAND = re.compile(r"python -m (experiments\.[a-z_]+)\b([^`\n#]*)")


def _commands() -> list[tuple[str, list[str]]]:
  found = {}
  for module, rest in COMMAND.findall(README):
    found[(module, rest.strip())] = (module, shlex.split(rest))
  return list(found.values())


COMMANDS = _commands()
CHEAP = [(m, args) for m, args in COMMANDS if "--preset" in args
         and args[args.index("--preset") + 1] == "smoke"]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def test_readme_names_every_experiment():
  import experiments
  listed = set(re.findall(r"^  (\w+)\s+—", experiments.__doc__, re.M))
  assert {m.split(".")[1] for m, _ in COMMANDS} == listed
  assert CHEAP


@pytest.mark.parametrize("module", sorted({m for m, _ in COMMANDS}))
def test_help_runs(module):
  result = _run([module, "--help"], timeout=120)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("usage: ")


@pytest.mark.slow
@pytest.mark.parametrize("module, args", CHEAP, ids=[m for m, _ in CHEAP])
def test_cheap_commands_run(module, args, tmp_path):
  result = _run([module, *args, "--out", str(tmp_path), "--no-progress"], timeout=300)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  assert any(tmp_path.glob("*.json"))
