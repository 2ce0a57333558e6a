"""The io_uring page reader (``native/readers/_uring.c`` behind ``readers/uring.py``).

Rows through a real cached-mode store must equal the reference reader byte for
byte, from several threads at once (a ring each); a page flipped on disk must be
refused; a forked child and a reused fd number must never read through the
parent's ring or a stale registered file; and when the probe says io_uring cannot
run, ``auto`` must log why and fall back to Linux AIO. The crc32c code both native
readers share (``native/common/crc32c.c``) is checked against the numpy reference on every
path it takes.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support.storage_helpers import FLASH, TINY, check_rows, flip, make_tables

from engram_store import errors
from engram_store.format import checksums
from engram_store.format.layout import PAGE_BYTES
from engram_store.native import readers, syscalls
from engram_store.native.readers import aio, open_reader, uring
from engram_store.storage.tiered import TieredStore

pytestmark = pytest.mark.skipif(uring.probe() is not None, reason=f"io_uring reader unavailable: {uring.probe()}")


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "pages.bin"
    data = np.random.default_rng(0).integers(0, 256, size=256 * PAGE_BYTES, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    f = syscalls.open_direct(path)
    assert f.direct, "tmp_path is on a disk file system that supports O_DIRECT"
    try:
        yield f, data, path
    finally:
        f.close()


def _rows_request(pages: np.ndarray, row_bytes: int, slot: np.ndarray):
    """read_rows' extents and row arguments: row ``slot[i]`` of page ``pages[i]``, one read per page."""
    n = len(pages)
    return (pages * PAGE_BYTES, np.full(n, PAGE_BYTES, dtype=np.int64), np.arange(n + 1, dtype=np.int64),
            slot * row_bytes)


# --- through a real store ------------------------------------------------------------------
@pytest.mark.parametrize("qd", [1, 16, 64])
def test_cached_store_rows_are_exact_through_uring(tmp_path, qd):
    tables = make_tables(tmp_path, FLASH)
    with TieredStore.open(tables, dram_bytes=1 << 20, mode="cached", queue_depth=qd, reader="uring") as store:
        assert store.parts.nvme.reader.name == "uring"
        rng = np.random.default_rng(qd)
        for layer in FLASH.layers:
            ids = rng.integers(0, FLASH.rows(layer), 3000)
            out = np.empty((len(ids), FLASH.row_bytes), np.uint8)
            store.lookup_into(layer, ids, out)
            check_rows(store, tables, FLASH, layer, ids, out)
        assert store.stats()["nvme_pages_read"] > 0


def test_store_lookups_from_many_threads_each_get_a_ring(tmp_path):
    tables = make_tables(tmp_path, FLASH)
    layer = FLASH.layers[0]
    with TieredStore.open(tables, dram_bytes=1 << 20, mode="cached", queue_depth=8, reader="uring") as store:
        reader = store.parts.nvme.reader

        def one(seed: int):
            ids = np.random.default_rng(seed).integers(0, FLASH.rows(layer), 2000)
            out = np.empty((len(ids), FLASH.row_bytes), np.uint8)
            for _ in range(3):
                store.lookup_into(layer, ids, out)
            check_rows(store, tables, FLASH, layer, ids, out)
            return threading.get_ident(), reader._local.ring

        with ThreadPoolExecutor(4) as pool:
            used = dict(pool.map(one, range(8)))
            assert len(reader._rings) == len(used) >= 2
        assert len({id(r) for r in used.values()}) == len(used)  # a ring per thread, none shared
        del used
        assert len(reader._rings) == 0  # the rings of finished threads are freed with them


def test_a_page_flipped_on_disk_is_detected_and_refused(tmp_path):
    tables = tmp_path / "copy"
    shutil.copytree(make_tables(tmp_path, TINY), tables)
    layer, rpp = TINY.layers[0], PAGE_BYTES // TINY.row_bytes
    with TieredStore.open(tables, dram_bytes=1 << 20, mode="cached", reader="uring") as store:
        good = np.arange(0, 200, dtype=np.int64)
        check_rows(store, tables, TINY, layer, good, store.lookup(layer, good).reshape(len(good), -1))
        flip(tables, layer, 20)
        with pytest.raises(errors.CorruptRows, match=f"layer {layer}: .*page 20 at file offset {20 * PAGE_BYTES}"):
            store.lookup(layer, np.array([3, 20 * rpp + 1], dtype=np.int64))
        others = np.setdiff1d(np.arange(0, TINY.rows(layer), 7), np.arange(20 * rpp, 21 * rpp))
        out = store.lookup(layer, others)
        check_rows(store, tables, TINY, layer, others, out.reshape(len(others), -1))
        assert store.stats()["corrupt_pages"] == 1 and store.bad_pages() == {layer: [[20, 21]]}


# --- the reader and its rings ----------------------------------------------------------------
@pytest.mark.parametrize("qd", [1, 3, 64])
def test_reads_match_pread(data_file, qd):
    f, data, _ = data_file
    reader = open_reader(qd, "uring")
    try:
        rng = np.random.default_rng(qd)
        lengths = rng.integers(1, 9, 100) * PAGE_BYTES
        offsets = rng.integers(0, 256 - 8, 100) * PAGE_BYTES
        dst = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        buf = syscalls.aligned_buffer(int(lengths.sum()))
        assert reader.read(f.fd, buf, offsets, lengths, dst) == lengths.sum()
        arr = syscalls.as_array(buf)
        for o, n, d in zip(offsets, lengths, dst, strict=True):
            np.testing.assert_array_equal(arr[d : d + n], data[o : o + n])
        with pytest.raises(OSError, match="short read"):
            reader.read(f.fd, buf, np.array([255 * PAGE_BYTES]), np.array([2 * PAGE_BYTES]), np.array([0]))
    finally:
        reader.close()


def test_read_rows_checks_pages_and_skips_the_rows_of_bad_ones(data_file):
    f, data, _ = data_file
    reader = open_reader(16, "uring")
    try:
        pages = np.arange(0, 256, 3, dtype=np.int64)
        slot = np.arange(len(pages)) % 15
        args = _rows_request(pages, 264, slot)
        crcs = checksums.page_crcs(data.reshape(-1, PAGE_BYTES))
        crcs[pages[[2, 40]]] ^= 1  # as if those two pages had rotted
        out = np.full((len(pages), 264), 0xAB, np.uint8)
        got, bad = reader.read_rows(f.fd, out, 264, *args, None, page_crcs=crcs)
        assert got == len(pages) * PAGE_BYTES and sorted(bad) == sorted(pages[[2, 40]])
        want = data.reshape(-1, PAGE_BYTES)[pages[:, None], slot[:, None] * 264 + np.arange(264)]
        ok = ~np.isin(pages, bad)
        np.testing.assert_array_equal(out[ok], want[ok])
        assert (out[~ok] == 0xAB).all()  # rows of a failing page are never copied
    finally:
        reader.close()


def test_a_reused_fd_number_is_never_read_through_the_old_registration(tmp_path, data_file):
    _, data, path = data_file
    other = tmp_path / "other.bin"
    other.write_bytes(b"\x5a" * 4 * PAGE_BYTES)
    reader = open_reader(4, "uring")
    try:
        g = syscalls.open_direct(path)
        buf = syscalls.aligned_buffer(PAGE_BYTES)
        one = (np.array([PAGE_BYTES * 9]), np.array([PAGE_BYTES]), np.array([0]))
        reader.read(g.fd, buf, *one)  # g's fd is now one of the ring's fixed files
        np.testing.assert_array_equal(syscalls.as_array(buf), data[9 * PAGE_BYTES : 10 * PAGE_BYTES])
        number = g.fd
        g.close()
        h = syscalls.open_direct(other)
        try:
            assert h.fd == number, "the lowest free fd number is reused"
            reader.read(h.fd, buf, np.array([0]), np.array([PAGE_BYTES]), np.array([0]))
            assert (syscalls.as_array(buf) == 0x5A).all()
        finally:
            h.close()
    finally:
        reader.close()


def test_a_ring_serves_any_thread_but_not_a_forked_child(data_file):
    from engram_store.native import _uring

    f, data, _ = data_file
    ring = _uring.Ring(4, PAGE_BYTES)
    buf = syscalls.aligned_buffer(PAGE_BYTES)
    one = (np.array([PAGE_BYTES * 5]), np.full(1, PAGE_BYTES), np.zeros(1, dtype=np.int64))
    t = threading.Thread(target=ring.read_batch, args=(f.fd, buf, *one))  # between batches, any thread may
    t.start()
    t.join()
    np.testing.assert_array_equal(syscalls.as_array(buf), data[5 * PAGE_BYTES : 6 * PAGE_BYTES])
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            ring.read_batch(f.fd, buf, *one)
        except RuntimeError as exc:
            code = 0 if not ring.usable and "before fork()" in str(exc) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "child: 1 = read through the parent's ring, 3 = wrong error"
    assert ring.usable
    ring.close()
    assert not ring.usable and ring.closed
    with pytest.raises(ValueError, match="closed"):
        ring.read_batch(f.fd, buf, *one)


def test_a_forked_child_reads_exactly_through_new_rings(data_file):
    f, data, _ = data_file
    reader = open_reader(8, "uring")
    buf = syscalls.aligned_buffer(4 * PAGE_BYTES)
    args = (np.array([0, 50, 100, 200]) * PAGE_BYTES, np.full(4, PAGE_BYTES), np.arange(4) * PAGE_BYTES)
    want = data.reshape(-1, PAGE_BYTES)[[0, 50, 100, 200]].reshape(-1)
    try:
        reader.read(f.fd, buf, *args)  # the parent's ring exists before fork
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                reader.read(f.fd, buf, *args)
                code = 0 if np.array_equal(syscalls.as_array(buf), want) else 3
            except BaseException:
                code = 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "child: 2 = read raised, 3 = wrong bytes"
        reader.read(f.fd, buf, *args)
        np.testing.assert_array_equal(syscalls.as_array(buf), want)
    finally:
        reader.close()
    with pytest.raises(errors.StorageError, match="closed"):
        reader.read(f.fd, buf, *args)


def test_sqpoll_rings_read_exactly(data_file):
    f, data, _ = data_file
    try:
        reader = uring.UringReader(8, sqpoll=True)
        buf = syscalls.aligned_buffer(8 * PAGE_BYTES)
        reader.read(f.fd, buf, np.arange(8) * 2 * PAGE_BYTES, np.full(8, PAGE_BYTES), np.arange(8) * PAGE_BYTES)
    except OSError as exc:  # SQPOLL may need privileges this host does not grant
        pytest.skip(f"SQPOLL refused: {exc}")
    try:
        np.testing.assert_array_equal(syscalls.as_array(buf), data.reshape(-1, PAGE_BYTES)[::2][:8].reshape(-1))
    finally:
        reader.close()


# --- the probe and the fallback --------------------------------------------------------------
@pytest.fixture()
def fresh_probes():
    uring.probe.cache_clear()
    readers.best_backend.cache_clear()
    yield
    uring.probe.cache_clear()
    readers.best_backend.cache_clear()


def test_auto_falls_back_to_aio_and_logs_why_when_the_probe_fails(tmp_path, monkeypatch, caplog, fresh_probes):
    from engram_store.native import _uring

    if not aio.available():
        pytest.skip("native reader _pread not built")
    monkeypatch.setattr(_uring, "probe", lambda: "io_uring_setup failed: Operation not permitted (test)")
    tables = make_tables(tmp_path, TINY)
    with caplog.at_level(logging.INFO, logger="engram_store.native.readers"):
        with TieredStore.open(tables, dram_bytes=1 << 20, mode="cached") as store:
            assert store.parts.nvme.reader.name == "aio"
            ids = np.arange(0, TINY.rows(TINY.layers[0]), 5)
            check_rows(store, tables, TINY, TINY.layers[0], ids, store.lookup(TINY.layers[0], ids).reshape(len(ids), -1))
        assert open_reader(4).name == "aio"
    lines = [r.getMessage() for r in caplog.records if "page reader" in r.getMessage()]
    assert lines == [("page reader: Linux AIO (native _pread); io_uring unavailable: io_uring_setup failed: "
                      "Operation not permitted (test)")]  # once, though two readers were opened
    with pytest.raises(errors.ConfigError, match="'uring' asked for but io_uring cannot be used: .*not permitted"):
        TieredStore.open(tables, dram_bytes=1 << 20, mode="cached", reader="uring")


def test_auto_picks_uring_when_the_probe_passes(fresh_probes, caplog):
    with caplog.at_level(logging.INFO, logger="engram_store.native.readers"):
        reader = open_reader(4)
    try:
        assert reader.name == "uring" and reader.streams_rows
        assert "page reader: io_uring" in caplog.text
    finally:
        reader.close()


# --- the crc32c both native readers share ------------------------------------------------------
@pytest.mark.parametrize("npages", [1, 2, 3, 4, 5, 7, 8, 9, 64])
def test_shared_crc32c_matches_the_reference_on_every_path(npages):
    native = aio.native_reader()
    if native is None:
        pytest.skip("native reader _pread not built")
    pages = np.random.default_rng(npages).integers(0, 256, (npages, PAGE_BYTES), dtype=np.uint8)
    pages[0, :] = 0 if npages > 1 else pages[0, :]  # an all-zero page too
    want = checksums.page_crcs_numpy(pages)
    for software in (False, True):  # four-page groups, single pages split in four chains, tables
        out = np.empty(npages, dtype=np.uint32)
        native.page_crcs(pages, out, software)
        np.testing.assert_array_equal(out, want)
