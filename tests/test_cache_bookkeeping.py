"""The row cache's native bookkeeping (``_gather.take_int32``, ``_gather.bump_uint8``) against numpy, which
is what the cache does without it: the same slots found, the same S3-FIFO hit counts (an index listed
twice in one lookup counts once, as numpy's fancy assignment does), bounds refused."""

import numpy as np
import pytest

from engram_store.native import load
from engram_store.storage.policies.s3fifo import FREQ_MAX

native = load("_gather", "skipped")
pytestmark = pytest.mark.skipif(native is None, reason="engram_store.native._gather is not built")


def test_take_int32_equals_numpy_indexing():
    rng = np.random.default_rng(0)
    table = rng.integers(-5, 1 << 30, 1 << 20).astype(np.int32)
    for n in (0, 1, 11, 13, 6144):
        index = rng.integers(0, len(table), n)
        out = np.full(n, -7, np.int32)
        native.take_int32(table, index, out)
        np.testing.assert_array_equal(out, table[index])
    with pytest.raises(IndexError, match=r"index 1048576 is outside \[0, 1048576\)"):
        native.take_int32(table, np.array([3, len(table)]), np.empty(2, np.int32))
    with pytest.raises(IndexError):
        native.take_int32(table, np.array([-1]), np.empty(1, np.int32))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_bump_uint8_equals_numpys_saturating_fancy_assignment(dtype):
    rng = np.random.default_rng(1)
    for _ in range(50):
        counts = rng.integers(0, FREQ_MAX + 1, 4096).astype(np.uint8)
        slots = rng.integers(0, len(counts), 700).astype(dtype)  # repeats included
        want = counts.copy()
        want[slots] = np.minimum(want[slots], FREQ_MAX - 1) + 1
        native.bump_uint8(counts, slots, FREQ_MAX)
        np.testing.assert_array_equal(counts, want)
    with pytest.raises(IndexError, match="outside"):
        native.bump_uint8(np.zeros(4, np.uint8), np.array([4], dtype), FREQ_MAX)
