"""The attention benchmark's train-step measurement, on CPU with a small model (structure only:
timings on CPU mean nothing)."""

import math
import sys

import jax.numpy as jnp
import pytest

from experiments import bench_attention


def test_train_step_breakdown_reports_every_part():
  result = bench_attention.train_step_ratio(1, 1, preset="jsb", seq_len=16, breakdown=True,
                                            profile=True)
  for enc in ("rope", "pope"):
    row = result[enc]
    for key in ("ms", "loss_ms", "grad_ms", "mfu", "tokens_per_second"):
      assert math.isfinite(row[key]) and row[key] > 0, (enc, key)
    assert row["batch"] == 1
  assert math.isclose(result["pope_over_rope"], result["pope"]["ms"] / result["rope"]["ms"])
  assert result["head_and_loss_ms"] > 0
  for enc in ("rope", "pope"):
    assert result[enc]["profile"]["summary"]["total_ms"] > 0, enc


def test_check_failures_names_errors_and_rows_over_tolerance():
  ok = {"name": "a", "out": 5e-3, "dq": 8e-3, "dk": 1e-3, "dv": 1e-3, "ddelta": 1e-3}
  far = dict(ok, name="b", ddelta=0.5)
  broken = {"name": "c", "error": "ValueError: ..."}
  assert bench_attention.check_failures([ok, far, broken], 2e-2) == ["b", "c"]
  assert bench_attention.check_failures([ok], 2e-2) == []
  assert bench_attention.check_failures([dict(ok, name="d", dq=float("nan"))], 2e-2) == ["d"]
  large = dict(ok, name="check_h64_large", shape="check_h64_large", out=0.06)
  assert bench_attention.check_failures(
      [large, dict(large, name="check_h64", shape="check_h64")], 2e-2) == ["check_h64"]


def test_check_inputs_mix_bounded_and_unbounded_tiles():
  # The GPU check's queries (`_tile_scale`) must give `bounded_softmax` both kinds of items.
  from pallas_kernels import pope_attention as kernel
  from pallas_kernels.pope_attention_config import default_block_sizes
  from pallas_kernels.shapes import SHAPES, random_inputs
  for name in ("check_h64", "check_h128"):
    shape = SHAPES[name]
    q, k, _, _ = random_inputs(shape, seed=1)
    rows = kernel.forward_tile_rows(default_block_sizes(shape.head_dim), shape.head_dim,
                                    shape.value_dim, q.dtype)
    assert rows == {"check_h64": 192, "check_h128": 128}[name]
    q = q * bench_attention._tile_scale(q.shape[1], rows)
    t_pad = -(-q.shape[1] // 128) * 128  # the kernels' padding (`BlockSizes.seq_multiple`)
    q = jnp.pad(q, ((0, 0), (0, t_pad - q.shape[1]), (0, 0), (0, 0)))
    flags = kernel.bounded_tiles(q, k, 1 / math.sqrt(shape.head_dim) / math.log(2), rows)
    assert 0 < int(flags.sum()) < flags.size, (name, flags)


def test_unknown_check_shape_is_a_usage_error(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["bench_attention", "--check", "--check-shapes",
                                    "check_h64,check_h65"])
  with pytest.raises(SystemExit) as exit_info:
    bench_attention.main()
  assert exit_info.value.code == 2
  assert "check_h65" in capsys.readouterr().err


def test_unknown_row_is_a_usage_error(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["bench_attention", "--rows", "fused PoPE (ours),flash"])
  with pytest.raises(SystemExit) as exit_info:
    bench_attention.main()
  assert exit_info.value.code == 2
  assert "'fused PoPE (ours),flash'" in capsys.readouterr().err


def test_default_rows_parse(monkeypatch, capsys):
  # Without --rows every row is wanted: the run gets past the flag checks (to the platform's).
  monkeypatch.setattr(sys, "argv", ["bench_attention", "--skip-bench"])
  monkeypatch.setattr(bench_attention.kernel, "platform_reason", lambda: "no GPU here")
  with pytest.raises(SystemExit) as exit_info:
    bench_attention.main()
  assert exit_info.value.code == 2
  assert "no GPU here" in capsys.readouterr().err


def test_rows_select_the_main_table(monkeypatch):
  # Only the named rows are timed, in the table's order.
  timed = []
  monkeypatch.setattr(bench_attention, "_measure",
                      lambda name, *a, **k: timed.append(name) or {"name": name, "error": "-"})
  monkeypatch.setattr(bench_attention, "random_inputs", lambda shape, dtype=None: (None,) * 4)
  bench_attention.bench_head_dim("bench_h64", 1, with_tokamax=False, rows_wanted=(
      "RoPE cuDNN (scale)", "fused PoPE (ours)", bench_attention.TOKAMAX))
  assert timed == ["fused PoPE (ours)", "RoPE cuDNN (scale)"]


def test_tokamax_autotune_rows_and_ratios(monkeypatch, capsys):
  # A fake tokamax (plain XLA attention; `autotune` records what it tunes and returns a
  # context): the autotuned row is timed under the results of tuning its forward and its
  # forward+backward, and every row gets ratios to the untuned and the autotuned tokamax.
  import types

  import jax
  from pallas_kernels.shapes import AttentionShape
  tuned, entered = [], []

  class Result:
    def __enter__(self):
      entered.append(self)

    def __exit__(self, *exc):
      return None

  def autotune(fn, *args):
    tuned.append((fn, len(args)))
    return Result()

  def attention(q, k, v, *, scale, is_causal, implementation):
    assert implementation == "mosaic" and is_causal
    s = jnp.einsum("btnd,bsnd->bnts", q, k).astype(jnp.float32) * scale
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(s), v.astype(jnp.float32)).astype(v.dtype)

  fake = types.ModuleType("tokamax")
  fake.autotune, fake.dot_product_attention = autotune, attention
  monkeypatch.setitem(sys.modules, "tokamax", fake)
  monkeypatch.setitem(bench_attention.SHAPES, "tiny", AttentionShape(
      batch=1, q_len=32, k_len=32, num_heads=2, num_kv_heads=2, head_dim=32, value_dim=32))
  monkeypatch.setattr(bench_attention, "BASELINES", {
      bench_attention.TOKAMAX: bench_attention.BASELINES[bench_attention.TOKAMAX]})
  monkeypatch.setattr(bench_attention, "MIN_WINDOW_MS", 0.0)
  monkeypatch.setattr(bench_attention, "TIMING_WINDOWS", 1)
  result = bench_attention.bench_head_dim("tiny", 1, with_tokamax=True, tokamax_autotune=True)
  assert [n for _, n in tuned] == [4, 4] and len(entered) == 2
  rows = {r["name"]: r for r in result["rows"]}
  assert "error" not in rows[bench_attention.TOKAMAX_AUTOTUNED]
  for name in ("xla reference", bench_attention.TOKAMAX, bench_attention.TOKAMAX_AUTOTUNED):
    for key in ("fwd_ratio_tk", "fwd_ratio_tk_at", "fwd_bwd_ratio_tk", "fwd_bwd_ratio_tk_at"):
      assert math.isfinite(rows[name][key]) and rows[name][key] > 0, (name, key)
  assert rows[bench_attention.TOKAMAX]["fwd_ratio_tk"] == 1.0
  assert "/tk at" in capsys.readouterr().out
