"""Run 25 A: forms of the key map's XLA pass (`pope_attention.key_map`) by device time, to see
whether computing softplus once per key element, instead of once per half of b, would pay
before the kernels' layout is changed for it.

Forms, at the benchmark's key shapes [4, 4096, 16, H] bf16, each one jitted function:
  tree          `key_map` as on main: softplus(concat([k, k])) * [cos | sin] table
  polynomial    the same with log1p as run 24 E's degree-6 polynomial
  two_outputs   (μ cos, μ sin) as two [B, S, K, H] results of one fusion (μ once per element)
  interleaved   μ[..., None] * table [.., H, 2], reshaped to [B, S, K, 2H] (pairs adjacent)
  no_softplus   concat([k, k]) * table: the pass's memory floor with the same traffic

Device time per call from `experiments.profile_ops` (20 profiled calls), three rounds in turn.

  PYTHONPATH=. python3 docs/results/h200_2026-12-03d/key_map_variants.py
"""
import jax
import jax.numpy as jnp
import numpy as np

from experiments import profile_ops
from pallas_kernels import _streaming as st
from pallas_kernels import pope_attention as kernel

_LOG1P_COEFFS = (1.0, -0.49990746, 0.33140427, -0.23611341, 0.15102765, -0.06785116,
                 0.014588303)


def softplus_polynomial(x):
  x = x.astype(jnp.float32)
  e = jnp.exp(-jnp.abs(x))
  poly = _LOG1P_COEFFS[-1]
  for c in reversed(_LOG1P_COEFFS[:-1]):
    poly = poly * e + c
  return jnp.maximum(x, 0.0) + poly * e


def forms(h):
  def tree(k, trig):
    return kernel.key_map(k, trig)

  def polynomial(k, trig):
    return (softplus_polynomial(jnp.concatenate([k, k], -1)) * trig).astype(k.dtype)

  def two_outputs(k, trig):
    mag = st.softplus(k)
    return (mag * trig[..., :h]).astype(k.dtype), (mag * trig[..., h:]).astype(k.dtype)

  def interleaved(k, trig):
    pairs = trig.reshape(*trig.shape[:-1], 2, h).swapaxes(-1, -2)        # [.., H, 2]
    out = st.softplus(k)[..., None] * pairs
    return out.reshape(*k.shape[:-1], 2 * h).astype(k.dtype)

  def no_softplus(k, trig):
    return (jnp.concatenate([k, k], -1).astype(jnp.float32) * trig).astype(k.dtype)

  return dict(tree=tree, polynomial=polynomial, two_outputs=two_outputs,
              interleaved=interleaved, no_softplus=no_softplus)


def main():
  for h in (64, 128):
    k = jax.random.normal(jax.random.key(0), (4, 4096, 16, h), jnp.bfloat16)
    trig = kernel.key_table(jnp.arange(4096), 1.0 / 10000.0 ** (jnp.arange(h) / h))
    fns = {name: jax.jit(f) for name, f in forms(h).items()}
    ref = np.asarray(fns["tree"](k, trig), np.float32)
    cos_sin = np.concatenate([np.asarray(x, np.float32) for x in fns["two_outputs"](k, trig)], -1)
    inter = np.asarray(fns["interleaved"](k, trig), np.float32)
    inter = np.concatenate([inter[..., 0::2], inter[..., 1::2]], -1)
    poly = np.asarray(fns["polynomial"](k, trig), np.float32)
    print(f"H={h} max |difference| to tree: two_outputs {np.abs(cos_sin - ref).max():.3e}, "
          f"interleaved {np.abs(inter - ref).max():.3e}, polynomial {np.abs(poly - ref).max():.3e}")
    for name, fn in fns.items():
      rows = profile_ops.op_times(fn, k, trig, iters=3)
      print(f"H={h} {name:12s} kernels: " + "; ".join(
          f"{r['kernel'][:40]} x{r['count']:g}" for r in rows), flush=True)
    for r in range(3):
      for name, fn in fns.items():
        ms = sum(row["ms"] for row in profile_ops.op_times(fn, k, trig, iters=20))
        print(f"H={h} round {r} {name:12s} {ms:.4f} ms of device time", flush=True)


if __name__ == "__main__":
  main()
