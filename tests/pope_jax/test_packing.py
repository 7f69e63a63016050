"""Segment ids and restarting positions of packed documents (hand-checked values)."""

import numpy as np
import pytest

from pope_jax.data.packing import document_segments


@pytest.mark.parametrize("starts, segments, positions", [
    ([1, 0, 0, 1, 0, 1, 1, 0], [0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 2, 0, 1, 0, 0, 1]),
    ([0, 0, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 0, 1, 2]),       # A document cut off at the start.
    ([0, 0, 0], [0, 0, 0], [0, 1, 2]),
])
def test_document_segments(starts, segments, positions):
  seg, pos = document_segments(np.asarray(starts, bool))
  np.testing.assert_array_equal(seg, segments)
  np.testing.assert_array_equal(pos, positions)
  assert seg.dtype == pos.dtype == np.int32


def test_document_segments_wants_one_window():
  with pytest.raises(ValueError, match=r"starts must be \[T\]"):
    document_segments(np.zeros((2, 3), bool))
