"""The attention benchmark's train-step measurement, on CPU with a small model (structure only:
timings on CPU mean nothing)."""

import functools
import math
import sys

import jax.numpy as jnp
import pytest

from experiments import _timing, _train_step, bench_attention


@pytest.mark.slow
def test_train_step_breakdown_reports_every_part():
  time_ms = functools.partial(_timing.wall_ms, iters=1, windows=5, min_window_ms=100.0)
  result = _train_step.train_step_ratio(time_ms, 1, preset="jsb", seq_len=16, breakdown=True,
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


def test_unknown_shape_is_a_usage_error(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", ["bench_attention", "--shapes", "bench_h64,bench_h65"])
  with pytest.raises(SystemExit) as exit_info:
    bench_attention.main()
  assert exit_info.value.code == 2
  assert "bench_h65" in capsys.readouterr().err


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
