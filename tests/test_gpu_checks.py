"""The GPU tests' measures and inputs (tests/gpu/), checked on CPU where those tests skip."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from experiments._attention_paths import tile_scale
from tests.gpu import checks, conftest


def test_over_tolerance_names_outputs_over_the_shape_tolerance_and_nans():
  ok = {"out": 5e-3, "dq": 8e-3, "dk": 1e-3, "dv": 1e-3, "ddelta": 1e-3}
  assert checks.over_tolerance("check_h64", ok) == {}
  assert checks.over_tolerance("check_h64", dict(ok, ddelta=0.5)) == {"ddelta": 0.5}
  nan = checks.over_tolerance("check_h64", dict(ok, dq=float("nan")))
  assert list(nan) == ["dq"] and math.isnan(nan["dq"])
  # check_h64_large allows CHECK_TOLERANCES' larger bound; other shapes the default.
  assert checks.over_tolerance("check_h64_large", dict(ok, out=0.06)) == {}
  assert checks.over_tolerance("check_h64", dict(ok, out=0.06)) == {"out": 0.06}


def test_relative_error_is_over_the_reference_maximum_and_keeps_nans():
  ref = np.array([[1.0, -4.0], [2.0, 0.0]], np.float32)
  assert checks.relative_error(ref + 0.25, ref) == pytest.approx(0.25 / 4.0)
  assert checks.relative_error(jnp.asarray(ref, jnp.bfloat16), ref) == 0.0
  assert math.isnan(checks.relative_error(np.where(ref > 1, np.nan, ref), ref))


def test_check_shapes_are_every_check_shape():
  assert len(checks.CHECK_SHAPES) == 10
  assert {"check_h32_gqa", "check_h64_decode", "check_h64_large"} <= set(checks.CHECK_SHAPES)


def test_gpu_tests_skip_off_hopper_with_a_reason():
  reason = conftest.hopper_missing_reason()  # CI and this suite's CPU runs have no GPU
  assert reason is not None and "sm90" in reason and "cpu" in reason


def test_check_inputs_mix_bounded_and_unbounded_tiles():
  # The GPU check's queries (`tile_scale`) must give `bounded_softmax` both kinds of items.
  from pallas_kernels import pope_attention as kernel
  from pallas_kernels.pope_attention_config import default_block_sizes
  from pallas_kernels.shapes import SHAPES, random_inputs
  for name in ("check_h64", "check_h128"):
    shape = SHAPES[name]
    q, k, _, _ = random_inputs(shape, seed=1)
    rows = kernel.forward_tile_rows(default_block_sizes(shape.head_dim), shape.head_dim,
                                    shape.value_dim, q.dtype)
    assert rows == {"check_h64": 192, "check_h128": 128}[name]
    q = q * tile_scale(q.shape[1], rows)
    t_pad = -(-q.shape[1] // 128) * 128  # the kernels' padding (`BlockSizes.seq_multiple`)
    q = jnp.pad(q, ((0, 0), (0, t_pad - q.shape[1]), (0, 0), (0, 0)))
    flags = kernel.bounded_tiles(q, k, 1 / math.sqrt(shape.head_dim) / math.log(2), rows)
    assert 0 < int(flags.sum()) < flags.size, (name, flags)
