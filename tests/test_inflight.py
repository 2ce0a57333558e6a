"""Reads in flight are shared: concurrent lookups of the same cold rows of a cached layer (SGLang's TP
ranks ask identical rows) read each page once, in the store and through the daemon; each gets exact
bytes (``TableSet.read_rows``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess

from engram_store import TieredStore
from engram_store.fetch.job import FetchJob
from engram_store.format.layout import PageLayout
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.storage.inflight import InFlight

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
LAYER = SPEC.layers[-1]
CLIENTS = 8


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=31)


def pages_of(ids: np.ndarray) -> int:
    return len(np.unique(ids // PageLayout(SPEC.rows(LAYER), SPEC.row_bytes).rows_per_page))


def concurrently(n: int, fn) -> list:
    barrier, results, errors = threading.Barrier(n), [None] * n, []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_claims_split_rows_between_a_reader_and_its_waiters():
    flight = InFlight()
    first, mine, waits = flight.claim(LAYER, np.array([3, 5, 9, 12]))
    assert list(first.rows) == [3, 5, 9, 12] and list(mine) == [0, 1, 2, 3] and waits == []
    second, mine2, waits2 = flight.claim(LAYER, np.array([1, 5, 12, 40]))
    assert list(second.rows) == [1, 40] and list(mine2) == [0, 3]
    (wait,) = waits2
    assert list(wait.at) == [1, 2] and list(wait.pos) == [1, 3]
    assert flight.claim(LAYER - 1, np.array([5]))[0] is not None  # another layer: nothing shared
    out = np.zeros((4, 2), np.uint8)
    flight.done(first, np.arange(8, dtype=np.uint8).reshape(4, 2))
    assert wait.take(out).all() and out[1].tolist() == [2, 3] and out[2].tolist() == [6, 7]
    flight.done(second, None)  # a failed read: its waiters read for themselves
    third, _, waits3 = flight.claim(LAYER, np.array([40]))
    assert third is not None and not waits3


def test_concurrent_identical_lookups_read_each_page_once_in_the_store(tables):
    store = TieredStore.open(tables.directory, dram_bytes=4 << 20, mode="cached")
    try:
        ids = np.random.default_rng(1).integers(0, SPEC.rows(LAYER), 6144)
        outs = [np.empty((ids.size, SPEC.row_bytes), np.uint8) for _ in range(CLIENTS)]
        concurrently(CLIENTS, lambda i: store.lookup_into(LAYER, ids, outs[i]))
        want = tables.read_rows(LAYER, ids)
        for out in outs:
            np.testing.assert_array_equal(out, want)
        stats = store.stats()
        assert stats["nvme_pages_read"] == pages_of(ids), stats  # not CLIENTS times
        assert stats["nvme_rows_shared"] > 0, stats
    finally:
        store.close()


def test_concurrent_identical_fetches_through_the_daemon_read_each_page_once(tables, tmp_path):
    from engram_store.client.client import EngramClient

    with DaemonProcess(tables.directory, tmp_path, dram_bytes="4MiB", extra=["--store-mode", "cached"]) as d:
        jobs = [FetchJob(d.unix, LAYER, 6144) for _ in range(CLIENTS)]
        try:
            ids = np.random.default_rng(2).integers(0, SPEC.rows(LAYER), 6144)
            for job in jobs:
                job.ids[: ids.size] = ids
            concurrently(CLIENTS, lambda i: jobs[i].run(ids.size))  # the runs release the GIL
            want = tables.read_rows(LAYER, ids)
            for job in jobs:
                np.testing.assert_array_equal(np.concatenate([job.weight[: ids.size], job.scales[: ids.size]], 1), want)
                assert job.stats()["daemon_steps"] == 1
            with EngramClient.connect(d.unix) as client:
                stats = client.stats()
        finally:
            for job in jobs:
                job.close()
    pages = stats.get("store_nvme_pages_read", stats.get("engram_store_nvme_pages_read_total"))
    assert pages == pages_of(ids), stats
