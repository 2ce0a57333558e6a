"""A read that gives way: the io_uring reader's ``stop`` flag (native/readers/_uring.c), the NVMe tier's ``rows_read``, and
the hint reader interrupted by a lookup (its read published as failed, so the lookup reads its rows itself; the
rest of the hint read later). Bytes against the file; counters, never timings."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from support.storage_helpers import FLASH, cache_budget, check_rows, make_tables

from engram_store.format.layout import PAGE_BYTES
from engram_store.native import syscalls
from engram_store.native.readers import aio, uring
from engram_store.storage.hint_queue import HintSettings
from engram_store.storage.tiered import TieredStore

needs_uring = pytest.mark.skipif(uring.probe() is not None, reason=f"io_uring reader unavailable: {uring.probe()}")
PAGES = 4096


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "pages.bin"
    data = np.random.default_rng(0).integers(0, 256, size=PAGES * PAGE_BYTES, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    f = syscalls.open_direct(path)
    try:
        yield f, data.reshape(PAGES, PAGE_BYTES)
    finally:
        f.close()


def request(pages: np.ndarray, row_bytes: int = 64):
    """One read per page, its first ``row_bytes`` bytes the row."""
    n = len(pages)
    return (pages * PAGE_BYTES, np.full(n, PAGE_BYTES, dtype=np.int64), np.arange(n + 1, dtype=np.int64),
            np.zeros(n, dtype=np.int64))


@needs_uring
def test_a_raised_stop_queues_nothing_and_a_low_one_reads_everything(data_file):
    f, data = data_file
    reader = uring.UringReader(8)
    pages = np.arange(0, PAGES, 7, dtype=np.int64)
    try:
        for raised, want in ((1, 0), (0, len(pages))):
            out = np.zeros((len(pages), 64), np.uint8)
            got, bad, done = reader.read_rows(f.fd, out, 64, *request(pages), stop=np.array([raised], np.int32))
            assert done == want and got == want * PAGE_BYTES and len(bad) == 0
            np.testing.assert_array_equal(out[:want], data[pages[:want], :64])
            assert not out[want:].any()
        assert len(reader.read_rows(f.fd, np.zeros((len(pages), 64), np.uint8), 64, *request(pages))) == 2
    finally:
        reader.close()


@needs_uring
def test_a_stop_raised_during_the_read_ends_it_after_the_reads_in_flight(data_file):
    f, data = data_file
    reader = uring.UringReader(1)
    pages = np.random.default_rng(1).permutation(PAGES).astype(np.int64)
    stop = np.zeros(1, np.int32)
    out = np.zeros((len(pages), 64), np.uint8)

    def raise_once_rows_arrive() -> None:  # the read has begun: rows land in out as their pages come
        while not out[:, 0].any() and not stop[0]:
            time.sleep(0.0005)
        stop[0] = 1

    raiser = threading.Thread(target=raise_once_rows_arrive)
    try:
        raiser.start()
        got, bad, done = reader.read_rows(f.fd, out, 64, *request(pages), queue_depth=1, stop=stop)
        stop[0] = 1
        raiser.join()
        assert 0 < done < len(pages), done  # 4,096 reads one at a time outlast the raiser's wake-up
        assert got == done * PAGE_BYTES
        np.testing.assert_array_equal(out[:done], data[pages[:done], :64])  # exactly the extents it says
        assert not out[done:].any()
    finally:
        reader.close()


def test_a_reader_that_does_not_watch_stop_reads_everything(data_file):
    if not aio.available():
        pytest.skip("the AIO reader is not built")
    f, data = data_file
    reader = aio.AioReader(8)
    pages = np.arange(0, 64, dtype=np.int64)
    out = np.zeros((64, 64), np.uint8)
    scratch = syscalls.aligned_buffer(8 * PAGE_BYTES)
    got, bad, done = reader.read_rows(f.fd, out, 64, *request(pages), scratch, stop=np.array([1], np.int32))
    assert done == 64
    np.testing.assert_array_equal(out, data[pages, :64])


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("reader-stop"), FLASH)


@needs_uring
def test_the_nvme_tier_says_which_rows_a_stopped_read_left(tables):
    layer = FLASH.layers[-1]
    with TieredStore.open(tables, dram_bytes=cache_budget(FLASH, 0.1), mode="cached", reader="uring") as store:
        rows = np.unique(np.random.default_rng(2).choice(FLASH.rows(layer), 2000, replace=False))
        out = np.zeros((len(rows), FLASH.row_bytes), np.uint8)
        rs = store.parts.nvme.read_rows(layer, rows, out, stop=np.array([1], np.int32))
        assert rs.rows_read == 0 and rs.pages == 0 and not out.any()
        rs = store.parts.nvme.read_rows(layer, rows, out, stop=np.array([0], np.int32))
        assert rs.rows_read is None and rs.pages > 0
        check_rows(store, tables, FLASH, layer, rows, out)


@needs_uring
def test_a_lookup_interrupts_the_hint_reader_and_every_page_is_read_once_and_exact(tables):
    """A hint at one read in flight (slow), then lookups of its rows while it reads: the lookups raise the stop
    flag, take what the hint read before it gave way and read the rest themselves; the hint reads what is left
    afterwards. One row a page, so every page is read exactly once, by one of them; bytes exact; every hinted
    row accounted for."""
    layer = FLASH.layers[-1]
    settings = HintSettings(cache_share=0.9, queue_depth=1)
    with TieredStore.open(tables, dram_bytes=cache_budget(FLASH, 0.6), mode="cached", reader="uring",
                          hints=settings) as store:
        rpp = store.parts.files[layer].layout.rows_per_page
        rows = np.random.default_rng(3).choice(FLASH.rows(layer) // rpp, 4000, replace=False) * rpp
        assert store.hint(layer, rows, key=1, holder="h") == len(rows)
        out = np.empty((500, FLASH.row_bytes), np.uint8)
        for lo in range(0, 4000, 500):  # the hint's own rows, a slice at a time, while it reads them
            store.lookup_into(layer, rows[lo: lo + 500], out)
            check_rows(store, tables, FLASH, layer, rows[lo: lo + 500], out)
        for _ in range(400):
            if store.hints_idle():
                break
            threading.Event().wait(0.05)
        st = store.stats()
        assert st["hint_rows_pending"] == 0
        assert st["nvme_pages_read"] + st["hint_pages_read"] == len(rows)  # each page once
        assert st["nvme_rows_distinct"] > 0  # the lookups read part of it themselves
        assert st["hint_rows_read"] + st["hint_rows_skipped"] == len(rows)
        again = store.lookup_into(layer, rows[:500], out)
        assert again.rows_nvme == 0


def test_inflight_a_read_that_gave_way_covers_only_what_it_read_and_a_kept_read_until_released():
    from engram_store.storage.inflight import InFlight

    flight = InFlight()
    hint, mine, _ = flight.claim(14, np.array([2, 4, 6, 8]), hint=True)
    assert flight.lookups_reading == 0 and not flight.hint_stop[0]
    with flight.reading():  # a lookup's reads: the hint read is told to give way
        assert flight.hint_stop[0] == 1 and not flight.wait_for_lookups(0.01)
        flight.done(hint, np.arange(8, dtype=np.uint8).reshape(4, 2), valid=2, keep=True)  # rows 2 and 4 read
        look, mine, waits = flight.claim(14, np.array([4, 8]))
        assert look.rows.tolist() == [8] and len(waits) == 1  # 8 was never read: it is this lookup's to read
        out = np.zeros((2, 2), np.uint8)
        assert waits[0].take(out).tolist() == [True] and out[0].tolist() == [2, 3]
        flight.done(look, out[1:], keep=True)
    assert not flight.wait_for_lookups(0.01)  # its kept read still counts: its rows are not in the cache yet
    assert flight.claim(14, np.array([8]), hint=True)[0] is None  # nor read again meanwhile
    flight.release(look)
    flight.release(hint)
    assert flight.wait_for_lookups(0.01)
    assert flight.claim(14, np.array([8]), hint=True, cached=lambda r: r == 8)[0] is None  # in DRAM now: left out


def test_a_small_lookup_never_waits_behind_a_much_larger_read():
    from engram_store.storage.inflight import WAIT_MAX_ROWS, InFlight

    flight = InFlight()
    chunk, _, _ = flight.claim(14, np.arange(0, 4 * WAIT_MAX_ROWS, 2))  # a prefill chunk's misses, in progress
    step, mine, waits = flight.claim(14, np.arange(100, 140))  # a decode step's, some of them in the chunk's read
    assert not waits and step.rows.tolist() == list(range(100, 140))  # it reads them itself
    peer, _, waits = flight.claim(14, np.arange(0, 4 * WAIT_MAX_ROWS, 2))  # a TP rank's identical chunk: it waits
    assert peer is None and len(waits) == 1
    flight.done(chunk, np.zeros((2 * WAIT_MAX_ROWS, 2), np.uint8), keep=True)  # read, kept: anyone takes its rows
    again, _, waits = flight.claim(14, np.arange(0, 10, 2))
    assert again is None and len(waits) == 1
