"""Benchmark the PyTorch PoPE attention paths on one GPU, beside `experiments.bench_attention`.

An optional script: it needs torch (and, for the Triton rows, triton and the `pope-pytorch` wheel
with its pure-Python dependencies einx, einops, torch-einops-utils and frozendict); the project
itself does not depend on torch, which is imported inside `main`.

Rows per shape (causal, bf16 inputs, q [B, T, N, H], k and v [B, S, K, H], δ [N, H] float32):
- "pope-pytorch (Triton)": lucidrains' fused Triton kernel, `PoPE_pytorch.flash_attn_with_pope`
  (softplus magnitudes and rotations inside the kernel; its bias is our δ, clamped to [-2π, 0]);
- "pope-pytorch (Triton) + key mask": the same with a key-padding mask [B, S] (ragged right
  padding: the last quarter of the keys masked in every other batch row);
- "torch expansion + SDPA": the official approach, q and k mapped to PoPE's 2H-wide Cartesian
  form in torch (softplus magnitudes, float32 angles s·θ_c − δ_c for the queries and t·θ_c for
  the keys, cos and sin parts concatenated, cast back to bf16), then
  `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` with v zero-padded to 2H.
θ_c = 10000^(-(c-1)/H), c = 1..H (PoPE Eq. 4), as `pope_jax.encodings.pope_frequencies`; scores
are scaled by 1/√H. Both paths give cos((s - t)·θ_c − δ_c) per component (PoPE Eq. 6).

Shapes: bench_h64 and bench_h128 are `pallas_kernels.shapes.SHAPES`' benchmark shapes; the
_gqa shapes are the same with K = 4 kv heads. FLOPs as `AttentionShape.forward_flops`: PoPE
forward causal = 2·B·N·T·S·(2H + V)/2, forward+backward counted as 2.5× the forward.
Timing: CUDA events around each call after warm-up calls (which also run the Triton kernels'
autotuning); the median over at least --iters calls and enough to last --min-ms (at most
--max-iters), so slow calls (pope-pytorch's backward at H128) get few. fwd runs under
`torch.no_grad`; fwd+bwd is `torch.autograd.grad` of the float32 output sum with respect to q,
k, v and δ. Before timing, each row's output and gradients on a
small shape (same H, GQA and mask) are compared with a float32 reference that computes the PoPE
scores directly (max |error| / max |reference|).

  python -m experiments.bench_attention_torch --out torch.json
  python -m experiments.bench_attention_torch --device cpu --shapes tiny  # smoke test
(`python3 experiments/bench_attention_torch.py` runs it too: it imports only the standard library
until `main` imports torch.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
import traceback

BASE = 10000.0


@dataclasses.dataclass(frozen=True)
class Shape:
  """q [B, T, N, H], k [B, S, K, H], v [B, S, K, V], causal."""
  batch: int
  q_len: int
  k_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  value_dim: int

  def forward_flops(self) -> float:
    """2·T·S·2H (q'k'ᵀ) + 2·T·S·V (PV) per head, halved for causal."""
    return (2.0 * self.batch * self.num_heads * self.q_len * self.k_len
            * (2 * self.head_dim + self.value_dim) / 2)


SHAPES = {
    "bench_h64": Shape(4, 4096, 4096, 16, 16, 64, 64),
    "bench_h128": Shape(4, 4096, 4096, 16, 16, 128, 128),
    "bench_h64_gqa": Shape(4, 4096, 4096, 16, 4, 64, 64),
    "bench_h128_gqa": Shape(4, 4096, 4096, 16, 4, 128, 128),
    "tiny": Shape(2, 64, 64, 4, 2, 32, 32),  # CPU smoke test
}
DEFAULT_SHAPES = "bench_h64,bench_h128,bench_h64_gqa"

TRITON = "pope-pytorch (Triton)"
TRITON_MASK = "pope-pytorch (Triton) + key mask"
SDPA = "torch expansion + SDPA"
ROWS = (TRITON, TRITON_MASK, SDPA)


def _key_mask(batch: int, k_len: int, device):
  """[B, S] bool, True where a key is seen: every other batch row loses its last S/4 keys."""
  import torch
  mask = torch.ones(batch, k_len, dtype=torch.bool, device=device)
  mask[1::2, k_len - k_len // 4:] = False
  return mask


def _frequencies(head_dim: int, device):
  """θ [H] float32 (PoPE Eq. 4)."""
  import torch
  return BASE ** -(torch.arange(head_dim, dtype=torch.float32, device=device) / head_dim)


def _angles(length: int, head_dim: int, device):
  """[L, H] float32: position · θ_c."""
  import torch
  pos = torch.arange(length, dtype=torch.float32, device=device)
  return pos[:, None] * _frequencies(head_dim, device)[None, :]


def _clamp(delta):
  return delta.clamp(-2 * math.pi, 0.0)


def pope_triton(q, k, v, delta, key_mask=None):
  """lucidrains' fused kernel on [B, T, N, H] inputs; out [B, T, N, V]. Called in its default
  [B, N, T, H] layout (transposed views: it transposes back to [B, T, N, H] without a copy).
  GQA: k and v are repeated to N heads here, query head n reading kv head n // (N / K) as in
  `jax.nn.dot_product_attention` and SDPA's `enable_gqa` (the library's own repeat, also a copy,
  pairs query head n with kv head n mod K)."""
  from PoPE_pytorch import attention, flash_attn_with_pope
  if not attention.TRITON_AVAILABLE:
    raise RuntimeError("pope-pytorch's Triton kernel did not import (is triton installed?)")
  freqs = _angles(k.shape[1], q.shape[-1], q.device)  # [S, H]; the kernel offsets the queries
  groups = q.shape[2] // k.shape[2]
  k, v = (x.repeat_interleave(groups, dim=2) if groups > 1 else x for x in (k, v))
  q, k, v = (x.transpose(1, 2) for x in (q, k, v))
  out = flash_attn_with_pope(q, k, v, pos_emb=(freqs, _clamp(delta)), mask=key_mask,
                             causal=True, fused=True)
  return out.transpose(1, 2)


def _cartesian(x, angles):
  """[B, L, N, H] → [B, N, L, 2H] in x's dtype: softplus(x)·[cos φ, sin φ], φ [N or 1, L, H]."""
  import torch
  import torch.nn.functional as F
  mag = F.softplus(x.float()).transpose(1, 2)  # [B, N, L, H]
  return torch.cat([mag * torch.cos(angles), mag * torch.sin(angles)], dim=-1).to(x.dtype)


def pope_sdpa(q, k, v, delta, key_mask=None):
  """Expansion to Cartesian q', k' in torch, then SDPA (causal, GQA); out [B, T, N, V]."""
  import torch.nn.functional as F
  if key_mask is not None:
    raise ValueError("pope_sdpa: key_mask is not benchmarked for this path")
  h, s_len = q.shape[-1], k.shape[1]
  if q.shape[1] != s_len:  # SDPA's is_causal aligns the query and key starts
    raise ValueError(f"pope_sdpa: query length {q.shape[1]} must equal key length {s_len}")
  q_ang = _angles(s_len, h, q.device)[None] - _clamp(delta)[:, None, :]
  qe = _cartesian(q, q_ang)
  ke = _cartesian(k, _angles(s_len, h, k.device)[None])
  vp = F.pad(v, (0, 2 * h - v.shape[-1])).transpose(1, 2)  # [B, K, S, 2H]
  out = F.scaled_dot_product_attention(qe, ke, vp, is_causal=True, scale=1 / math.sqrt(h),
                                       enable_gqa=q.shape[2] != k.shape[2])
  return out[..., :v.shape[-1]].transpose(1, 2)


def pope_reference(q, k, v, delta, key_mask=None):
  """float32 PoPE attention with the scores written out (PoPE Eq. 6):
  score[b, n, t, s] = Σ_c μq μk cos((t' - s)·θ_c − δ_c) / √H, t' = t + S - T, causal."""
  import torch
  import torch.nn.functional as F
  q, k, v = q.float(), k.float(), v.float()
  b, t_len, n, h = q.shape
  s_len, groups = k.shape[1], n // k.shape[2]
  k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
  q_pos = torch.arange(s_len - t_len, s_len, dtype=torch.float32, device=q.device)
  k_pos = torch.arange(s_len, dtype=torch.float32, device=q.device)
  phase = ((q_pos[:, None] - k_pos[None, :])[None, :, :, None] * _frequencies(h, q.device)
           - _clamp(delta.float())[:, None, None, :])  # [N, T, S, H]
  scores = torch.einsum("btnc,bsnc,ntsc->bnts", F.softplus(q), F.softplus(k),
                        torch.cos(phase)) / math.sqrt(h)
  seen = q_pos[:, None] >= k_pos[None, :]  # [T, S]
  if key_mask is not None:
    seen = seen[None, None] & key_mask[:, None, None, :]
  scores = scores.masked_fill(~seen, float("-inf"))
  return torch.einsum("bnts,bsnv->btnv", scores.softmax(-1), v)


PATHS = {TRITON: (pope_triton, False), TRITON_MASK: (pope_triton, True),
         SDPA: (pope_sdpa, False)}  # name: (function, with the key mask)


def random_inputs(shape: Shape, device, dtype, seed: int = 0):
  """q, k ~ N(0, 1) and v ~ N(0, 1) in dtype, δ [N, H] float32 uniform in [-2π, 0)."""
  import torch
  gen = torch.Generator(device="cpu").manual_seed(seed)
  def normal(*size):
    return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)
  q = normal(shape.batch, shape.q_len, shape.num_heads, shape.head_dim)
  k = normal(shape.batch, shape.k_len, shape.num_kv_heads, shape.head_dim)
  v = normal(shape.batch, shape.k_len, shape.num_kv_heads, shape.value_dim)
  delta = (-2 * math.pi * torch.rand(shape.num_heads, shape.head_dim, generator=gen)).to(device)
  return q, k, v, delta


def _grads(fn, args, key_mask):
  import torch
  leaves = [a.detach().requires_grad_() for a in args]
  out = fn(*leaves, key_mask=key_mask)
  return out, torch.autograd.grad(out.float().sum(), leaves)


def check(fn, masked: bool, shape: Shape, device, dtype) -> dict:
  """max |error| / max |reference| of the output and of the worst of dq, dk, dv, dδ on a small
  shape like `shape` (B2 T=S=256, N4), against `pope_reference` on the same inputs in float32.
  The lengths are multiples of the Triton kernels' tiles, as the benchmark's: the kernels it
  compiles (one per autotuning candidate) are those the benchmark runs."""
  small = dataclasses.replace(shape, batch=2, q_len=256, k_len=256,
                              num_heads=4, num_kv_heads=4 * shape.num_kv_heads
                              // shape.num_heads)
  args = random_inputs(small, device, dtype, seed=1)
  mask = _key_mask(small.batch, small.k_len, device) if masked else None
  out, grads = _grads(fn, args, mask)
  ref_out, ref_grads = _grads(pope_reference, args, mask)
  out, ref_out = out.detach(), ref_out.detach()

  def rel(got, want):
    return float((got.float() - want).abs().max() / want.abs().max())
  return {"fwd_rel_err": rel(out, ref_out),
          "grad_rel_err": max(rel(g, w) for g, w in zip(grads, ref_grads))}


def time_ms(call, device, iters: int, max_iters: int, min_ms: float) -> float:
  """Median ms per call of call(): two warm-up calls, then max(iters, min_ms / estimate) calls
  (at most max_iters), each timed by CUDA events (wall clock on CPU)."""
  import torch
  cuda = device.type == "cuda"

  def once() -> float:
    if not cuda:
      start = time.perf_counter()
      call()
      return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)

  once()
  estimate = once()
  calls = min(max_iters, max(iters, math.ceil(min_ms / max(estimate, 1e-3))))
  return statistics.median(once() for _ in range(calls))


def measure(name: str, shape: Shape, device, dtype, opts) -> dict:
  """One row: correctness on a small shape, then fwd and fwd+bwd ms and TFLOP/s; a failure is
  the row's "error"."""
  import torch
  fn, masked = PATHS[name]
  row = {"name": name}
  if name != SDPA and device.type != "cuda":
    row["skipped"] = "the Triton kernel needs a CUDA device"
    return row
  try:
    row.update(check(fn, masked, shape, device, dtype))
    q, k, v, delta = random_inputs(shape, device, dtype)
    mask = _key_mask(shape.batch, shape.k_len, device) if masked else None
    with torch.no_grad():
      row["fwd_ms"] = time_ms(lambda: fn(q, k, v, delta, key_mask=mask), device, *opts)
    leaves = [a.requires_grad_() for a in (q, k, v, delta)]

    def fwd_bwd():
      out = fn(*leaves, key_mask=mask)
      return torch.autograd.grad(out.float().sum(), leaves)
    row["fwd_bwd_ms"] = time_ms(fwd_bwd, device, *opts)
    flops = shape.forward_flops()
    row["fwd_tflops"] = flops / row["fwd_ms"] * 1e-9
    row["fwd_bwd_tflops"] = 2.5 * flops / row["fwd_bwd_ms"] * 1e-9
  except Exception as e:  # A failing row is reported in the table, never hidden.
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    traceback.print_exc()
  return row


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m experiments.bench_attention_torch", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="bench_attention_torch.json", help="JSON results file")
  parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                      help=f"comma-separated, of: {', '.join(SHAPES)}")
  parser.add_argument("--rows", default=",".join(ROWS),
                      help=f"comma-separated, of: {', '.join(ROWS)}")
  parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  parser.add_argument("--iters", type=int, default=3, help="least timed calls per measurement")
  parser.add_argument("--max-iters", type=int, default=100, help="most timed calls")
  parser.add_argument("--min-ms", type=float, default=300.0,
                      help="timed calls per measurement last at least this long (estimated)")
  args = parser.parse_args(argv)
  args.shapes = [n.strip() for n in args.shapes.split(",") if n.strip()]
  if not args.shapes or (unknown := [n for n in args.shapes if n not in SHAPES]):
    parser.error(f"--shapes: unknown {unknown if args.shapes else 'none given'}; "
                 f"give some of {list(SHAPES)}")
  args.rows = [n.strip() for n in args.rows.split(",") if n.strip()]
  if not args.rows or (unknown := [n for n in args.rows if n not in ROWS]):
    parser.error(f"--rows: unknown {unknown if args.rows else 'none given'}; "
                 f"give some of {list(ROWS)}")
  if args.iters < 1 or args.max_iters < args.iters or args.min_ms < 0:
    parser.error(f"--iters {args.iters}, --max-iters {args.max_iters}, --min-ms {args.min_ms}: "
                 "need 1 <= iters <= max-iters and min-ms >= 0")
  return args


def main(argv=None):
  args = parse_args(argv)
  try:
    import torch  # Optional: only this script needs it.
  except ImportError as e:
    raise SystemExit(f"bench_attention_torch needs torch: {e}") from e
  if args.device == "cuda" and not torch.cuda.is_available():
    raise SystemExit("bench_attention_torch: no CUDA device (use --device cpu --shapes tiny)")
  device, dtype = torch.device(args.device), torch.bfloat16
  results = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
             "device": (torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
             "dtype": "bfloat16", "bench": {}}
  try:
    import triton
    results["triton"] = triton.__version__
  except ImportError:
    pass
  print(results, flush=True)
  opts = (args.iters, args.max_iters, args.min_ms)
  for shape_name in args.shapes:
    shape = SHAPES[shape_name]
    rows = [measure(name, shape, device, dtype, opts) for name in args.rows]
    print(f"\n== {shape_name}: {shape} | FLOPs fwd {shape.forward_flops():.3e} (fwd+bwd 2.5x)")
    print(f"{'implementation':34s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'fwd+bwd ms':>10s} "
          f"{'TFLOP/s':>8s} {'fwd err':>8s} {'grad err':>8s}")
    for r in rows:
      if "skipped" in r:
        print(f"{r['name']:34s} skipped: {r['skipped']}")
        continue
      if "error" in r:
        print(f"{r['name']:34s} FAILED {r['error']}")
        continue
      print(f"{r['name']:34s} {r['fwd_ms']:8.3f} {r['fwd_tflops']:8.1f} {r['fwd_bwd_ms']:10.3f} "
            f"{r['fwd_bwd_tflops']:8.1f} {r['fwd_rel_err']:8.1e} {r['grad_rel_err']:8.1e}",
            flush=True)
    results["bench"][shape_name] = {"shape": dataclasses.asdict(shape),
                                    "flops_fwd": shape.forward_flops(), "rows": rows}
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
