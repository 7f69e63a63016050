"""Where the fused PoPE forward kernel spends its time, per warpgroup (Mosaic GPU profiler).

Runs `pallas_kernels.pope_attention` forward once on the GPU with the kernel profiler on (see
`pallas_kernels._streaming.PROFILE_DIR_ENV`): every warpgroup of every CTA records the start and
end of the kernel's named scopes (Init, wait_q, query_map, wait_kv, qk, softmax, pv, qk_pv,
handshake, store; wait_release on the TMA warpgroup). The summary gives, per warpgroup role
(compute, memory) and scope, the number of ranges, their mean length and their share of the
warpgroup's time from its first to its last event; "outside scopes" is the rest (loop control,
barrier arrivals, ...). Scopes nest (a handshake inside qk), so shares of nested scopes overlap
their parents'.

Unit: the profiler stamps each event with the SM's cycle counter (%clock) and writes the trace's
"ts" as (start ns + cycles) / 1000, so a length in the trace is in thousands of SM cycles
(kcycles), not µs.

  python -m experiments.trace_attention --out DIR [--head-dim 64] [--batch 1]

Writes DIR/summary.json, DIR/summary.txt, DIR/shares.png (each scope's share, per role) and
DIR/trace_head.json (the first CTAs' events, for ui.perfetto.dev); the full trace stays in
DIR/raw/. Profiling adds a few cycles per event, so the times are for proportions, not for the
benchmark.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
from pathlib import Path

from experiments import common
from pallas_kernels import _streaming

def roles(compute_wgs: int) -> tuple[str, ...]:
  """The traces of one CTA: its compute warpgroups, then the memory (TMA) warpgroup."""
  return ("compute",) * compute_wgs + ("memory",)


def summarize(trace: dict, compute_wgs: int = _streaming.COMPUTE_WGS) -> dict:
  """Per role and scope: count, mean length (kcycles) and share of the warpgroups' time.

  Args:
    trace: a Mosaic GPU profiler trace (Chrome trace JSON: events with name, ph "B"/"E", ts
      whose differences are thousands of SM cycles, tid = 1 + trace index).
    compute_wgs: the traced kernel's compute warpgroups per CTA (the forward's
      `BlockSizes.forward_warpgroups`).

  Returns:
    {"roles": {role: {"warpgroups", "time_kcycles", "scopes": {name: {"count",
    "mean_kcycles", "share"}}, "outside_scopes_share"}}}.

  Raises:
    ValueError: an end event without its begin, or a trace with no events.
  """
  by_tid = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    by_tid[event["tid"]].append(event)
  if not by_tid:
    raise ValueError("the trace has no events")
  cta_roles = roles(compute_wgs)
  totals = {role: collections.defaultdict(lambda: [0, 0.0]) for role in set(cta_roles)}
  time_k = collections.Counter()
  top_level_k = collections.Counter()
  warpgroups = collections.Counter()
  for tid, events in by_tid.items():
    role = cta_roles[(tid - 1) % len(cta_roles)]
    events.sort(key=lambda e: e["ts"])
    stack = []
    for event in events:
      if event["ph"] == "B":
        stack.append(event)
        continue
      if not stack or stack[-1]["name"] != event["name"]:
        raise ValueError(f"end of scope {event['name']!r} without its begin (tid {tid})")
      begin = stack.pop()
      length = event["ts"] - begin["ts"]
      entry = totals[role][event["name"]]
      entry[0] += 1
      entry[1] += length
      if not stack:
        top_level_k[role] += length
    time_k[role] += events[-1]["ts"] - events[0]["ts"]
    warpgroups[role] += 1
  by_role = {}
  for role, scopes in totals.items():
    span = time_k[role]
    by_role[role] = {
        "warpgroups": warpgroups[role],
        "time_kcycles": span,
        "scopes": {name: {"count": n, "mean_kcycles": total / n,
                          "share": total / span if span else 0.0}
                   for name, (n, total) in sorted(scopes.items(), key=lambda kv: -kv[1][1])},
        "outside_scopes_share": 1.0 - top_level_k[role] / span if span else 0.0,
    }
  return {"roles": by_role}


def format_summary(summary: dict) -> str:
  lines = []
  for role, r in sorted(summary["roles"].items()):
    lines.append(f"{role} warpgroups: {r['warpgroups']}, {r['time_kcycles']:.1f} kcycles in all")
    lines.append(f"  {'scope':14s} {'count':>8s} {'mean kcyc':>9s} {'share':>7s}")
    for name, s in r["scopes"].items():
      lines.append(f"  {name:14s} {s['count']:8d} {s['mean_kcycles']:9.3f} {s['share']:7.1%}")
    lines.append(f"  {'outside scopes':14s} {'':8s} {'':9s} {r['outside_scopes_share']:7.1%}")
  return "\n".join(lines)


def plot_summary(summary: dict, path) -> None:
  """Horizontal bars: each scope's share of its warpgroups' time, one panel per role (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  roles = sorted(summary["roles"].items())
  fig, axes = plt.subplots(1, len(roles), figsize=(5 * len(roles), 3.5), squeeze=False)
  for ax, (role, r) in zip(axes[0], roles):
    names = list(r["scopes"]) + ["outside scopes"]
    shares = [s["share"] for s in r["scopes"].values()] + [r["outside_scopes_share"]]
    ax.barh(names[::-1], [100 * x for x in shares[::-1]])
    ax.set_xlabel("% of the warpgroups' time (nested scopes overlap)")
    ax.set_title(f"{role} warpgroups ({r['warpgroups']})")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = common.make_parser("trace_attention", __doc__)
  parser.add_argument("--out", required=True, help="output directory (required)")
  parser.add_argument("--head-dim", type=int, default=64, choices=(64, 128),
                      help="PoPE head dim H of the traced shape (V = H)")
  parser.add_argument("--batch", type=common.positive_int, default=1,
                      help="batch of the bench shape (N=16, S=4096; 1 keeps the trace small)")
  args = parser.parse_args()
  from pallas_kernels import pope_attention as kernel
  if reason := kernel.platform_reason():
    parser.error(f"needs an NVIDIA Hopper GPU: {reason}")
  out = Path(args.out)
  raw = out / "raw"
  raw.mkdir(parents=True, exist_ok=True)

  os.environ[_streaming.PROFILE_DIR_ENV] = str(raw.resolve())  # read when the kernel compiles
  import jax
  from pallas_kernels.pope_attention import forward_tile_rows
  from pallas_kernels.pope_attention_config import default_block_sizes
  from pallas_kernels.shapes import SHAPES, random_inputs
  from pope_jax import attention

  shape = dataclasses.replace(SHAPES[f"bench_h{args.head_dim}"], batch=args.batch)
  before = set(glob.glob(str(raw / "*-trace.json")))
  pope_pallas = lambda q, k, v, delta: attention.pope_attention(
      q, k, v, delta, is_causal=True, implementation="pallas")
  jax.block_until_ready(jax.jit(pope_pallas)(*random_inputs(shape)))
  new = sorted(set(glob.glob(str(raw / "*-trace.json"))) - before)
  if not new:
    raise RuntimeError(f"the kernel wrote no trace into {raw} (is this a GPU?)")
  with open(new[-1]) as f:
    trace = json.load(f)
  blocks = default_block_sizes(args.head_dim)
  rows = forward_tile_rows(blocks, args.head_dim, args.head_dim, jax.numpy.bfloat16)
  wgs = rows // blocks.block_q
  summary = {"shape": dataclasses.asdict(shape), "trace": os.path.basename(new[-1]),
             **summarize(trace, wgs)}
  text = format_summary(summary)
  print(text)
  (out / "summary.txt").write_text(text + "\n")
  (out / "summary.json").write_text(json.dumps(summary, indent=1))
  plot_summary(summary, out / "shares.png")
  head = [e for e in trace["traceEvents"] if e["tid"] <= 30 * len(roles(wgs))]
  (out / "trace_head.json").write_text(json.dumps({"displayTimeUnit": "ns",
                                                   "traceEvents": head}))


if __name__ == "__main__":
  main()
