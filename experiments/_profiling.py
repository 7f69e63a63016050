"""Device time per XLA op of a jitted function, from a `jax.profiler` trace (a helper, no CLI).

Used by `experiments.bench_attention --profile` to show where a train step or an attention call
spends its time (matmuls, attention kernels, fusions, copies), so speed work is aimed by
measurement. On GPUs the times are kernel times on the device, grouped by kernel name (inside
CUDA graphs every kernel's op is the command buffer); on CPU (tests) they are the thunk times of
the XLA:CPU runtime.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax

CATEGORIES = (  # (category, substrings of the lowercased kernel or op name), first match wins.
    ("attention (Pallas)", ("mosaic", "pope_attention", "pallas")),
    ("attention (cuDNN)", ("cudnn", "fmha", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cublas", "cutlass", "xmma", "dot", "matmul", "ynn_fusion")),
    ("reduction fusion", ("reduce",)),
    ("copy / transpose", ("copy", "transpose", "memcpy", "memset", "dynamic-update-slice")),
    ("elementwise fusion", ("fusion",)),
)


def category(name: str) -> str:
  lower = name.lower()
  for cat, keys in CATEGORIES:
    if any(k in lower for k in keys):
      return cat
  return "other"


def _events(xspace_path: str):
  """(op name, kernel name, duration ns) of every XLA-op event on the device (or CPU) planes."""
  data = jax.profiler.ProfileData.from_file(xspace_path)
  device_planes = [p for p in data.planes if p.name.startswith("/device:")]
  planes = device_planes or [p for p in data.planes if p.name == "/host:CPU"]
  for plane in planes:
    for line in plane.lines:
      for event in line.events:
        stats = {key: value for key, value in event.stats}
        op = stats.get("hlo_op")
        if op is None:
          continue
        yield str(op), event.name, event.duration_ns


def op_times(fn, *args, iters: int = 5, trace_dir: str | None = None) -> list[dict]:
  """Profiles `iters` calls of `fn(*args)` (after one warm-up call).

  Args:
    fn: a jitted function.
    args: its arguments.
    iters: profiled calls.
    trace_dir: where the trace goes (kept); default a temporary folder (deleted).

  Returns:
    One row per (op, kernel): {"op", "kernel", "category", "ms" (per call of fn), "count" (per
    call)}, slowest first. Empty if the profiler recorded no XLA-op events.
  """
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as tmp:
    out_dir = trace_dir or tmp
    with jax.profiler.trace(out_dir):
      for _ in range(iters):
        jax.block_until_ready(fn(*args))
    paths = glob.glob(os.path.join(out_dir, "**", "*.xplane.pb"), recursive=True)
    paths.sort(key=os.path.getmtime)
    if not paths:
      return []
    totals = collections.defaultdict(lambda: [0.0, 0])
    for op, kernel, ns in _events(paths[-1]):
      entry = totals[(op, kernel)]
      entry[0] += ns
      entry[1] += 1
  rows = [{"op": op, "kernel": kernel, "category": category(f"{kernel} {op}"),
           "ms": ns / iters * 1e-6, "count": n / iters} for (op, kernel), (ns, n) in totals.items()]
  return sorted(rows, key=lambda r: -r["ms"])


def summarize(rows: list[dict], title: str, top: int = 15) -> dict:
  """Prints device time per category and the `top` slowest ops; returns the category totals."""
  by_cat = collections.defaultdict(float)
  for r in rows:
    by_cat[r["category"]] += r["ms"]
  total = sum(by_cat.values())
  print(f"-- {title}: {total:.3f} ms of device time per call")
  for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
    print(f"   {cat:22s} {ms:8.3f} ms {100 * ms / max(total, 1e-12):5.1f} %")
  for r in rows[:top]:
    print(f"   {r['ms']:8.3f} ms x{r['count']:<5g} {r['category']:20s} {r['op'][:40]:40s} "
          f"{r['kernel'][:70]}")
  return {"total_ms": total, "by_category_ms": dict(by_cat)}
