"""The daemon's native path for cached layers (``cached_hits.h``): a Unix lookup whose rows are all in the
row cache is answered without the interpreter, under the cache's own lock and reader epochs; any lookup with
a miss or an id outside the layer goes to Python as before. Bytes are compared with ``TableSet.read_rows``,
also while another client's misses evict the rows being read."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables

from engram_store import errors
from engram_store.client.client import EngramClient
from engram_store.daemon.unix import fastpath

pytestmark = pytest.mark.skipif(fastpath.native_module() is None, reason="_unixfast is not built")

LAYER = 3


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=31)


def start(tables, workdir, dram: str, *flags: str) -> DaemonProcess:
    return DaemonProcess(tables.directory, workdir, dram_bytes=dram, extra=["--store-mode", "cached", *flags]).start()


def delta(after: dict, before: dict, key: str) -> float:
    return after[key] - before[key]


def test_all_hit_lookups_are_answered_natively_and_exact(tables, tmp_path):
    d = start(tables, tmp_path, "1MiB")  # holds every row asked for below
    try:
        rng = np.random.default_rng(1)
        hot = rng.integers(0, tables.rows(LAYER), 300)
        with EngramClient.connect(d.unix) as client:
            assert client.info()["unix_native"]
            s0 = client.stats()
            np.testing.assert_array_equal(client.lookup(LAYER, hot), expected(tables, LAYER, hot))  # misses: Python
            s1 = client.stats()
            assert delta(s1, s0, "unix_native_requests") == 0 and delta(s1, s0, "store_rows_nvme") > 0
            for shape in [(300,), (10, 30)]:  # every row cached now: native, duplicates and all
                ids = hot[rng.permutation(300)].reshape(shape)
                np.testing.assert_array_equal(client.lookup(LAYER, ids), expected(tables, LAYER, ids))
            s2 = client.stats()
            assert delta(s2, s1, "unix_native_requests") == 2
            assert delta(s2, s1, "store_rows_dram") == 600 and delta(s2, s1, "store_rows_nvme") == 0
            mixed = np.concatenate([hot[:50], rng.integers(0, tables.rows(LAYER), 50)])  # a miss: Python
            np.testing.assert_array_equal(client.lookup(LAYER, mixed), expected(tables, LAYER, mixed))
            with pytest.raises(errors.RowOutOfRange):  # cached rows and one outside the layer: Python's error
                client.lookup(LAYER, np.append(hot[:5], tables.rows(LAYER)))
            np.testing.assert_array_equal(client.lookup(LAYER, hot[:5]), expected(tables, LAYER, hot[:5]))
            s3 = client.stats()
            assert delta(s3, s2, "unix_native_requests") == 1, "only the last lookup was all hits and in range"
    finally:
        d.stop()


def test_python_path_only_when_unix_native_is_off(tables, tmp_path):
    d = start(tables, tmp_path, "1MiB", "--no-unix-native")
    try:
        ids = np.arange(100)
        with EngramClient.connect(d.unix) as client:
            for _ in range(3):
                np.testing.assert_array_equal(client.lookup(LAYER, ids), expected(tables, LAYER, ids))
            assert client.stats()["unix_native_requests"] == 0 and not client.info()["unix_native"]
    finally:
        d.stop()


def test_hits_stay_exact_while_another_client_evicts_them(tables, tmp_path):
    """A small cache: one client reads six sets in turn, each twice (the second time natively when all
    of it is still cached), more rows than the cache holds, so the sets evict one another; another
    client reads random rows, whose admissions evict too. Every answer is exact."""
    d = start(tables, tmp_path, "160KiB")  # about 2,000 slots of 66-byte rows (plus the policy's bytes)
    stop = threading.Event()
    wrong: list[str] = []

    def churn() -> None:
        rng = np.random.default_rng(2)
        with EngramClient.connect(d.unix) as client:
            while not stop.is_set():
                ids = rng.integers(0, tables.rows(LAYER), 200)
                if not np.array_equal(client.lookup(LAYER, ids), expected(tables, LAYER, ids)):
                    wrong.append("churn")

    try:
        rng = np.random.default_rng(3)
        sets = [rng.choice(tables.rows(LAYER), 400, replace=False) for _ in range(6)]
        wants = [expected(tables, LAYER, ids) for ids in sets]
        worker = threading.Thread(target=churn)
        worker.start()
        try:
            with EngramClient.connect(d.unix) as client:
                before = client.stats()
                deadline, rounds = time.monotonic() + 4, 0
                while time.monotonic() < deadline:
                    k = rounds // 2 % len(sets)
                    if not np.array_equal(client.lookup(LAYER, sets[k]), wants[k]):
                        wrong.append(f"round {rounds}")
                    rounds += 1
                after = client.stats()
        finally:
            stop.set()
            worker.join()
        assert not wrong, wrong[:5]
        native = delta(after, before, "unix_native_requests")
        assert native > 10 and delta(after, before, "store_rows_nvme") > 0, (native, rounds)
        assert delta(after, before, "store_cache_evicted_rows") > 10 * 400, "the sets were evicted again and again"
    finally:
        d.stop()


def test_a_native_reader_holds_its_epoch_while_it_copies_slots():
    """In process, over a socket pair: while the native path copies a large all-hit lookup out of the
    cache's slots, the cache's guard shows its reader registered (evicted slots are not reused before it
    leaves), and no reader is left once it answered. The rows equal the bytes admitted."""
    from engram_store.storage.row_cache import RowCache

    rows, row_bytes, n = 200_000, 264, 65_536
    cache = RowCache({7: rows}, row_bytes, n_slots=rows, huge=False)
    data = np.random.default_rng(4).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    all_rows = np.arange(rows)
    for lo in range(0, rows, cache.admit_limit):
        cache.admit(7, all_rows[lo: lo + cache.admit_limit], data[lo: lo + cache.admit_limit])
    registered = 0
    try:
        # The poller sees the reader only while it copies (milliseconds): on a loaded machine a lookup may
        # pass unseen, so up to 5 lookups; a reader that never registers is never seen.
        for attempt in range(5):
            registered = max(registered, _one_lookup(cache, data, attempt, n, row_bytes, rows))
            if registered:
                break
        assert registered == 1, "the reader copied slots without registering its epoch"
    finally:
        cache.close()


def _one_lookup(cache, data: np.ndarray, seed: int, n: int, row_bytes: int, rows: int) -> int:
    """One all-hit native lookup of ``n`` rows over a socket pair, checked; the most readers the poller saw."""
    from engram_store.wire import frames as wire

    ids = np.random.default_rng(5 + seed).integers(0, rows, n)
    region = np.zeros(n * 8 + n * row_bytes, dtype=np.uint8)
    region[: n * 8].view(np.int64)[:] = ids
    ours, theirs = socket.socketpair()
    conn = fastpath.native_module().Conn(theirs.fileno(), region, np.empty(n, np.int64), {}, row_bytes, 256, 1, n, 0,
                                         cache.native_views())
    guard, seen = cache.lock, []
    try:
        reader = threading.Thread(target=lambda: seen.append(conn.next()))
        reader.start()
        ours.sendall(wire.pack_lookup(1, 7, n, 0, n * 8))
        registered = 0
        while reader.is_alive():
            with guard:
                registered = max(registered, guard.readers)
        reader.join()
        assert seen[0][:3] == (fastpath.SERVED, 7, n), seen
        assert wire.Frame.unpack(ours.recv(wire.FRAME.size)).status == wire.Status.OK
        np.testing.assert_array_equal(region[n * 8:].reshape(n, row_bytes), data[ids])
        with guard:
            assert guard.readers == 0 and guard.oldest() is None
        return registered
    finally:
        conn.close()
        ours.close()
        theirs.close()
