"""Test set-up: the repository root on sys.path, float32 matmuls at full precision on CPU."""

import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
jax.config.update("jax_default_matmul_precision", "highest")
