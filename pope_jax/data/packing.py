"""Segment ids and positions of packed documents: the model's view of a window that holds several.

A packed window concatenates documents; `segment_ids` tell the attention which tokens belong to
one document (a query sees a key only in its own segment), and `positions` restart at 0 where a
document starts, so each document is encoded as if it stood alone. A document that began before
the window (its start was cut off) is segment 0 and counts its positions from the window start,
as an unpacked window of a long document does.

Shape letters: T window length.
"""

from __future__ import annotations

import numpy as np


def document_segments(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(segment_ids, positions) of one window from where its documents start.

  Args:
    starts: [T] bool, True where a token begins a document (e.g. BOS, or GPT-2's end-of-text
      token between documents).

  Returns:
    segment_ids: [T] int32, 0 for the tokens before the first start (or from it, if token 0
      starts a document), +1 at every later start.
    positions: [T] int32, the index of each token within its document in this window.

  Raises:
    ValueError: starts is not one-dimensional.
  """
  starts = np.asarray(starts, bool)
  if starts.ndim != 1:
    raise ValueError(f"starts must be [T], got shape {starts.shape}")
  segment_ids = np.cumsum(starts).astype(np.int32)
  segment_ids -= segment_ids[:1]
  index = np.arange(starts.size)
  first = np.maximum.accumulate(np.where(starts, index, 0))
  return segment_ids, (index - first).astype(np.int32)
