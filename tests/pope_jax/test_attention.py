"""pope_attention / rope_attention (xla reference): closed form, invariances, masks, gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from pope_jax import attention, encodings, positions

softplus = lambda x: np.log1p(np.exp(x))


def _qkv(b=2, t=5, s=5, n=2, k=2, h=8, seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(ks[0], (b, t, n, h), dtype), jax.random.normal(ks[1], (b, s, k, h), dtype),
          jax.random.normal(ks[2], (b, s, k, h), dtype),
          jax.random.uniform(ks[3], (n, h), jnp.float32, -2 * math.pi, 0.0))


def _probs(q, k, delta, **kw):
  """Attention weights, read out by using one-hot values."""
  s = k.shape[1]
  v = jnp.broadcast_to(jnp.eye(s), (k.shape[0], k.shape[2], s, s)).transpose(0, 2, 1, 3)
  return attention.pope_attention(q, k, v, delta, implementation="xla", **kw)


def test_pope_scores_equal_closed_form_double_loop_float64():
  q, k, _, delta = _qkv(b=1, t=4, s=6, n=1, k=1, h=6)
  base, scale = 10000.0, 1 / math.sqrt(6)
  qp, kp = np.array([2, 3, 4, 5]), np.arange(6)
  qn, kn, dn = (np.asarray(a, np.float64) for a in (q, k, delta))
  theta = base ** (-np.arange(6) / 6)
  scores = np.zeros((4, 6))
  for t in range(4):
    for s in range(6):
      scores[t, s] = sum(softplus(qn[0, t, 0, c]) * softplus(kn[0, s, 0, c])
                         * math.cos((kp[s] - qp[t]) * theta[c] + dn[0, c]) for c in range(6))
  expected = np.exp(scale * scores)
  expected /= expected.sum(-1, keepdims=True)
  got = _probs(q, k, delta)[0, :, 0]
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_pope_depends_only_on_relative_position():
  q, k, v, delta = _qkv(t=6, s=6)
  pos = jnp.arange(6)
  a = attention.pope_attention(q, k, v, delta, is_causal=True, q_positions=pos, k_positions=pos)
  b = attention.pope_attention(q, k, v, delta, is_causal=True, q_positions=pos + 777,
                               k_positions=pos + 777)
  np.testing.assert_allclose(a, b, atol=2e-5)


def test_rope_depends_only_on_relative_position():
  q, k, v, _ = _qkv(t=6, s=6)
  pos = jnp.arange(6)
  a = attention.rope_attention(q, k, v, is_causal=True, q_positions=pos, k_positions=pos)
  b = attention.rope_attention(q, k, v, is_causal=True, q_positions=pos + 321,
                               k_positions=pos + 321)
  np.testing.assert_allclose(a, b, atol=2e-5)


def test_delta_is_clamped():
  q, k, v, delta = _qkv()
  wild = delta.at[0, 0].set(-50.0).at[1, 3].set(4.0)
  np.testing.assert_allclose(
      attention.pope_attention(q, k, v, wild),
      attention.pope_attention(q, k, v, encodings.clamp_phase_bias(wild)), atol=1e-6)


def test_no_delta_equals_zero_delta():
  q, k, v, delta = _qkv()
  np.testing.assert_allclose(attention.pope_attention(q, k, v, None),
                             attention.pope_attention(q, k, v, jnp.zeros_like(delta)), atol=1e-6)


def test_gqa_equals_repeated_kv_heads_with_per_query_head_delta():
  q, k, v, delta = _qkv(n=4, k=2)
  rep = lambda x: jnp.repeat(x, 2, axis=2)
  np.testing.assert_allclose(attention.pope_attention(q, k, v, delta, is_causal=True),
                             attention.pope_attention(q, rep(k), rep(v), delta, is_causal=True),
                             atol=1e-5)


def test_causal_short_query_is_bottom_right_aligned():
  q, k, v, delta = _qkv(t=7, s=7)
  full = attention.pope_attention(q, k, v, delta, is_causal=True)
  tail = attention.pope_attention(q[:, 4:], k, v, delta, is_causal=True)
  np.testing.assert_allclose(tail, full[:, 4:], atol=1e-5)


def test_row_without_visible_key_is_zero_with_finite_gradients():
  q, k, v, delta = _qkv(t=3, s=4)
  kw = dict(is_causal=True, q_positions=jnp.array([-1, 0, 5]), k_positions=jnp.arange(4))
  out = attention.pope_attention(q, k, v, delta, **kw)
  assert np.all(np.asarray(out[:, 0]) == 0) and np.all(np.isfinite(out))
  grads = jax.grad(lambda *a: attention.pope_attention(*a, **kw).sum(), argnums=(0, 1, 2, 3))(
      q, k, v, delta)
  assert all(np.all(np.isfinite(g)) for g in grads)


def test_key_mask_equals_dropping_keys():
  q, k, v, delta = _qkv(b=1, t=3, s=5)
  keep = jnp.array([[False, False, True, True, True]])
  masked = attention.pope_attention(q, k, v, delta, key_mask=keep, q_positions=jnp.arange(3),
                                    k_positions=jnp.arange(5) - 2)
  dropped = attention.pope_attention(q, k[:, 2:], v[:, 2:], delta, q_positions=jnp.arange(3),
                                     k_positions=jnp.arange(3))
  np.testing.assert_allclose(masked, dropped, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_pope_gradients_match_finite_differences(causal):
  q, k, v, delta = _qkv(b=1, t=3, s=4, n=2, k=1, h=4)
  f = lambda q, k, v, d: attention.pope_attention(q, k, v, d, is_causal=causal)
  check_grads(f, (q, k, v, delta), order=1, modes=("rev",), eps=1e-2, atol=2e-2, rtol=2e-2)


def test_rope_gradients_match_finite_differences():
  q, k, v, _ = _qkv(b=1, t=3, s=3, h=4)
  check_grads(lambda q, k, v: attention.rope_attention(q, k, v, is_causal=True), (q, k, v),
              order=1, modes=("rev",), eps=1e-2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n, k, causal", [
    (4, 2, True), pytest.param(2, 2, False, marks=pytest.mark.slow),
    pytest.param(4, 1, True, marks=pytest.mark.slow)])
def test_rope_cudnn_path_matches_xla_reference(monkeypatch, n, k, causal):
  """The "cudnn" branch (rotation, then jax.nn's fused op with its own causal mask), run on CPU
  through jax.nn's XLA backend, equals the reference in value and gradient (bf16 inputs)."""
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "xla")
  monkeypatch.setattr(attention, "_gpu_capability", lambda: ("gpu", 9))
  q, kk, v, _ = _qkv(b=2, t=6, s=6, n=n, k=k, h=8, seed=3, dtype=jnp.bfloat16)
  run = lambda impl: lambda q, kk, v: attention.rope_attention(
      q, kk, v, is_causal=causal, implementation=impl).astype(jnp.float32)
  np.testing.assert_allclose(run("cudnn")(q, kk, v), run("xla")(q, kk, v), atol=2e-2)
  grads = [jax.grad(lambda *a: jnp.sum(run(impl)(*a) ** 2), argnums=(0, 1, 2))(q, kk, v)
           for impl in ("xla", "cudnn")]
  for gx, gc in zip(*grads):
    np.testing.assert_allclose(np.asarray(gc, np.float32), np.asarray(gx, np.float32), atol=1e-1,
                               rtol=5e-2)


@pytest.mark.parametrize("fn", ["pope", "rope"])
@pytest.mark.parametrize("capability, dtype, h, match", [
    (("cpu", 0), jnp.bfloat16, 8, "NVIDIA GPU of sm80"),
    (("gpu", 7), jnp.bfloat16, 8, "NVIDIA GPU of sm80"),
    (("gpu", 9), jnp.float32, 8, "bf16/fp16"),
    (("gpu", 8), jnp.bfloat16, 72, "up to 128"),     # PoPE 2H = 144, RoPE H = 72 fits
    (("gpu", 9), jnp.bfloat16, 136, "up to 256")])   # PoPE 2H = 272, RoPE H = 136 fits
def test_cudnn_refuses_what_it_cannot_run_and_says_why(monkeypatch, fn, capability, dtype, h,
                                                       match):
  monkeypatch.setattr(attention, "_gpu_capability", lambda: capability)
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "xla")
  q, kk, v, delta = _qkv(b=1, t=2, s=2, n=1, k=1, h=h, dtype=dtype)
  call = (lambda: attention.pope_attention(q, kk, v, delta, implementation="cudnn")) if (
      fn == "pope") else (lambda: attention.rope_attention(q, kk, v, implementation="cudnn"))
  if fn == "rope" and h in (72, 136):
    call()                                          # RoPE's width is H, not 2H
  else:
    with pytest.raises(NotImplementedError, match=f"implementation='cudnn': .*{match}"):
      call()


def test_rope_default_picks_cudnn_only_for_inputs_it_takes(monkeypatch):
  monkeypatch.setattr(attention, "_gpu_capability", lambda: ("gpu", 9))
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "no such backend")   # raises if chosen
  q, kk, v, _ = _qkv(dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="no such backend"):
    attention.rope_attention(q, kk, v, is_causal=True)
  attention.rope_attention(q, kk, v.astype(jnp.float32), is_causal=True)       # mixed: reference
  with pytest.raises(ValueError, match="no such backend"):                     # positions given
    attention.rope_attention(q, kk, v, is_causal=True, q_positions=jnp.arange(5),
                             k_positions=jnp.arange(5))


def test_rope_default_implementation_is_the_reference_on_cpu():
  q, kk, v, _ = _qkv(dtype=jnp.bfloat16)
  np.testing.assert_array_equal(attention.rope_attention(q, kk, v, is_causal=True),
                                attention.rope_attention(q, kk, v, is_causal=True,
                                                         implementation="xla"))


def test_gqa_multipliers_must_agree_within_a_group():
  q, k, v, delta = _qkv(n=4, k=2)
  attention.pope_attention(q, k, v, delta, multiplier=jnp.array([1.0, 1.0, 0.5, 0.5]))
  with pytest.raises(ValueError, match="GQA group"):
    attention.pope_attention(q, k, v, delta, multiplier=jnp.array([1.0, 2.0, 1.0, 2.0]))


def test_delta_may_be_a_python_list():
  q, k, v, delta = _qkv()
  np.testing.assert_allclose(attention.pope_attention(q, k, v, delta.tolist()),
                             attention.pope_attention(q, k, v, delta), atol=1e-6)


def test_output_dtype_follows_query():
  q, k, v, delta = _qkv(dtype=jnp.bfloat16)
  assert attention.pope_attention(q, k, v, delta).dtype == jnp.bfloat16


@pytest.mark.parametrize("call, err, match", [
    (lambda q, k, v, d: attention.pope_attention(q[0], k, v, d), ValueError, r"\[B, T, N, H\]"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v[:, :3], d), ValueError, "agree"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v, d[:1]), ValueError, "delta"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v, d, q_positions=jnp.arange(2)),
     ValueError, "q_positions"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v, d, implementation="magic"),
     ValueError, "implementation"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v, d, implementation="pallas",
                                                 multiplier=0.5), NotImplementedError, "pallas"),
    (lambda q, k, v, d: attention.rope_attention(q[..., :7], k[..., :7], v), ValueError, "even"),
    (lambda q, k, v, d: attention.rope_attention(q[..., :7], k[..., :7], v,
                                                 frequencies=jnp.ones(3)), ValueError, "even"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v, d, implementation="pallas"),
     NotImplementedError, "pallas PoPE attention"),   # never a silent fallback (here: on CPU)
    (lambda q, k, v, d: attention.rope_attention(q, k, v, implementation="pallas"),
     NotImplementedError, "decoding kernel"),
    (lambda q, k, v, d: attention.rope_attention(q, k[..., :4], v), ValueError, "head dim"),
    (lambda q, k, v, d: attention.pope_attention(q.astype(jnp.int32), k, v, d), TypeError,
     "query"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v, d, q_positions=jnp.zeros((3, 5), int)),
     ValueError, "q_positions"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v, d, k_positions=jnp.arange(5.0)),
     TypeError, "k_positions"),
    (lambda q, k, v, d: attention.pope_attention(q, k, v, d, key_mask=jnp.ones((2, 4), bool)),
     ValueError, "key_mask"),
    (lambda q, k, v, d: attention.pope_attention(jnp.concatenate([q, q[:, :, :1]], 2), k, v, None),
     ValueError, "multiple"),
])
def test_bad_input(call, err, match):
  with pytest.raises(err, match=match):
    call(*_qkv())


def test_default_implementation_picks_the_kernel_only_where_it_runs(monkeypatch):
  from pallas_kernels import pope_attention as kernel
  class FakeDevice:
    def __init__(self, platform, capability):
      self.platform, self.compute_capability = platform, capability
  q16 = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
  pick = lambda q, k, v, segment_ids=False: attention._choose(
      "pope_attention", None, attention._pope_why_not, q, k, v, segment_ids=segment_ids)
  assert pick(q16, q16, q16) == "xla"                                     # CPU
  monkeypatch.setattr(jax, "devices", lambda: [FakeDevice("gpu", "9.0")])
  assert kernel.platform_reason() is None
  assert pick(q16, q16, q16) == "pallas"            # masks and multipliers run in the kernel
  assert pick(q16, q16, q16, True) == "pallas"                            # segment ids
  assert pick(q16, q16, q16.astype(jnp.float32)) == "xla"                 # mixed dtypes
  assert pick(q16.astype(jnp.float32), q16, q16) == "xla"                 # float32
  assert pick(q16[:, :1], q16, q16, True) == "cudnn"     # decoding: the split-K kernel has no ids
  monkeypatch.setattr(jax, "devices", lambda: [FakeDevice("gpu", "8.0")])
  assert pick(q16, q16, q16) == "cudnn"                                   # not Hopper: 2H = 128
  assert pick(q16, q16, q16.astype(jnp.float32)) == "xla"                 # mixed dtypes
  q128 = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)
  assert pick(q128, q128, q128) == "xla"                                  # 2H = 256 > 128
  monkeypatch.setattr(jax, "devices", lambda: [FakeDevice("gpu", "7.5")])
  assert pick(q16, q16, q16) == "xla"                                     # before sm80


@pytest.mark.parametrize("fn, impl, match", [
    (attention.pope_attention, "cudnn", "NVIDIA GPU"),                   # CPU
    (attention.rope_attention, "pallas", "decoding kernel"),
    (attention.pope_attention, "pallas", "Hopper"),                       # CPU
    (attention.rope_attention, "cudnn", "NVIDIA GPU")])                  # CPU
def test_named_implementations_that_cannot_run_say_why(fn, impl, match):
  q, k, v, delta = _qkv(dtype=jnp.bfloat16, h=32)
  args = (q, k, v, delta) if fn is attention.pope_attention else (q, k, v)
  with pytest.raises(NotImplementedError, match=match):
    fn(*args, implementation=impl)


@pytest.mark.parametrize("fn", [attention.pope_attention, attention.rope_attention])
def test_unknown_implementation_is_a_value_error(fn):
  q, k, v, delta = _qkv()
  args = (q, k, v, delta) if fn is attention.pope_attention else (q, k, v)
  with pytest.raises(ValueError, match="implementation must be one of"):
    fn(*args, implementation="jax_nn")


def test_local_window_masks_keys_w_or_more_positions_back():
  q, k, v, _ = _qkv(b=2, t=6, s=6)
  out = attention.rope_attention(q, k, v, is_causal=True, local_window=2, implementation="xla")
  pos = jnp.arange(6)
  mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 2)
  ref = attention.dot_product_attention_reference(
      encodings.apply_rope(q, pos), encodings.apply_rope(k, pos), v, scale=q.shape[-1] ** -0.5,
      mask=mask[None])
  np.testing.assert_array_equal(out, ref.astype(out.dtype))
  with pytest.raises(ValueError, match="local_window"):
    attention.rope_attention(q, k, v, local_window=0)


@pytest.mark.parametrize("fn", [attention.pope_attention, attention.rope_attention])
def test_multiplier_of_the_wrong_length_names_multiplier_and_query_heads(fn):
  q, k, v, delta = _qkv(n=4, k=2)
  args = (q, k, v, delta) if fn is attention.pope_attention else (q, k, v)
  with pytest.raises(ValueError, match=r"multiplier must be a scalar or have shape \[num_heads\] "
                                       r"= \[4\]"):
    fn(*args, multiplier=jnp.ones(3))


def test_complex_delta_is_refused():
  q, k, v, delta = _qkv()
  with pytest.raises(TypeError, match="delta must be real"):
    attention.pope_attention(q, k, v, delta.astype(jnp.complex64))


@pytest.mark.parametrize("multiplier", [jnp.full(4, jnp.nan), float("inf"), 1 / jnp.zeros(())])
@pytest.mark.parametrize("fn", [attention.pope_attention, attention.rope_attention])
def test_non_finite_multipliers_are_named_before_the_gqa_check(fn, multiplier):
  # Concrete per-head and scalar multipliers (e.g. 1/s of a scale s = 0), on either path.
  q, k, v, delta = _qkv(n=4, k=2)
  args = (q, k, v, delta) if fn is attention.pope_attention else (q, k, v)
  with pytest.raises(ValueError, match="multiplier must be finite"):
    fn(*args, multiplier=multiplier)


@pytest.mark.parametrize("fn", [
    lambda q, k, v: attention.pope_attention(q, k, v, is_causal=True, implementation="xla"),
    lambda q, k, v: attention.rope_attention(q, k, v, is_causal=True, implementation="xla")])
def test_default_positions_build_the_mask_inside_the_program(fn):
  # Default positions are numpy (for the fused kernel's trace-time tables); the XLA paths must
  # still build the [T, S] causal mask in the program, not fold it in as a constant.
  q = k = v = jnp.zeros((1, 256, 1, 32), jnp.bfloat16)
  assert not any(np.ndim(c) >= 2 for c in jax.make_jaxpr(fn)(q, k, v).consts)
  assert len(jax.jit(fn).lower(q, k, v).as_text()) < 50_000


def test_as_positions_keeps_numpy_only_when_asked():
  assert isinstance(positions.as_positions([1, 2], keep_numpy=True), np.ndarray)
  assert isinstance(positions.as_positions(np.arange(3)), jax.Array)
  traced = jax.jit(lambda p: positions.as_positions(p, keep_numpy=True))(jnp.arange(3))
  np.testing.assert_array_equal(traced, np.arange(3))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.dtype("bfloat16"), "bf16", "bfloat16"])
def test_positional_attention_takes_dtypes_as_jax_users_write_them(dtype):
  from pope_jax.layers import PositionalAttention
  layer = PositionalAttention(num_heads=2, num_kv_heads=1, head_dim=8, pos_encoding="rope",
                              dtype=dtype)
  x = jnp.ones((1, 4, 16), jnp.float32)
  out = layer.apply(layer.init(jax.random.key(0), x), x)
  assert out.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype, err", [("int8", ValueError), (object(), TypeError)])
def test_positional_attention_dtype_errors_name_the_argument(dtype, err):
  from pope_jax.layers import PositionalAttention
  layer = PositionalAttention(num_heads=2, num_kv_heads=1, head_dim=8, dtype=dtype)
  x = jnp.ones((1, 4, 16), jnp.float32)
  with pytest.raises(err, match="PositionalAttention.dtype"):
    layer.init(jax.random.key(0), x)


# --- implementation="cudnn" on CPU: jax.nn's XLA backend stands in for cuDNN (same arguments).

def _cudnn_cases():
  """(name, t, s, kwargs) of calls whose mask reaches cuDNN in each of its forms."""
  left_pad = jnp.array([[False, False, True, True, True, True, True],
                        [True, True, True, True, True, True, True]])
  seg = jnp.array([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]])
  return [
      ("causal", 6, 6, dict(is_causal=True)),                       # cuDNN's own causal mask
      ("full", 6, 6, {}),                                           # no mask
      ("cache", 3, 7, dict(is_causal=True)),                        # T < S: bottom-right
      ("decode", 1, 7, dict(is_causal=True, key_mask=left_pad)),    # odd T and S, padded
      ("t_gt_s", 7, 4, dict(is_causal=True)),                       # rows with no key
      ("left_pad", 7, 7, dict(is_causal=True, key_mask=left_pad,
                              q_positions=positions.padded_positions(left_pad),
                              k_positions=positions.padded_positions(left_pad))),
      ("packed", 7, 7, dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)),
      ("multiplier", 6, 6, dict(is_causal=True, multiplier=jnp.array([0.5, 0.5, 0.25, 0.25]))),
      ("no_key", 3, 4, dict(is_causal=True, q_positions=jnp.array([-1, 0, 5]),
                            k_positions=jnp.arange(4))),
  ]


def _run(fn, q, k, v, delta, impl, kw):
  if fn == "pope":
    return attention.pope_attention(q, k, v, delta, implementation=impl, **kw)
  return attention.rope_attention(q, k, v, implementation=impl, **kw)


# The fast tier keeps one call per mask form cuDNN receives (causal, bias with odd lengths,
# segment ids, explicit positions); the other cases are slow.
_CUDNN_FAST = {("rope", "causal"), ("pope", "decode"), ("pope", "packed"), ("rope", "left_pad")}


@pytest.mark.parametrize("fn, name, t, s, kw", [
    pytest.param(fn, *case, id=f"{case[0]}-{fn}",
                 marks=() if (fn, case[0]) in _CUDNN_FAST else pytest.mark.slow)
    for case in _cudnn_cases() for fn in ("pope", "rope")])
def test_cudnn_path_matches_xla_reference(monkeypatch, fn, name, t, s, kw):
  """The "cudnn" branch (map q and k, then jax.nn's fused op with cuDNN's mask forms), run on
  CPU through jax.nn's XLA backend, equals the reference in value and gradient (bf16 inputs),
  with zero rows and finite gradients where no key is visible."""
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "xla")
  monkeypatch.setattr(attention, "_gpu_capability", lambda: ("gpu", 9))
  q, k, v, delta = _qkv(b=2, t=t, s=s, n=4, k=2, h=8, seed=5, dtype=jnp.bfloat16)
  v = v[..., :6]                                                        # V != H: padded
  run = lambda impl: lambda q, k, v, d: _run(fn, q, k, v, d, impl, kw).astype(jnp.float32)
  ref, out = run("xla")(q, k, v, delta), run("cudnn")(q, k, v, delta)
  assert out.shape == (2, t, 4, 6)
  np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2)
  if name in ("t_gt_s", "no_key"):
    assert np.all(np.asarray(out[:, 0]) == 0)
  argnums = (0, 1, 2, 3) if fn == "pope" else (0, 1, 2)
  grads = [jax.grad(lambda *a: jnp.sum(run(impl)(*a) ** 2), argnums=argnums)(q, k, v, delta)
           for impl in ("xla", "cudnn")]
  for gx, gc in zip(*grads):
    gx, gc = np.asarray(gx, np.float32), np.asarray(gc, np.float32)
    assert np.all(np.isfinite(gc))
    np.testing.assert_allclose(gc, gx, atol=1.5e-1, rtol=5e-2)


def test_rope_cudnn_takes_a_sliding_window_in_both_forms(monkeypatch):
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "xla")
  monkeypatch.setattr(attention, "_gpu_capability", lambda: ("gpu", 8))
  q, k, v, _ = _qkv(b=1, t=6, s=6, dtype=jnp.bfloat16)
  for kw in (dict(is_causal=True), dict(is_causal=True, q_positions=jnp.arange(6)), {}):
    ref = attention.rope_attention(q, k, v, local_window=2, implementation="xla", **kw)
    out = attention.rope_attention(q, k, v, local_window=2, implementation="cudnn", **kw)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=3e-2)


def test_cudnn_backward_pads_odd_lengths_only_for_the_mask_form(monkeypatch):
  """cuDNN's backward with a mask (bias) needs even T and S: the backward sees them even; the
  forward alone keeps the odd ones."""
  monkeypatch.setattr(attention, "_gpu_capability", lambda: ("gpu", 9))
  monkeypatch.setattr(attention, "CUDNN_BACKEND", "xla")
  seen = []
  real = jax.nn.dot_product_attention
  def spy(q, k, v, *a, **kw):
    seen.append((q.shape[1], k.shape[1], kw.get("mask") is not None))
    return real(q, k, v, *a, **kw)
  monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
  q, k, v, _ = _qkv(b=1, t=1, s=5, dtype=jnp.bfloat16)
  kw = dict(is_causal=True, key_mask=jnp.ones((1, 5), bool), implementation="cudnn")
  attention.rope_attention(q, k, v, **kw)
  assert seen == [(1, 5, True)]
  jax.grad(lambda q: attention.rope_attention(q, k, v, **kw).astype(jnp.float32).sum())(q)
  assert seen[1:] == [(2, 6, True)]


def test_segment_ids_equal_attending_each_document_alone():
  q, k, v, delta = _qkv(b=1, t=7, s=7)
  seg = jnp.array([[3, 3, 3, 5, 5, 5, 5]])
  pos = jnp.array([[0, 1, 2, 0, 1, 2, 3]])
  kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
            k_positions=pos, implementation="xla")
  packed = attention.pope_attention(q, k, v, delta, **kw)
  for a, b in ((0, 3), (3, 7)):
    alone = attention.pope_attention(q[:, a:b], k[:, a:b], v[:, a:b], delta, is_causal=True)
    np.testing.assert_allclose(packed[:, a:b], alone, atol=1e-5)
  kw.pop("delta", None)
  rope_packed = attention.rope_attention(q, k, v, **kw)
  rope_alone = attention.rope_attention(q[:, 3:], k[:, 3:], v[:, 3:], is_causal=True)
  np.testing.assert_allclose(rope_packed[:, 3:], rope_alone, atol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(q_segment_ids=jnp.zeros((2, 5), int)), "go together"),
    (dict(q_segment_ids=jnp.zeros((2, 4), int), kv_segment_ids=jnp.zeros((2, 5), int)),
     "q_segment_ids must have shape"),
    (dict(q_segment_ids=jnp.zeros((2, 5)), kv_segment_ids=jnp.zeros((2, 5))), "integer"),
])
def test_bad_segment_ids_are_named(kw, match):
  q, k, v, delta = _qkv()
  with pytest.raises((ValueError, TypeError), match=match):
    attention.pope_attention(q, k, v, delta, **kw)


def test_causal_t_greater_than_s_is_bottom_right_aligned():
  """T > S with is_causal: query t sits at S - T + t, so the first T - S rows see no key (zero)
  and the last S rows equal the T == S call on the last S queries."""
  q, k, v, delta = _qkv(t=7, s=4)
  q_pos, k_pos = positions.default_positions(7, 4)
  np.testing.assert_array_equal(q_pos, np.arange(7) - 3)
  np.testing.assert_array_equal(k_pos, np.arange(4))
  for fn, args in ((attention.pope_attention, (q, k, v, delta)),
                   (attention.rope_attention, (q, k, v))):
    out = fn(*args, is_causal=True, implementation="xla")
    assert np.all(np.asarray(out[:, :3]) == 0)
    square = fn(*((args[0][:, 3:],) + args[1:]), is_causal=True, implementation="xla")
    np.testing.assert_allclose(out[:, 3:], square, atol=1e-5)


def test_block_sizes_only_with_pallas():
  from pallas_kernels.pope_attention_config import BlockSizes
  q, k, v, delta = _qkv()
  for impl in (None, "xla", "cudnn"):
    with pytest.raises(ValueError, match="block_sizes"):
      attention.pope_attention(q, k, v, delta, implementation=impl, block_sizes=BlockSizes())
  with pytest.raises(NotImplementedError, match="pallas"):     # on CPU: the platform, not a
    attention.pope_attention(q, k, v, delta, implementation="pallas",  # silent fallback
                             block_sizes=BlockSizes())


def test_one_vocabulary_checks_every_name():
  assert attention.IMPLEMENTATIONS == ("xla", "cudnn", "pallas")
  assert set(attention.ORDER) == set(attention.IMPLEMENTATIONS)
  for name in (None,) + attention.IMPLEMENTATIONS:
    attention.check_implementation(name)
  with pytest.raises(ValueError, match="Thing.field must be one of"):
    attention.check_implementation("jax_nn", "Thing.field")
