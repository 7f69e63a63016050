"""RoPE and PoPE: the one definition of the positional-encoding math.

Every model, reference attention and kernel wrapper in this project derives its frequencies and
angles here. Angles are always computed in float32 from integer positions.

Shape letters: B batch, T sequence length, N heads, H head dim, F number of frequencies
(H/2 for RoPE, H for PoPE).

Sources:
  RoPE: Su et al., "RoFormer", arXiv 2104.09864, Eq. 15 (θ_i = base^(-2(i-1)/H)); the half-split
    ("rotate_half") layout of Hugging Face transformers and the interleaved-pair layout of the paper.
  PoPE: Gopalakrishnan et al., "Decoupling the 'What' and 'Where' With Polar Coordinate Positional
    Embeddings", arXiv 2509.10534: Eq. 3 (softplus magnitudes), Eq. 4 (H frequencies
    θ_c = base^(-(c-1)/H)), Eq. 5/6 (score), Eq. 7-10 (Cartesian form).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from pope_jax import checks

Array = jax.Array

TWO_PI = 2.0 * math.pi
RopeLayout = Literal["half", "interleaved"]


def rope_frequencies(head_dim: int, base: float = 10000.0) -> Array:
  """RoPE frequencies θ_i = base^(-2i/H), i = 0..H/2-1 (RoFormer Eq. 15).

  Args:
    head_dim: H, must be even.
    base: the RoPE base (often called θ or rope_theta).

  Returns:
    [H/2] float32, in radians per position.

  Raises:
    ValueError: if head_dim is odd or not positive, or base is not > 1.
  """
  if head_dim <= 0 or head_dim % 2:
    raise ValueError(f"head_dim must be a positive even number for RoPE, got {head_dim}")
  if not base > 1.0:
    raise ValueError(f"base must be > 1, got {base}")
  return base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def pope_frequencies(head_dim: int, base: float = 10000.0) -> Array:
  """PoPE frequencies θ_c = base^(-(c-1)/H), c = 1..H (PoPE Eq. 4): one per component.

  Args:
    head_dim: H, positive.
    base: frequency base (the paper uses 10 000).

  Returns:
    [H] float32, radians per position.

  Raises:
    ValueError: if head_dim is not positive or base is not > 1.
  """
  if head_dim <= 0:
    raise ValueError(f"head_dim must be positive, got {head_dim}")
  if not base > 1.0:
    raise ValueError(f"base must be > 1, got {base}")
  return base ** (-jnp.arange(head_dim, dtype=jnp.float32) / head_dim)


def scale_frequencies(freqs: Array, multiplier: Array | float | None) -> Array:
  """Multiplies frequencies by a scalar or per-head multiplier (PI, LPES, Ms-PoE).

  A multiplier of 1/s is position interpolation by s (Chen et al., arXiv 2306.15595): the angle of
  position m becomes (m/s)·θ.

  Args:
    freqs: [F] float32.
    multiplier: None, a scalar, or [N] (one per head). Traced values are fine.

  Returns:
    [F] if multiplier is None or scalar, else [N, F]; float32.

  Raises:
    ValueError: if multiplier has more than one dimension.
  """
  if multiplier is None:
    return freqs
  m = jnp.asarray(multiplier, jnp.float32)
  if m.ndim == 0:
    return freqs * m
  if m.ndim == 1:
    return m[:, None] * freqs[None, :]
  raise ValueError(f"multiplier must have shape [] or [num_heads], got {m.shape}")


def check_finite_multipliers(multipliers, name: str) -> None:
  """Raises ValueError naming `name` unless concrete `multipliers` (None, a number or an array)
  are finite and > 0 (a NaN, 1/s of a scale s = 0, or 0 and -1, which would freeze or reverse
  positions); traced values are not checked (`pope_jax.checks`)."""
  checks.check_positive_finite(multipliers, name)


def kv_head_multiplier(multiplier, num_heads: int, num_kv_heads: int):
  """The key-side multiplier under GQA: kv head j takes query head j·N/K's entry.

  Per-head multipliers are given per query head ([N]); the query heads of one GQA group share a
  key, so they must agree within the group (a q/k mismatch would break relative positions). The
  agreement is checked for concrete values; under `jit` it is the caller's contract.

  Raises:
    ValueError: concrete multipliers that are not finite, or that differ within a group.

  Args:
    multiplier: None, scalar or [N].
    num_heads, num_kv_heads: N and K, N % K == 0.

  Returns:
    None, the scalar, or [K].
  """
  if multiplier is None or jnp.ndim(multiplier) == 0 or num_heads == num_kv_heads:
    return multiplier
  groups = jnp.asarray(multiplier).reshape(num_kv_heads, num_heads // num_kv_heads)
  if not isinstance(groups, jax.core.Tracer):  # Concrete values: check them.
    check_finite_multipliers(groups.reshape(-1), "multipliers")
    if not bool(jnp.all(groups == groups[:, :1])):
      raise ValueError(f"per-head multipliers must agree within each GQA group of "
                       f"{num_heads // num_kv_heads} query heads, got {groups.tolist()}")
  return groups[:, 0]


def layer_multipliers(multipliers: Array | float | None, num_layers: int, num_heads: int):
  """Normalises frequency multipliers to one per layer, [L], or per layer and head, [L, N]
  float32 (or None).

  A global or per-layer multiplier stays one scalar per layer, so each layer's RoPE angles are
  [T, H/2], not [T, N, H/2]: a traced per-layer scale (LPES) costs the same as none.

  Args:
    multipliers: None, [] (global, e.g. PI), [L] (per layer, LPES) or [L, N] (per layer and head,
      Ms-PoE). A multiplier of 1/s interpolates positions by s.
    num_layers, num_heads: L and N.

  Returns:
    None, [L] for [] and [L], or [L, N].

  Raises:
    ValueError: on any other shape, or concrete multipliers that are not finite and > 0.
  """
  if multipliers is None:
    return None
  check_finite_multipliers(multipliers, "rope_multipliers")
  m = jnp.asarray(multipliers, jnp.float32)
  if m.ndim == 0:
    return jnp.broadcast_to(m, (num_layers,))
  if m.shape in ((num_layers,), (num_layers, num_heads)):
    return m
  raise ValueError(f"rope_multipliers must have shape [], [{num_layers}] or "
                   f"[{num_layers}, {num_heads}], got {m.shape}")


def angles(positions: Array, freqs: Array) -> Array:
  """Angles position·θ in float32.

  Args:
    positions: [T] or [B, T] integer (or float) positions.
    freqs: [F] or [N, F] float32 frequencies.

  Returns:
    [B|1, T, N|1, F] float32.
  """
  pos = jnp.asarray(positions).astype(jnp.float32)
  if pos.ndim == 1:
    pos = pos[None]
  if pos.ndim != 2:
    raise ValueError(f"positions must have shape [T] or [B, T], got {pos.shape}")
  if freqs.ndim == 1:
    freqs = freqs[None]
  return pos[:, :, None, None] * freqs[None, None]


def _check_shapes(x: Array, freqs: Array, name: str, positions: Array) -> None:
  if x.ndim != 4:
    raise ValueError(f"{name} must have shape [B, T, N, H], got {x.shape}")
  if freqs.ndim == 2 and freqs.shape[0] != x.shape[2]:
    raise ValueError(
        f"per-head multiplier has {freqs.shape[0]} entries but {name} has {x.shape[2]} heads")
  b, t = x.shape[:2]
  shape = jnp.shape(positions)
  if shape != (t,) and not (len(shape) == 2 and shape[1] == t
                            and (shape[0] == b or 1 in (b, shape[0]))):  # (batches broadcast)
    raise ValueError(f"positions must have shape [T] = [{t}] or [B, T] = [{b}, {t}] ({name} "
                     f"has shape {x.shape}), got {shape}")


def apply_rope(
    x: Array,
    positions: Array,
    *,
    base: float = 10000.0,
    multiplier: Array | float | None = None,
    layout: RopeLayout = "half",
    frequencies: Array | None = None,
) -> Array:
  """Rotates pairs of x by position·θ (RoPE).

  Args:
    x: [B, T, N, H] queries or keys, any float dtype; H even.
    positions: [T] or [B, T] integer positions.
    base: RoPE base.
    multiplier: None, scalar or [N] frequency multiplier (see `scale_frequencies`).
    layout: "half" pairs component i with i + H/2 (Hugging Face rotate_half);
      "interleaved" pairs 2i with 2i+1 (RoFormer, llama.cpp / GGUF, Meta's original Llama).
    frequencies: optional [H/2] float32 frequencies replacing base^(-2i/H) (for scaled RoPE
      variants such as llama3 or YaRN); `base` is then ignored.

  Returns:
    [B, T, N, H] in x's dtype; the rotation is computed in float32.

  Raises:
    ValueError: odd head dim, bad shapes (x, positions, frequencies, multiplier) or unknown
      layout.
  """
  if x.shape[-1] % 2:
    raise ValueError(f"RoPE needs an even head dim, got x of shape {x.shape}")
  if frequencies is None:
    frequencies = rope_frequencies(x.shape[-1], base)
  elif jnp.shape(frequencies) != (x.shape[-1] // 2,):
    raise ValueError(f"frequencies must have shape [{x.shape[-1] // 2}], got {frequencies.shape}")
  freqs = scale_frequencies(frequencies, multiplier)
  _check_shapes(x, freqs, "x", positions)
  ang = angles(positions, freqs)                                 # [B|1, T, N|1, H/2]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  xf = x.astype(jnp.float32)
  if layout == "half":
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  elif layout == "interleaved":
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
  else:
    raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
  return out.astype(x.dtype)


def clamp_phase_bias(delta: Array) -> Array:
  """Clamps the PoPE phase bias δ to [-2π, 0] (PoPE §3).

  The gradient is one inside the closed range, bounds included, and zero outside it (as
  `torch.clamp`); `jnp.clip` alone would halve it at the bounds, where `delta_init="zeros"`
  starts every δ.
  """
  inside = (delta >= -TWO_PI) & (delta <= 0.0)
  return jnp.where(inside, delta, jnp.clip(delta, -TWO_PI, 0.0))


def init_phase_bias(key: Array, shape: tuple[int, ...], init: str = "uniform") -> Array:
  """Initial PoPE phase bias δ: "zeros" or "uniform" (U(-2π, 0)), float32 (PoPE App. A)."""
  if init == "zeros":
    return jnp.zeros(shape, jnp.float32)
  if init == "uniform":
    return jax.random.uniform(key, shape, jnp.float32, -TWO_PI, 0.0)
  raise ValueError(f"delta_init must be 'zeros' or 'uniform', got {init!r}")


def pope_magnitudes(x: Array) -> Array:
  """μ = softplus(x) in float32 (PoPE Eq. 3)."""
  return jax.nn.softplus(x.astype(jnp.float32))


def pope_cartesian(
    x: Array,
    positions: Array,
    *,
    base: float = 10000.0,
    phase: Array | None = None,
    multiplier: Array | float | None = None,
) -> Array:
  """Maps raw q or k projections to PoPE's Cartesian form (PoPE Eq. 7-10).

  x' = [μ cos(φ), μ sin(φ)] with μ = softplus(x) and φ = position·θ (+ δ for keys), so that
  x'_q · x'_k = Σ_c μq_c μk_c cos((s - t)θ_c + δ_c), the PoPE score (Eq. 5/6).

  Args:
    x: [B, T, N, H] raw projections (before softplus), any float dtype.
    positions: [T] or [B, T] integer positions.
    base: PoPE base.
    phase: None or an extra phase of shape [N, H] float32 added to position·θ (the key-side δ of
      Eq. 5, or -δ on the query side, which gives the same score).
    multiplier: None, scalar or [N] frequency multiplier.

  Returns:
    [B, T, N, 2H] float32.

  Raises:
    ValueError: bad shapes (x, positions, phase, multiplier).
  """
  freqs = scale_frequencies(pope_frequencies(x.shape[-1], base), multiplier)
  _check_shapes(x, freqs, "x", positions)
  ang = angles(positions, freqs)                                  # [B|1, T, N|1, H]
  if phase is not None:
    if phase.shape != x.shape[2:]:
      raise ValueError(f"phase must have shape [num_heads, head_dim] = {x.shape[2:]}, got "
                       f"{phase.shape}")
    phase = phase.astype(jnp.float32)
  return polar_to_cartesian(x, ang, phase)


def _loop_size(x: Array, ang: Array) -> int:
  return math.prod(jnp.broadcast_shapes(x.shape, ang.shape))


def _table(ang: Array, full_size: int) -> tuple[Array, Array]:
  """cos and sin of `ang`, kept out of the per-element loop when smaller than it."""
  trig = (jnp.cos(ang), jnp.sin(ang))
  return jax.lax.optimization_barrier(trig) if ang.size < full_size else trig


def _cos_sin(ang: Array, phase: Array | None, full_size: int) -> tuple[Array, Array]:
  """cos φ and sin φ of φ = ang + phase, from the two factors' own cos and sin.

  The trigonometric functions run on the factors (positions × frequencies, and heads ×
  frequencies), which XLA materialises as small tables; the per-element work is then the
  angle-addition formula (a few multiply-adds), not a float32 cos and sin per element.
  `optimization_barrier` keeps XLA from fusing the tables' trigonometry back into the
  per-element loop; a factor as large as the loop (`full_size` elements, e.g. batched positions
  with per-head multipliers) stays fused.
  """
  cos_a, sin_a = _table(ang, full_size)
  if phase is None:
    return cos_a, sin_a
  cos_p, sin_p = _table(phase, full_size)
  return cos_a * cos_p - sin_a * sin_p, sin_a * cos_p + cos_a * sin_p


@jax.custom_vjp
def polar_to_cartesian(x: Array, ang: Array, phase: Array | None = None) -> Array:
  """[softplus(x) cos φ, softplus(x) sin φ], φ = ang + phase (PoPE Eq. 7-10), hand-written VJP.

  The value is one elementwise expression over the 2H output columns, so XLA computes it in one
  pass (joining two products with a concatenation made it write softplus(x) first); cos φ and
  sin φ come from the factors' tables by angle addition (`_cos_sin`). The gradient is written
  out for the same reason, also one pass per output (autodiff of the column-select form took
  about twice the memory traffic):
    dx = sigmoid(x) (g_cos cos φ + g_sin sin φ),  dφ = softplus(x) (g_sin cos φ - g_cos sin φ),
  with dφ summed over the axes ang and phase were broadcast along. Tested against autodiff of
  the plain formula (tests/pope_jax/test_encodings.py).

  Args:
    x: [B, T, N, H] raw projections, any float dtype.
    ang: float32 angles of x's rank, the two broadcastable ([B|1, T|1, N|1, H]).
    phase: None or a float32 phase broadcastable to x's last axes (e.g. [N, H]).

  Returns:
    [B, T, N, 2H] float32.

  Raises:
    ValueError: ang's rank differs from x's.
  """
  if ang.ndim != x.ndim:
    raise ValueError(f"angles must have x's rank {x.ndim} (broadcastable to {x.shape}), got "
                     f"shape {ang.shape}")
  cos, sin = _cos_sin(ang, phase, _loop_size(x, ang))
  mag = pope_magnitudes(jnp.concatenate([x, x], axis=-1))
  h = cos.shape[-1]
  return mag * jnp.where(jnp.arange(2 * h) < h, jnp.concatenate([cos, cos], axis=-1),
                         jnp.concatenate([sin, sin], axis=-1))


def _polar_to_cartesian_fwd(x, ang, phase):
  return polar_to_cartesian(x, ang, phase), (x, ang, phase)


def _polar_to_cartesian_bwd(res, g):
  x, ang, phase = res
  h = x.shape[-1]
  g_cos, g_sin = g[..., :h].astype(jnp.float32), g[..., h:].astype(jnp.float32)
  xf = x.astype(jnp.float32)
  cos, sin = _cos_sin(ang, phase, _loop_size(x, ang))
  dx = jax.nn.sigmoid(xf) * (g_cos * cos + g_sin * sin)
  d_ang = jax.nn.softplus(xf) * (g_sin * cos - g_cos * sin)
  d_phase = None if phase is None else _sum_to(d_ang, phase.shape).astype(phase.dtype)
  return (_sum_to(dx, x.shape).astype(x.dtype), _sum_to(d_ang, ang.shape).astype(ang.dtype),
          d_phase)


def _sum_to(grad: Array, shape: tuple[int, ...]) -> Array:
  """Sums a gradient over the axes its input was broadcast along, to `shape`."""
  lead = grad.ndim - len(shape)
  axes = tuple(range(lead)) + tuple(
      lead + i for i, s in enumerate(shape) if s == 1 and grad.shape[lead + i] != 1)
  return grad.sum(axis=axes).reshape(shape) if axes else grad


polar_to_cartesian.defvjp(_polar_to_cartesian_fwd, _polar_to_cartesian_bwd)


def yarn_attention_factor(factor: float, attention_factor: float | None = None) -> float:
  """YaRN's attention temperature: 0.1·ln(s) + 1 for s > 1, else 1 (YaRN Eq. 22).

  Hugging Face multiplies both cos and sin by this factor, so q·k logits are scaled by its square
  (the paper's 1/t with sqrt(1/t) = 0.1·ln(s) + 1). An explicit `attention_factor` is returned
  verbatim, as in `transformers.modeling_rope_utils._compute_yarn_parameters`.

  Args:
    factor: the context extension factor s.
    attention_factor: None (derive from s) or an explicit value used as is.

  Returns:
    The factor applied to q and to k (the logits get its square).
  """
  if attention_factor is not None:
    return float(attention_factor)
  return 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0


def yarn_frequencies(
    head_dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    *,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> Array:
  """YaRN "NTK-by-parts" RoPE frequencies (Peng et al., arXiv 2309.00071, §3.2 Eq. 17-19).

  Frequencies that turn more than β_fast times over the original context keep their value
  (extrapolation); those turning fewer than β_slow times are divided by s (interpolation); a linear
  ramp over the pair index blends the two in between. The ramp bounds are the pair indices
  d(r) = H·ln(L_orig / (2π r)) / (2 ln base) for r = β_fast and β_slow, floored/ceiled when
  `truncate` and clipped to [0, H - 1], exactly as Hugging Face's `_compute_yarn_parameters`.

  Args:
    head_dim: H, even.
    base: RoPE base.
    factor: context extension factor s (> 0; s = 1 returns the RoPE frequencies).
    original_max_position: the context length L_orig the model was trained at.
    beta_fast, beta_slow: rotation counts bounding the ramp (YaRN defaults 32 and 1).
    truncate: floor/ceil the ramp bounds (Hugging Face default True).

  Returns:
    [H/2] float32 frequencies, for `apply_rope(..., frequencies=...)`.

  Raises:
    ValueError: if factor or original_max_position is not positive, or beta_fast <= beta_slow.
  """
  if not factor > 0:
    raise ValueError(f"YaRN factor must be positive, got {factor}")
  if original_max_position <= 0:
    raise ValueError(f"original_max_position must be positive, got {original_max_position}")
  if not beta_fast > beta_slow > 0:
    raise ValueError(f"need beta_fast > beta_slow > 0, got {beta_fast} and {beta_slow}")
  freqs = rope_frequencies(head_dim, base)

  def correction_dim(rotations: float) -> float:
    return head_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (
        2 * math.log(base))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # As Hugging Face: avoid a zero-width ramp.
  ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  extrapolation = 1.0 - ramp                       # 1: keep θ_i, 0: θ_i / s.
  return freqs / factor * ramp + freqs * extrapolation
