"""Dependencies flow one way: the kernels know nothing of the models, and the models load a
kernel only when a call asks for it. Each check imports in a fresh interpreter."""

import subprocess
import sys


def _loaded_after(statement: str, prefix: str) -> list[str]:
  code = (f"import sys\n{statement}\n"
          f"print(' '.join(m for m in sys.modules if m == {prefix!r} or "
          f"m.startswith({prefix!r} + '.')))")
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  return out.stdout.split()


def test_kernel_package_loads_no_pope_jax():
  assert _loaded_after("import pallas_kernels.pope_attention", "pope_jax") == []


def test_pope_jax_loads_no_kernel_eagerly():
  assert _loaded_after("import pope_jax", "pallas_kernels") == []
