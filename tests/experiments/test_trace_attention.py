"""The kernel-trace summary of experiments.trace_attention on a hand-made trace."""

import pytest

from experiments import trace_attention


def _range(name, begin, end, tid):
  return [{"name": name, "ph": "B", "ts": begin, "tid": tid},
          {"name": name, "ph": "E", "ts": end, "tid": tid}]


def test_summary_counts_shares_and_nesting(tmp_path):
  events = []
  # CTA 0: compute warpgroup 0 (tid 1) and the memory warpgroup (tid 3).
  events += _range("qk", 0.0, 4.0, 1)[:1]
  events += _range("handshake", 1.0, 2.0, 1)
  events += _range("qk", 0.0, 4.0, 1)[1:]
  events += _range("softmax", 5.0, 10.0, 1)
  events += _range("wait_release", 0.0, 3.0, 3) + _range("wait_release", 5.0, 6.0, 3)
  summary = trace_attention.summarize({"traceEvents": events})
  compute = summary["roles"]["compute"]
  assert compute["warpgroups"] == 1 and compute["time_kcycles"] == 10.0
  assert compute["scopes"]["qk"] == {"count": 1, "mean_kcycles": 4.0, "share": 0.4}
  assert compute["scopes"]["handshake"]["share"] == 0.1  # nested inside qk
  assert compute["outside_scopes_share"] == pytest.approx(0.1)  # 4..5
  memory = summary["roles"]["memory"]
  assert memory["scopes"]["wait_release"]["count"] == 2
  assert memory["scopes"]["wait_release"]["mean_kcycles"] == 2.0
  assert memory["outside_scopes_share"] == pytest.approx(1 / 3)
  assert "wait_release" in trace_attention.format_summary(summary)
  trace_attention.plot_summary(summary, tmp_path / "shares.png")
  assert (tmp_path / "shares.png").read_bytes()[:4] == b"\x89PNG"
  # With three compute warpgroups per CTA, tid 3 is a compute warpgroup's trace.
  three = trace_attention.summarize({"traceEvents": events}, compute_wgs=3)["roles"]
  assert three["compute"]["warpgroups"] == 2 and three["memory"]["warpgroups"] == 0


def test_summary_rejects_unbalanced_traces():
  with pytest.raises(ValueError, match="without its begin"):
    trace_attention.summarize({"traceEvents": [{"name": "qk", "ph": "E", "ts": 1.0, "tid": 1}]})
  with pytest.raises(ValueError, match="no events"):
    trace_attention.summarize({"traceEvents": []})
