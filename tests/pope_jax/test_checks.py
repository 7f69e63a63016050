"""Concrete values are checked where the API takes them; traced values pass unchecked under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pope_jax import attention, checks, encodings, positions


def _qkv(t=4, n=2, k=2, h=8):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, t, n, h))
  kk = jax.random.normal(keys[1], (1, t, k, h))
  v = jax.random.normal(keys[2], (1, t, k, h))
  delta = jax.random.uniform(keys[3], (n, h), minval=-6.0, maxval=0.0)
  return q, kk, v, delta


# ---- token ids


@pytest.mark.parametrize("ids, index, bad", [
    ([[1, 2, 10]], r"\(0, 2\)", "10"),
    (np.array([[3, -1, 4]]), r"\(0, 1\)", "-1"),
    (jnp.array([0, 9, 12, -3]), r"\(2,\)", "12"),
])
def test_check_token_ids_names_the_first_bad_id_its_index_and_the_vocabulary(ids, index, bad):
  with pytest.raises(ValueError, match=rf"tokens holds token id {bad} at index {index}, "
                                       rf"outside the vocabulary \[0, 10\)"):
    checks.check_token_ids(ids, 10, argument="tokens")


@pytest.mark.parametrize("ids", ["hello", b"hi", [[1.0, 2.0]], np.array([True, False]),
                                 [["a", "b"]]])
def test_check_token_ids_refuses_non_integers(ids):
  with pytest.raises(TypeError, match="prompt must be integer token ids"):
    checks.check_token_ids(ids, 10, argument="prompt")


def test_check_token_ids_accepts_valid_and_traced_ids():
  checks.check_token_ids([[0, 9]], 10, argument="tokens")
  checks.check_token_ids(np.zeros((0,), np.int32), 10, argument="tokens")
  # Under jit the ids are tracers: not checked, and nothing is added to the program.
  out = jax.jit(lambda ids: (checks.check_token_ids(ids, 10, argument="tokens"), ids)[1])(
      jnp.array([12]))
  np.testing.assert_array_equal(out, [12])


# ---- finite and positive values


def test_check_positive_finite_names_the_argument():
  for bad, what in ((0.0, "> 0"), (-1.0, "> 0"), (np.nan, "finite"), ([1.0, np.inf], "finite")):
    with pytest.raises(ValueError, match=f"scales must be {what}"):
      checks.check_positive_finite(bad, "scales")
  np.testing.assert_array_equal(checks.check_positive_finite([0.5, 2], "scales"), [0.5, 2.0])
  assert checks.check_positive_finite(None, "scales") is None


def test_long_value_lists_are_cut_in_messages():
  with pytest.raises(ValueError, match=r"\.\.\. \(40 values\)\]"):
    checks.check_finite(np.full(40, np.nan), "x")


@pytest.mark.parametrize("fn", [attention.pope_attention, attention.rope_attention])
@pytest.mark.parametrize("multiplier", [0.0, -1.0, jnp.array([1.0, 0.0]), np.array([1.0, -0.5])])
def test_zero_or_negative_multipliers_are_refused(fn, multiplier):
  q, k, v, delta = _qkv()
  args = (q, k, v, delta) if fn is attention.pope_attention else (q, k, v)
  with pytest.raises(ValueError, match="multiplier must be > 0"):
    fn(*args, multiplier=multiplier)


@pytest.mark.parametrize("multipliers", [0.0, -1.0, [1.0, 0.0, 1.0],
                                         [[1.0, 1.0]] * 2 + [[1.0, np.nan]]])
def test_layer_multipliers_refuse_zero_negative_and_non_finite(multipliers):
  with pytest.raises(ValueError, match="rope_multipliers must be"):
    encodings.layer_multipliers(multipliers, 3, 2)


def test_traced_multipliers_are_not_checked():
  q, k, v, delta = _qkv()
  # A traced multiplier passes the checks (its value is unknown at trace time) and runs.
  out = jax.jit(lambda m: attention.pope_attention(q, k, v, delta, multiplier=m))(0.5)
  np.testing.assert_allclose(out, attention.pope_attention(q, k, v, delta, multiplier=0.5),
                             atol=1e-6)
  got = jax.jit(lambda m: encodings.layer_multipliers(m, 3, 2))(jnp.array([1.0, 0.5, 0.25]))
  assert got.shape == (3,)  # one scalar per layer: angles are not widened to every head


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_delta_is_refused(bad):
  q, k, v, delta = _qkv()
  with pytest.raises(ValueError, match="delta must be finite"):
    attention.pope_attention(q, k, v, delta.at[1, 3].set(bad))
  with pytest.raises(ValueError, match="delta must be finite"):
    attention.pope_attention(q, k, v, np.asarray(delta.at[0, 0].set(bad)))


def test_traced_delta_is_not_checked():
  q, k, v, delta = _qkv()
  f = jax.jit(lambda d: attention.pope_attention(q, k, v, d, is_causal=True))
  np.testing.assert_allclose(f(delta), attention.pope_attention(q, k, v, delta, is_causal=True),
                             atol=1e-6)
  assert np.isnan(np.asarray(f(delta.at[0, 0].set(np.nan)))).any()  # unchecked, as documented
  grad = jax.grad(lambda d: attention.pope_attention(q, k, v, d).sum())(delta)
  assert np.isfinite(np.asarray(grad)).all()


# ---- positions inside int32


@pytest.mark.parametrize("bad", [2**31, -2**31 - 1, 2**40])
@pytest.mark.parametrize("fn", [attention.pope_attention, attention.rope_attention])
def test_positions_outside_int32_are_refused_not_wrapped(fn, bad):
  q, k, v, _ = _qkv()
  good = np.arange(4, dtype=np.int64)
  for kw, name in (("q_positions", "q_positions"), ("k_positions", "k_positions")):
    pos = good.copy()
    pos[2] = bad
    for given in (pos, pos.tolist()):
      with pytest.raises(ValueError, match=rf"{name} must lie inside int32 .* got {bad} at "
                                           rf"index \(2,\)"):
        fn(q, k, v, **{kw: given})


def test_uint32_positions_above_int32_are_refused():
  with pytest.raises(ValueError, match="positions must lie inside int32"):
    positions.as_positions(np.array([0, 2**31], np.uint32))


def test_int64_and_negative_positions_inside_int32_run_as_before():
  q, k, v, delta = _qkv()
  pos64 = np.arange(4, dtype=np.int64) + 2**31 - 10
  pos32 = pos64.astype(np.int32)
  for fn, args in ((attention.pope_attention, (q, k, v, delta)),
                   (attention.rope_attention, (q, k, v))):
    want = fn(*args, is_causal=True, q_positions=pos32, k_positions=pos32)
    got = fn(*args, is_causal=True, q_positions=pos64, k_positions=pos64)
    np.testing.assert_array_equal(got, want)
    neg = np.arange(4) - 7                       # negative positions are allowed, as before
    out = fn(*args, is_causal=True, q_positions=neg, k_positions=neg)
    assert np.isfinite(np.asarray(out)).all()


def test_traced_positions_are_not_checked():
  q, k, v, _ = _qkv()
  f = jax.jit(lambda p: attention.rope_attention(q, k, v, is_causal=True, q_positions=p,
                                                 k_positions=p))
  np.testing.assert_allclose(f(jnp.arange(4)), attention.rope_attention(q, k, v, is_causal=True),
                             atol=1e-6)


# ---- masked keys never affect the output


@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf, 3e38])
def test_masked_keys_and_values_never_affect_the_reference(garbage):
  q, k, v, delta = _qkv(t=6)
  mask = jnp.array([[True, False, True, True, False, True]])
  k2 = k.at[:, jnp.array([1, 4])].set(garbage)
  v2 = v.at[:, jnp.array([1, 4])].set(garbage)
  for fn, args, args2 in ((attention.pope_attention, (q, k, v, delta), (q, k2, v2, delta)),
                          (attention.rope_attention, (q, k, v), (q, k2, v2))):
    want = fn(*args, is_causal=True, key_mask=mask, implementation="xla")
    got = fn(*args2, is_causal=True, key_mask=mask, implementation="xla")
    np.testing.assert_array_equal(got, want)
  # The bare reference with a [B, T, S] mask, also for a query row that sees nothing.
  m = jnp.broadcast_to(mask[:, None], (1, 6, 6)).at[:, 0].set(False)
  want = attention.dot_product_attention_reference(q, k, v, scale=0.3, mask=m)
  got = attention.dot_product_attention_reference(q, k2, v2, scale=0.3, mask=m)
  np.testing.assert_array_equal(got, want)
  assert not np.asarray(got[:, 0]).any()
