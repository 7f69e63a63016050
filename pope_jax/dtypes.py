"""dtype arguments as JAX users write them, stored in one canonical form.

Every public place that takes a dtype (model configs, `PositionalAttention`, checkpoint loaders)
accepts `jnp.float32`, `jnp.bfloat16`, `np.dtype("float16")`, dtype instances, and the usual
strings ("float32", "f32", "fp32", "bfloat16", "bf16", "float16", "f16", "fp16", "half"), and
stores the canonical name ("float32", "bfloat16", "float16"), which is hashable and JSON-friendly.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

_ALIASES = {
    "f32": "float32", "fp32": "float32", "float": "float32", "single": "float32",
    "bf16": "bfloat16",
    "f16": "float16", "fp16": "float16", "half": "float16",
    "f64": "float64", "fp64": "float64", "double": "float64",
}


def canonical_dtype(value: Any, *, argument: str,
                    allowed: tuple[str, ...] = ("float32", "bfloat16", "float16")) -> str:
  """The canonical dtype name of `value`, one of `allowed`.

  Args:
    value: a dtype as JAX users write it: `jnp.bfloat16`, `np.dtype("float32")`, "bf16", ...
    argument: the caller's name for the argument or field, used in the error message.
    allowed: the canonical names the caller supports.

  Returns:
    The canonical name, e.g. "bfloat16".

  Raises:
    TypeError: `value` is not a dtype or dtype name (the message names `argument`).
    ValueError: `value` is a dtype outside `allowed` (the message names `argument`).
  """
  if isinstance(value, str):
    key = value.strip().lower()
    name = _ALIASES.get(key, key)
    try:
      name = jnp.dtype(name).name
    except TypeError:
      raise ValueError(f"{argument} must be one of {allowed} (or an alias such as 'bf16'), got "
                       f"{value!r}") from None
  else:
    try:
      name = jnp.dtype(value).name
    except TypeError:
      raise TypeError(f"{argument} must be a dtype such as jnp.bfloat16 or a name such as "
                      f"'bfloat16', got {value!r} of type {type(value).__name__}") from None
  if name not in allowed:
    raise ValueError(f"{argument} must be one of {allowed}, got {value!r}")
  return name


def as_jnp_dtype(name: str) -> np.dtype:
  """The dtype object of a canonical name (`canonical_dtype`'s output)."""
  return jnp.dtype(name)
