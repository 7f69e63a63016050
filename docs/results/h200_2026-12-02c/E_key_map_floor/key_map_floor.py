"""How far the fused kernel's key map (one XLA pass, `pallas_kernels.pope_attention._forward`)
is from the memory floor of its traffic: device time of the pass as built, with the softplus
as log(1 + exp(-|x|)) instead of log1p, with no softplus, and a plain copy of the same size.

  PYTHONPATH=. python3 docs/results/h200_2026-12-02c/E_key_map_floor/key_map_floor.py
"""
import json

import jax
import jax.numpy as jnp

from experiments import profile_ops
from pope_jax import encodings


def as_built(k, pos):
  return encodings.pope_cartesian(k, pos, base=10000.0).astype(k.dtype)


def with_magnitude(mag_fn):
  def key_map(k, pos):
    ang = encodings.angles(pos, encodings.pope_frequencies(k.shape[-1], 10000.0))
    cos, sin = encodings._cos_sin(ang, None, encodings._loop_size(k, ang))
    h = k.shape[-1]
    mag = mag_fn(jnp.concatenate([k, k], axis=-1).astype(jnp.float32))
    trig = jnp.where(jnp.arange(2 * h) < h, jnp.concatenate([cos, cos], -1),
                     jnp.concatenate([sin, sin], -1))
    return (mag * trig).astype(k.dtype)
  return key_map


log_not_log1p = with_magnitude(lambda x: jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))
no_softplus = with_magnitude(lambda x: x)


def copy_2h(k, pos):
  del pos
  return jnp.concatenate([k, k * 2], axis=-1)


out = {}
for h in (64, 128):
  k = jax.random.normal(jax.random.key(0), (4, 4096, 16, h), jnp.bfloat16)
  pos = jnp.arange(4096, dtype=jnp.float32)
  gbytes = k.size * 2 * 3 / 1e9  # read k (bf16), write 2H wide (bf16)
  for name, fn in (("as built", as_built), ("log(1+exp) softplus", log_not_log1p),
                   ("no softplus", no_softplus), ("copy to 2H", copy_2h)):
    rows = profile_ops.op_times(jax.jit(fn), k, pos, iters=20)
    ms = sum(r["ms"] for r in rows)
    main = max(rows, key=lambda r: r["ms"])
    out[f"H{h} {name}"] = {"total_ms": ms, "largest_kernel_ms": main["ms"],
                           "largest_kernel": main["kernel"], "TB_per_s": gbytes / ms}
    print(f"H{h} {name:22s} {ms:.4f} ms device ({main['ms']:.4f} in {main['kernel'][:40]}), "
          f"{gbytes / ms:.2f} TB/s", flush=True)
print(json.dumps(out, indent=1))
