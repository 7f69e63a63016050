"""Tests that need a real NVIDIA Hopper GPU (sm90) as JAX's default device.

Every test under tests/gpu/ is marked `gpu` and skipped, with the reason, on any other device:
CI (CPU only) collects and skips them. On a Hopper machine run them in one process, so that two
pytest-xdist workers do not each claim most of the GPU's memory:

    python -m pytest -m gpu -n 0
"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

_HERE = Path(__file__).resolve().parent


def hopper_missing_reason() -> str | None:
  """Why the default JAX device is not a Hopper GPU (sm90), or None when it is."""
  device = jax.devices()[0]
  capability = str(getattr(device, "compute_capability", "") or "")
  if device.platform == "gpu" and capability.startswith("9."):
    return None
  where = f"{device.device_kind} (platform {device.platform}"
  where += f", compute capability {capability})" if capability else ")"
  return f"needs an NVIDIA Hopper GPU (sm90) as the default JAX device, not {where}"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marker
def pytest_collection_modifyitems(config, items):
  mine = [item for item in items if _HERE in item.path.resolve().parents]
  if not mine:
    return
  reason = hopper_missing_reason()
  for item in mine:
    item.add_marker(pytest.mark.gpu)
    if reason:
      item.add_marker(pytest.mark.skip(reason=reason))
