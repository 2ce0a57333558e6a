"""A fetch job's call records (the run function's argument a captured CUDA graph bakes in: one per row
count) stay bounded however many distinct row counts an engine launches: found in O(1), made a chunk of
256 counts at a time, none for synchronous runs; every record stays where it was handed out, and runs
through records of many counts give exact rows (``TableSet.read_rows``)."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess

from engram_store.fetch.job import FetchJob
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
LAYER = SPEC.layers[1]
MAX_ROWS = 3000  # 12 chunks of 256 row counts
DIM = SPEC.row_format.dim


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=41)


@pytest.fixture
def job(tables, tmp_path):
    d = DaemonProcess(tables.directory, tmp_path, dram_bytes="256MiB").start()
    j = FetchJob(d.unix, LAYER, MAX_ROWS, hedge=2.0)
    try:
        yield j
    finally:
        j.close()
        d.stop()


def exact(job: FetchJob, tables, ids: np.ndarray) -> None:
    want = tables.read_rows(LAYER, ids)
    np.testing.assert_array_equal(job.weight[: ids.size], want[:, :DIM])
    np.testing.assert_array_equal(job.scales[: ids.size], want[:, DIM:])


def test_every_row_count_keeps_the_records_bounded_and_exact(job, tables):
    max_rows = job.max_rows
    chunks = max_rows // 256 + 1
    rng = np.random.default_rng(5)
    for n in rng.permutation(max_rows + 1)[:400]:  # synchronous runs of 400 distinct counts: no record
        ids = rng.integers(0, SPEC.rows(LAYER), n)
        job.ids[:n] = ids
        job.run(int(n))
        exact(job, tables, ids)
    assert job.stats()["call_records"] == 0
    first = {n: job.native.call_address(n) for n in range(max_rows + 1)}  # every count an engine could launch
    assert len(set(first.values())) == max_rows + 1
    assert job.stats()["call_records"] == chunks * 256  # bounded by the staging, whatever the order
    again = {n: job.native.call_address(n) for n in reversed(range(max_rows + 1))}
    assert again == first  # where a captured graph's host node points stays valid
    assert job.stats()["call_records"] == chunks * 256
    with pytest.raises(ValueError, match="0..%d rows" % max_rows):
        job.native.call_address(max_rows + 1)
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(job.native.run_address)  # as a replayed graph calls it
    for n in (1, 255, 256, 257, max_rows // 2, max_rows):
        ids = rng.integers(0, SPEC.rows(LAYER), n)
        job.ids[:n] = ids
        run(first[n])
        job.raise_if_failed()
        exact(job, tables, ids)


def test_the_lookup_costs_the_same_with_many_records(job):
    """O(1): a count's record is found as fast with every count's record made as with one."""

    def per_call(n: int) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                job.native.call_address(n)
            best = min(best, time.perf_counter() - t0)
        return best / 2000

    job.native.call_address(job.max_rows)
    few = per_call(job.max_rows)  # the only record
    for n in range(job.max_rows):
        job.native.call_address(n)
    many = per_call(job.max_rows - 1)  # the last of 3001 made (the end of a list scan before)
    assert many < few * 3, (few, many)
