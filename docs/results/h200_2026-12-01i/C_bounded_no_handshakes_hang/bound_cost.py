import sys; sys.path.insert(0, ".")
import math, time, jax, jax.numpy as jnp, numpy as np
from experiments.bench_attention import _inputs, _time_ms
from pallas_kernels.shapes import SHAPES
from pallas_kernels.pope_attention import bounded_tiles
from pope_jax import encodings
for name in ("bench_h64", "bench_h128"):
  q, k, v, d = _inputs(SHAPES[name])
  h = q.shape[-1]
  ms = 1 / (math.sqrt(h) * math.log(2))
  f = jax.jit(lambda q, k: bounded_tiles(q, k, ms, 128))
  keymap = jax.jit(lambda k: encodings.pope_cartesian(k, jnp.arange(k.shape[1])).astype(k.dtype))
  print(name, "bounded fraction", float(np.asarray(f(q, k)).mean()),
        "bounded_tiles ms", round(_time_ms(f, q, k, iters=50), 4),
        "key map ms", round(_time_ms(keymap, k, iters=50), 4), flush=True)
