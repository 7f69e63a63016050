"""Checks of concrete input values: token ids and real numbers, skipped for traced values.

A value is checked when it is concrete (a Python number or sequence, a numpy array, a jax array
outside `jit`); under `jit`, `vmap` or `grad` it is a tracer and is not checked (its value is not
known at trace time), so the checks never add work to a compiled program. `lpes_jax` uses the
same checks (this module imports only numpy and jax).
"""

from __future__ import annotations

import jax
import numpy as np


def concrete(value) -> np.ndarray | None:
  """`value` as a numpy array, or None if it is None, traced, or holds traced values."""
  if value is None or isinstance(value, jax.core.Tracer):
    return None
  try:
    return np.asarray(value)
  except jax.errors.TracerArrayConversionError:  # a sequence holding traced values
    return None


def check_token_ids(ids, vocab_size: int, *, argument: str) -> None:
  """Raises unless concrete `ids` are integers in [0, vocab_size); traced ids pass unchecked.

  Args:
    ids: token ids of any shape (a list, numpy or jax array), or a tracer.
    vocab_size: V, the model's (or tokenizer's) vocabulary size.
    argument: the name of the argument the ids came from, for the message.

  Raises:
    TypeError: ids that are not integers (e.g. a string prompt, floats, booleans).
    ValueError: the first id (in row-major order) outside [0, V), with its index.
  """
  if isinstance(ids, (str, bytes)):
    raise TypeError(f"{argument} must be integer token ids, got the string {ids[:40]!r} (encode "
                    f"text with a tokenizer first)")
  values = concrete(ids)
  if values is None:
    return
  if values.dtype == object or not np.issubdtype(values.dtype, np.integer):
    raise TypeError(f"{argument} must be integer token ids (int32), got dtype {values.dtype} "
                    f"(text must be encoded with a tokenizer first)")
  bad = (values < 0) | (values >= vocab_size)
  if np.any(bad):
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{argument} holds token id {int(values[index])} at index {index}, outside "
                     f"the vocabulary [0, {vocab_size})")


def check_finite(value, name: str) -> np.ndarray | None:
  """Raises ValueError naming `name` if concrete `value` holds a NaN or an infinity.

  Returns:
    The concrete value as float64 numpy, or None (value None or traced).
  """
  values = concrete(value)
  if values is None:
    return None
  values = values.astype(np.float64)
  if not np.all(np.isfinite(values)):
    raise ValueError(f"{name} must be finite, got {_preview(values)}")
  return values


def check_positive_finite(value, name: str) -> np.ndarray | None:
  """Raises ValueError naming `name` if concrete `value` is not finite or not > 0 everywhere.

  Returns:
    The concrete value as float64 numpy, or None (value None or traced).
  """
  values = check_finite(value, name)
  if values is not None and not np.all(values > 0):
    raise ValueError(f"{name} must be > 0, got {_preview(values)}")
  return values


def _preview(values: np.ndarray, limit: int = 16) -> str:
  """The values as a list, cut after `limit` entries (a [L, N] table can be long)."""
  flat = values.reshape(-1).tolist()
  text = str(flat[:limit])
  if len(flat) > limit:
    text = text[:-1] + f", ... ({len(flat)} values)]"
  return text if values.ndim else str(flat[0])
