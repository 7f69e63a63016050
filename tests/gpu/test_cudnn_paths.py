"""implementation="cudnn" on a real NVIDIA GPU (sm80+) against the XLA reference: PoPE and RoPE,
forward and the q, k, v (and δ) gradients, in every mask form cuDNN receives (its own causal
mask, the positions' boolean mask for padded, packed, cached and T > S calls, odd lengths).

Run on the GPU machine: python -m pytest -n 0 -m gpu tests/gpu/test_cudnn_paths.py
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pope_jax import attention, positions


def _capability() -> int:
  device = jax.devices()[0]
  try:
    return int(str(getattr(device, "compute_capability", "0")).split(".")[0])
  except ValueError:
    return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu" or _capability() < 8,
                       reason="needs an NVIDIA GPU of sm80 or newer (cuDNN flash attention)"),
]


def _inputs(b, t, s, n, k, h, v_dim, dtype, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(ks[0], (b, t, n, h), dtype),
          jax.random.normal(ks[1], (b, s, k, h), dtype),
          jax.random.normal(ks[2], (b, s, k, v_dim), dtype),
          jax.random.uniform(ks[3], (n, h), jnp.float32, -2 * math.pi, 0.0))


def _cases(b, t, s):
  lengths = jnp.array([s, max(1, s // 3)])[:b]
  left_pad = jnp.arange(s)[None, :] >= (s - lengths)[:, None]           # [B, S]
  seg = (jnp.arange(s)[None, :] >= s // 2).astype(jnp.int32) + jnp.zeros((b, 1), jnp.int32)
  pos = jnp.where(seg == 0, jnp.arange(s), jnp.arange(s) - s // 2)
  return {
      "causal": dict(is_causal=True),
      "full": {},
      "left_pad": dict(is_causal=True, key_mask=left_pad,
                       q_positions=positions.padded_positions(left_pad),
                       k_positions=positions.padded_positions(left_pad)),
      "packed": dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                     k_positions=pos),
      "multiplier": dict(is_causal=True, multiplier=0.25),
  }


def _compare(fn, q, k, v, delta, kw, *, rtol):
  def run(impl):
    if fn == "pope":
      f = lambda q, k, v, d: attention.pope_attention(q, k, v, d, implementation=impl, **kw)
      args, argnums = (q, k, v, delta), (0, 1, 2, 3)
    else:
      f = lambda q, k, v: attention.rope_attention(q, k, v, implementation=impl, **kw)
      args, argnums = (q, k, v), (0, 1, 2)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
    out = jax.jit(f)(*args)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(*args)
    return out, grads
  (ref, gref), (out, gout) = run("xla"), run("cudnn")
  ref, out = np.asarray(ref, np.float32), np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  scale = np.abs(ref).max() + 1e-6
  assert np.abs(out - ref).max() <= rtol * scale, (fn, kw.keys())
  for gx, gc in zip(gref, gout):
    gx, gc = np.asarray(gx, np.float32), np.asarray(gc, np.float32)
    assert np.all(np.isfinite(gc))
    assert np.abs(gc - gx).max() <= 4 * rtol * (np.abs(gx).max() + 1e-6)


@pytest.mark.parametrize("fn", ["pope", "rope"])
@pytest.mark.parametrize("case", ["causal", "full", "left_pad", "packed", "multiplier"])
@pytest.mark.parametrize("h", [32, 64])
def test_cudnn_matches_xla_square(fn, case, h):
  q, k, v, delta = _inputs(2, 256, 256, 4, 2, h, h, jnp.bfloat16)
  _compare(fn, q, k, v, delta, _cases(2, 256, 256)[case], rtol=2e-2)


@pytest.mark.parametrize("fn", ["pope", "rope"])
@pytest.mark.parametrize("t, s", [(1, 257), (7, 300), (64, 1000), (300, 128), (129, 257)])
def test_cudnn_matches_xla_cached_odd_and_t_greater_than_s(fn, t, s):
  """T != S (bottom-right: decode, chunked prefill, T > S with empty rows) and odd lengths, with
  and without a key mask (the backward pads odd lengths for cuDNN's bias)."""
  q, k, v, delta = _inputs(2, t, s, 4, 1, 64, 64, jnp.bfloat16, seed=t)
  _compare(fn, q, k, v, delta, dict(is_causal=True), rtol=2e-2)
  valid = jnp.arange(s)[None, :] >= jnp.array([[0], [s // 2]])
  _compare(fn, q, k, v, delta, dict(is_causal=True, key_mask=valid), rtol=2e-2)


def test_rope_cudnn_sliding_window_and_value_width():
  q, k, v, _ = _inputs(2, 256, 256, 4, 2, 64, 32, jnp.bfloat16)
  _compare("rope", q, k, v, None, dict(is_causal=True, local_window=64), rtol=2e-2)
  _compare("rope", q, k, v, None, dict(is_causal=True, local_window=64,
                                       q_positions=jnp.arange(256), k_positions=jnp.arange(256)),
           rtol=2e-2)


def test_pope_default_picks_a_fused_path_on_this_gpu():
  q, k, v, delta = _inputs(1, 128, 128, 2, 2, 64, 64, jnp.bfloat16)
  picked = attention._choose("pope_attention", None, attention._pope_why_not, q, k, v,
                             segment_ids=False)
  assert picked == "pallas"                          # Hopper: the fused kernel
