"""Prints the XLA fusions around the fused PoPE forward at bench_h64 (the GPU-compiled HLO,
kernel bodies elided): which small kernels a call runs besides the Pallas kernel."""
import sys

import jax

from experiments import bench_attention as ba
from pallas_kernels.shapes import SHAPES

name = sys.argv[1] if len(sys.argv) > 1 else "bench_h64"
args = ba._inputs(SHAPES[name])
text = jax.jit(ba._pope_pallas).lower(*args).compile().as_text()
for line in text.splitlines():
  print(line if len(line) < 400 else line[:400] + " ...")
