"""The optional torch benchmark: its flags without torch, its shapes against the project's, and,
where torch is installed, its reference against `pope_jax`'s and a CPU smoke run of the SDPA row
(timings on CPU mean nothing)."""

import dataclasses
import json

import numpy as np
import pytest

from experiments import bench_attention_torch as bench


def test_help_needs_no_torch(capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench.parse_args(["--help"])
  assert exit_info.value.code == 0
  assert "pope-pytorch" in capsys.readouterr().out


@pytest.mark.parametrize("flags, named", [(["--shapes", "bench_h64,bench_h65"], "bench_h65"),
                                          (["--rows", "flash"], "flash"),
                                          (["--iters", "0"], "--iters")])
def test_bad_flag_is_a_usage_error(flags, named, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench.main(flags)  # exits before importing torch
  assert exit_info.value.code == 2
  assert named in capsys.readouterr().err


def test_shapes_are_the_attention_benchmark_shapes():
  shapes = pytest.importorskip("pallas_kernels.shapes")
  for name in ("bench_h64", "bench_h128"):
    ours, theirs = bench.SHAPES[name], shapes.SHAPES[name]
    assert theirs.is_causal
    assert dataclasses.asdict(ours) == {f: getattr(theirs, f) for f in dataclasses.asdict(ours)}
    assert ours.forward_flops() == theirs.forward_flops()
    assert bench.SHAPES[f"{name}_gqa"] == dataclasses.replace(ours, num_kv_heads=4)


def test_reference_matches_pope_jax():
  torch = pytest.importorskip("torch")
  jnp = pytest.importorskip("jax.numpy")
  from pope_jax import attention
  shape = bench.Shape(2, 37, 53, 4, 2, 16, 8)  # GQA, T < S, V != H
  q, k, v, delta = bench.random_inputs(shape, torch.device("cpu"), torch.float32)
  want = attention.pope_attention(*(jnp.asarray(x.numpy()) for x in (q, k, v, delta)),
                                  is_causal=True, implementation="xla")
  np.testing.assert_allclose(bench.pope_reference(q, k, v, delta).numpy(), want, atol=2e-5)
  square = bench.Shape(2, 53, 53, 4, 2, 16, 8)  # SDPA's causal mask needs T = S
  q, k, v, delta = bench.random_inputs(square, torch.device("cpu"), torch.float32)
  want = attention.pope_attention(*(jnp.asarray(x.numpy()) for x in (q, k, v, delta)),
                                  is_causal=True, implementation="xla")
  np.testing.assert_allclose(bench.pope_sdpa(q, k, v, delta).numpy(), want, atol=2e-5)


def test_cpu_smoke_run(tmp_path):
  torch = pytest.importorskip("torch")
  out = tmp_path / "torch.json"
  bench.main(["--device", "cpu", "--shapes", "tiny", "--iters", "1", "--max-iters", "2",
              "--min-ms", "0", "--out", str(out)])
  results = json.loads(out.read_text())
  assert results["torch"] == torch.__version__
  rows = {r["name"]: r for r in results["bench"]["tiny"]["rows"]}
  assert list(rows) == list(bench.ROWS)
  sdpa = rows[bench.SDPA]
  assert sdpa["fwd_rel_err"] < 1e-2 and sdpa["grad_rel_err"] < 3e-2, sdpa
  assert sdpa["fwd_ms"] > 0 and sdpa["fwd_bwd_ms"] > 0
  for name in (bench.TRITON, bench.TRITON_MASK):
    assert "CUDA" in rows[name]["skipped"]
