"""NVMe tier and syscalls: O_DIRECT with fallback, readers agree, coalescing, sealing."""

from __future__ import annotations

import logging
import mmap
import os

import numpy as np
import pytest
from support.storage_helpers import FLASH, SEED, make_tables

from engram_store.format.layout import PageLayout
from engram_store.native import syscalls
from engram_store.native.readers import open_reader
from engram_store.native.readers.aio import native_reader
from engram_store.storage.layer_file import LayerFile
from engram_store.storage.nvme import NvmeTier
from engram_store.tools.synth import synth_rows


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "pages.bin"
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=64 * 4096, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data


def test_open_direct_on_real_disk(data_file):
    path, _ = data_file
    f = syscalls.open_direct(path)
    try:
        assert f.direct, "tmp_path is on a disk file system that supports O_DIRECT"
        assert f.size == 64 * 4096
    finally:
        f.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_open_direct_falls_back_and_logs(caplog, tmp_path):
    path = f"/dev/shm/engram-test-{os.getpid()}.bin"
    with open(path, "wb") as fh:
        fh.write(b"\1" * 8192)
    try:
        with caplog.at_level(logging.WARNING, logger="engram_store.native.syscalls"):
            f = syscalls.open_direct(path)
        try:
            if not f.direct:
                assert "O_DIRECT refused" in caplog.text
            buf = syscalls.aligned_buffer(4096)
            assert os.preadv(f.fd, [buf], 4096) == 4096 and buf[:4096] == b"\1" * 4096
        finally:
            f.close()
    finally:
        os.unlink(path)


def test_aligned_buffer_is_page_aligned():
    buf = syscalls.aligned_buffer(5000)
    arr = syscalls.as_array(buf)
    assert arr.ctypes.data % 4096 == 0 and len(arr) == 8192


@pytest.mark.parametrize("backend", ["native", "threads"])
@pytest.mark.parametrize("qd", [1, 3, 64])
def test_page_reader_reads_every_extent(data_file, backend, qd):
    if backend == "native" and native_reader() is None:
        pytest.skip("native reader _pread not built (pure-Python fallback covered by 'threads')")
    path, data = data_file
    f = syscalls.open_direct(path)
    reader = open_reader(qd, backend)
    try:
        pages = np.array([5, 0, 63, 7, 8, 9, 40], dtype=np.int64)
        lengths = np.array([1, 1, 1, 3, 1, 1, 2], dtype=np.int64) * 4096
        lengths[1] = 4096
        dst = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        buf = syscalls.aligned_buffer(int(lengths.sum()))
        pages[-1] = 40
        got = reader.read(f.fd, buf, pages * 4096, lengths, dst)
        assert got == lengths.sum()
        arr = syscalls.as_array(buf)
        for p, n, d in zip(pages, lengths, dst, strict=True):
            np.testing.assert_array_equal(arr[d : d + n], data[p * 4096 : p * 4096 + n])
        with pytest.raises(OSError, match="short read|Input/output"):
            reader.read(f.fd, buf, np.array([63 * 4096]), np.array([8192]), np.array([0]))
    finally:
        reader.close()
        f.close()


@pytest.mark.parametrize("backend", ["native", "threads"])
@pytest.mark.parametrize("coalesce", [1, 4, 64])
def test_nvme_tier_reads_each_page_once(tmp_path, coalesce, backend):
    if backend == "native" and native_reader() is None:
        pytest.skip("native reader _pread not built (pure-Python fallback covered by 'threads')")
    tables = make_tables(tmp_path, FLASH)
    layer = FLASH.layers[0]
    layout = PageLayout(FLASH.rows(layer), FLASH.row_bytes)
    path = tables / f"layer_{layer:03d}.bin"
    lf = LayerFile(layer, str(path), layout, syscalls.open_direct(path))
    tier = NvmeTier({layer: lf}, open_reader(16, backend), max_coalesce_pages=coalesce, chunk_pages=64)
    try:
        rng = np.random.default_rng(2)
        rows = np.unique(np.concatenate([np.arange(0, 200), rng.integers(0, layout.rows, 500), [layout.rows - 1]]))
        out = np.empty((len(rows), FLASH.row_bytes), np.uint8)
        st = tier.read_rows(layer, rows, out)
        np.testing.assert_array_equal(out, synth_rows(FLASH, SEED, layer, rows))
        distinct_pages = len(np.unique(rows // layout.rows_per_page))
        assert st.pages == distinct_pages and st.bytes == distinct_pages * 4096
        assert st.reads <= distinct_pages
        if coalesce == 1:
            assert st.reads == distinct_pages
        else:
            assert st.reads < distinct_pages  # rows 0..199 sit on adjacent pages
    finally:
        tier.close()


def test_memfd_seal_makes_it_read_only():
    m = syscalls.create_memfd("engram-test", 1 << 20, huge=True)
    try:
        mm = syscalls.map_fd(m.fd, m.size, writable=True)
        mm[:4] = b"abcd"
        mm.close()
        syscalls.seal_read_only(m.fd)
        assert syscalls.seals(m.fd) & syscalls.READ_ONLY_SEALS == syscalls.READ_ONLY_SEALS
        with pytest.raises(PermissionError):
            mmap.mmap(m.fd, m.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(m.fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(m.fd, 0)
        ro = syscalls.map_fd(m.fd, m.size, writable=False)
        assert ro[:4] == b"abcd"
        ro.close()
    finally:
        m.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("impl", ["native", "numpy"])
def test_gatherer_matches_numpy_take(threads, impl):
    from engram_store.native import gather as arena

    g = arena.Gatherer(threads)
    if impl == "native" and g._native is None:
        pytest.skip("native gather _gather not built (the numpy case covers the fallback)")
    if impl == "numpy":
        g._native = None
        if threads > 1:
            g._pool = arena.ThreadPoolExecutor(threads - 1)
    try:
        rng = np.random.default_rng(4)
        src = rng.integers(0, 256, size=(5000, 264), dtype=np.uint8)
        # sizes around the native block (1,024 rows) and split (2,048) edges and the fallback's split
        for n in [0, 1, 7, 1023, 1024, 2047, 2048, 2049, 5000, arena.PARALLEL_MIN_ROWS * 3 + 5]:
            idx = rng.integers(0, len(src), n)
            idx[:1] = len(src) - 1
            out = np.zeros((n, 264), np.uint8)
            g.take(src, idx, out)
            np.testing.assert_array_equal(out, src[idx])
        for bad_at, bad in [(0, 5000), (4095, -1), (9000, 1 << 40)]:  # single-threaded and pooled paths
            idx = rng.integers(0, len(src), 10000)
            idx[bad_at] = bad
            out = np.zeros((10000, 264), np.uint8)
            with pytest.raises(IndexError):
                g.take(src, idx, out)
            assert not out.any()  # checked before anything is copied
        idx = rng.integers(0, len(src), 3000)  # a good gather after a failed one
        out = np.zeros((3000, 264), np.uint8)
        g.take(src, idx, out)
        np.testing.assert_array_equal(out, src[idx])
    finally:
        g.close()


def test_native_gather_pool_under_concurrent_callers():
    """Several Python threads gathering at once: one holds the native pool, the others copy
    on their own threads; every result is exact."""
    from concurrent.futures import ThreadPoolExecutor

    from engram_store.native import gather as arena

    if arena.native_gather() is None:
        pytest.skip("native gather _gather not built")
    gs = [arena.Gatherer(t) for t in (2, 3, 4)]
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, size=(20000, 264), dtype=np.uint8)

    def one(k: int) -> bool:
        r = np.random.default_rng(k)
        idx = r.integers(0, len(src), int(r.integers(1, 40000)))
        out = np.empty((len(idx), 264), np.uint8)
        gs[k % len(gs)].expect(len(idx))  # the daemon's hint before a gather: must not disturb it
        gs[k % len(gs)].take(src, idx, out)
        return bool(np.array_equal(out, src[idx]))

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(one, range(120)))


def test_native_gather_pool_after_fork():
    """A child forked after the parent used the pool (workers not copied) gathers correctly
    and starts its own workers."""
    from engram_store.native import gather as arena

    native = arena.native_gather()
    if native is None:
        pytest.skip("native gather _gather not built")
    rng = np.random.default_rng(9)
    src = rng.integers(0, 256, size=(20000, 264), dtype=np.uint8)
    idx = rng.integers(0, len(src), 30000)
    out = np.empty((len(idx), 264), np.uint8)
    native.gather(src, 264, idx, out, 2)
    assert native.pool_size() >= 1
    pid = os.fork()
    if pid == 0:  # the child: exit status says what happened
        code = 1
        try:
            before = native.pool_size()
            child_out = np.zeros_like(out)
            native.gather(src, 264, idx, child_out, 2)
            code = 0 if before == 0 and native.pool_size() == 1 and np.array_equal(child_out, src[idx]) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
