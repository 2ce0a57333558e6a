"""``_gather.bump_uint8`` (the native ``bump_counts`` S3-FIFO's hit counts go through): success and a bad
index are told apart for every bad index, -1 included, and a refused call writes nothing."""

import numpy as np
import pytest

native = pytest.importorskip("engram_store.native._gather")
FREQ_MAX = 3


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("bad", [-1, -2, 4, 1 << 30])
def test_a_bad_index_is_refused_and_nothing_is_written(dtype, bad):
    counts = np.array([0, 1, 2, 3], np.uint8)
    with pytest.raises(IndexError, match=rf"index {bad} \(position 1\) is outside \[0, 4\)"):
        native.bump_uint8(counts, np.array([1, bad], dtype), FREQ_MAX)
    np.testing.assert_array_equal(counts, [0, 1, 2, 3])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_good_indices_still_count(dtype):
    counts = np.array([0, 1, 2, 3], np.uint8)
    assert native.bump_uint8(counts, np.array([1, 3, 0, 1], dtype), FREQ_MAX) is None
    np.testing.assert_array_equal(counts, [1, 2, 2, 3])  # index 1 listed twice counts once (numpy's semantics)
