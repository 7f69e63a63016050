"""The reference for masked PoPE attention with segment ids: PoPE written as "map q, k to
Cartesian form, then ordinary attention", with the mask built from the rule: query t sees key s
iff key_mask[s], seg_q[t] == seg_k[s] and, when causal, pos_k[s] <= pos_q[t]."""

import math

from pope_jax import attention, encodings, positions


def reference(q, k, v, delta, *, is_causal, key_mask=None, segment_ids=None, multiplier=None):
  """PoPE as Cartesian vectors, then attention with the mask of the rule (float32)."""
  b, t_len, n, h = q.shape
  q_pos, k_pos, _ = positions.resolve(b, t_len, k.shape[1], None, None, None)
  mask = positions.attention_mask(q_pos, k_pos, is_causal=is_causal, k_valid=key_mask)
  if segment_ids is not None:
    q_seg, k_seg = segment_ids
    same = q_seg[:, :, None] == k_seg[:, None, :]
    mask = same if mask is None else mask & same
  qc = encodings.pope_cartesian(q, q_pos, phase=-encodings.clamp_phase_bias(delta),
                                multiplier=multiplier)
  kc = encodings.pope_cartesian(k, k_pos, multiplier=encodings.kv_head_multiplier(
      multiplier, n, k.shape[2]))
  return attention.dot_product_attention_reference(qc, kc, v, scale=1 / math.sqrt(h), mask=mask)
