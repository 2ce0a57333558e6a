"""The NVMe tier: rows read from layer files with O_DIRECT, page by page.

:class:`PageReader` moves bytes with ``queue_depth`` reads in flight. It uses
the native module ``_pread`` (Linux AIO from one thread, the GIL released for
the whole batch; see ``_pread.c``) when it is built, and otherwise a pool of
threads calling ``os.preadv`` (one Python call per read: the fallback is
correct but reaches about half of fio's IOPS); the choice is logged once.

:class:`NvmeTier` turns rows into reads: the distinct 4 KiB pages that hold a
request's missing rows are read once each, adjacent pages coalesced into one
read of up to ``max_coalesce_pages``. With the native reader, reads land in a
ring of ``queue_depth`` slots and each row is copied out as soon as its read
completes, so a request never holds all its pages in memory; with the
fallback, pages are read in chunks of ``chunk_pages`` into a pooled staging
buffer and the rows gathered with one numpy fancy index per chunk.

Every page read is checked against its crc32c (``LayerFile.crcs``, from the
layer's checksum file): natively, as each read completes and before a row is
copied out of it; in the fallback, once per chunk. Pages that fail come back
in ``ReadStats.bad_pages`` (their rows in ``out`` are not to be used); the
caller decides what that means for the request (see ``TieredStore``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import StorageError
from ..layout import PAGE_BYTES, PageLayout
from .checksums import bad_pages as check_pages
from .syscalls import OpenedFile, aligned_buffer, as_array

log = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH = 64
DEFAULT_CHUNK_PAGES = 8192  # 32 MiB of pages per read batch
DEFAULT_MAX_COALESCE_PAGES = 16
POOLED_BUFFERS = 4
MAX_NATIVE_QD = 256  # the native reader clamps queue depth here
MAX_CHECKED_PAGES = 64  # the native reader checks extents of at most this many pages


@functools.cache
def native_reader():
    """The ``_pread`` extension module, or None (pure-Python fallback); probed once."""
    try:
        from . import _pread
    except ImportError as exc:
        log.warning("native reader _pread not built (%s); using a Python thread pool of os.preadv", exc)
        return None
    log.info("native reader _pread (Linux AIO) in use")
    return _pread


class PageReader:
    """Reads extents of a file into a buffer, ``queue_depth`` at a time. Thread-safe."""

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH, backend: str = "auto") -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        if backend not in ("auto", "native", "threads"):
            raise ValueError(f"reader backend must be auto, native or threads, got {backend!r}")
        self.queue_depth = queue_depth
        self._native = native_reader() if backend != "threads" else None
        if backend == "native" and self._native is None:
            raise ValueError("reader backend 'native' asked for but engram_store.storage._pread is not built")
        self.backend = "native" if self._native is not None else "threads"
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def read(self, fd: int, buf, file_offsets: np.ndarray, lengths: np.ndarray, buf_offsets: np.ndarray,
             queue_depth: int | None = None) -> int:
        """Read ``lengths[i]`` bytes at ``file_offsets[i]`` into ``buf[buf_offsets[i]:]``;
        raises OSError on an I/O error or short read. Returns bytes read."""
        qd = queue_depth or self.queue_depth
        file_offsets = np.ascontiguousarray(file_offsets, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        buf_offsets = np.ascontiguousarray(buf_offsets, dtype=np.int64)
        if self._native is not None:
            return self._native.read_batch(fd, buf, file_offsets, lengths, buf_offsets, qd)
        return self._read_threads(fd, buf, file_offsets, lengths, buf_offsets, qd)

    def read_rows(self, fd: int, out: np.ndarray, row_bytes: int, file_offsets: np.ndarray, lengths: np.ndarray,
                  first_row: np.ndarray, row_offsets: np.ndarray, scratch, queue_depth: int | None = None,
                  page_crcs: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """Native reader only: read extents into ``scratch`` slots and copy rows
        ``first_row[i]:first_row[i+1]`` of ``out`` from extent i at ``row_offsets``.
        With ``page_crcs`` (uint32, expected crc32c per page of the file) every page is
        checked first and the rows of a page that fails are not copied. Returns (bytes
        read, int64 page numbers that failed)."""
        if self._native is None:
            raise ValueError("read_rows needs the native reader (engram_store.storage._pread)")
        i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
        lengths = i64(lengths)
        if page_crcs is None:
            got, _ = self._native.read_rows(fd, out, row_bytes, i64(file_offsets), lengths, i64(first_row),
                                            i64(row_offsets), scratch, queue_depth or self.queue_depth)
            return got, np.empty(0, dtype=np.int64)
        bad = np.empty(int(lengths.sum()) // PAGE_BYTES, dtype=np.int64)
        got, n_bad = self._native.read_rows(fd, out, row_bytes, i64(file_offsets), lengths, i64(first_row),
                                            i64(row_offsets), scratch, queue_depth or self.queue_depth, page_crcs, bad)
        return got, bad[:n_bad]

    def _read_threads(self, fd, buf, file_offsets, lengths, buf_offsets, qd) -> int:
        n = len(file_offsets)
        if n == 0:
            return 0
        mv = memoryview(buf).cast("B")
        offs, lens, dsts = file_offsets.tolist(), lengths.tolist(), buf_offsets.tolist()

        def stripe(first: int) -> int:
            done = 0
            for i in range(first, n, workers):
                got = os.preadv(fd, [mv[dsts[i] : dsts[i] + lens[i]]], offs[i])
                if got != lens[i]:
                    raise OSError(f"short read at offset {offs[i]} (file truncated?)")
                done += got
            return done

        workers = min(qd, n)
        if workers == 1:
            return stripe(0)
        return sum(self._executor().map(stripe, range(workers)))

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(self.queue_depth, 1), thread_name_prefix="engram-pread")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass
class ReadStats:
    pages: int = 0  # distinct 4 KiB pages read
    reads: int = 0  # read calls after coalescing
    bytes: int = 0
    seconds: float = 0.0
    bad_pages: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, dtype=np.int64))  # failed crc32c


class BufferPool:
    """Reusable aligned buffers of one size (already faulted in after first use)."""

    def __init__(self, nbytes: int, keep: int = POOLED_BUFFERS) -> None:
        self.nbytes = nbytes
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._keep = keep
        self._kept = 0

    def get(self):
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return aligned_buffer(self.nbytes)

    def put(self, buf) -> None:
        if self._free.qsize() < self._keep:
            self._free.put(buf)
            self._kept = max(self._kept, self._free.qsize())

    def retained(self) -> int:
        """Buffers kept for reuse at most so far (their memory stays mapped)."""
        return self._kept


@dataclass
class LayerFile:
    """One layer's data file as the NVMe tier sees it."""

    layer: int
    path: str
    layout: PageLayout
    file: OpenedFile | None  # None when the layer cannot be served
    error: str | None = None
    crcs: np.ndarray | None = None  # expected crc32c of every page (uint32); None: pages are not checked


def extents(pages: np.ndarray, max_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Reads covering sorted distinct ``pages``: runs of consecutive pages cut every
    ``max_pages``. Returns (index of each read's first page in ``pages``, read lengths in pages)."""
    n = len(pages)
    start = np.empty(n, dtype=bool)
    start[0] = True
    np.not_equal(pages[1:], pages[:-1] + 1, out=start[1:])
    if max_pages > 1:
        begin = np.flatnonzero(start)
        offset_in_run = np.arange(n) - begin[np.cumsum(start) - 1]
        start |= offset_in_run % max_pages == 0
    else:
        start[:] = True
    begin = np.flatnonzero(start)
    return begin, np.diff(np.append(begin, n))


class NvmeTier:
    """Reads rows of layer files. Thread-safe; owns the files' descriptors.

    With the native reader the pages of a request are read into a small ring of
    slots (``queue_depth * max_coalesce_pages`` pages) and rows are copied out as
    each read completes; without it, pages are read in chunks of ``chunk_pages``
    into a staging buffer and gathered with numpy.
    """

    def __init__(self, files: dict[int, LayerFile], reader: PageReader, *,
                 max_coalesce_pages: int = DEFAULT_MAX_COALESCE_PAGES, chunk_pages: int = DEFAULT_CHUNK_PAGES) -> None:
        self.files = files
        self.reader = reader
        self.max_coalesce_pages = min(max(1, max_coalesce_pages), MAX_CHECKED_PAGES)
        self.chunk_pages = max(self.max_coalesce_pages, chunk_pages)
        if reader.backend == "native":
            self.buffers = BufferPool(min(reader.queue_depth, MAX_NATIVE_QD) * self.max_coalesce_pages * PAGE_BYTES)
        else:
            self.buffers = BufferPool(self.chunk_pages * PAGE_BYTES)

    def read_rows(self, layer: int, rows: np.ndarray, out: np.ndarray) -> ReadStats:
        """Fill ``out[i]`` (C-contiguous uint8 ``[n, row_bytes]``) with row ``rows[i]``;
        ``rows`` int64, sorted ascending and distinct. Raises StorageError when the layer
        cannot be read."""
        lf = self.files[layer]
        if lf.file is None:
            raise StorageError(f"layer {layer} is unavailable: {lf.error}")
        stats = ReadStats()
        if not len(rows):
            return stats
        rpp = lf.layout.rows_per_page
        pages = rows // rpp
        first = np.empty(len(pages), dtype=bool)
        first[0] = True
        np.not_equal(pages[1:], pages[:-1], out=first[1:])
        page_index = np.cumsum(first) - 1  # position of each row's page among the distinct pages
        distinct = pages[first]
        t0 = time.perf_counter()
        try:
            if self.reader.backend == "native":
                self._read_native(lf, distinct, page_index, rows % rpp, out, stats)
            else:
                starts = np.flatnonzero(first)
                for lo in range(0, len(distinct), self.chunk_pages):
                    hi = min(lo + self.chunk_pages, len(distinct))
                    row_lo = int(starts[lo])
                    row_hi = int(starts[hi]) if hi < len(distinct) else len(rows)
                    self._read_chunk(lf, distinct[lo:hi], page_index[row_lo:row_hi] - lo,
                                     rows[row_lo:row_hi] % rpp, out[row_lo:row_hi], stats)
        except OSError as exc:
            raise StorageError(f"layer {lf.layer}: reading {len(distinct)} pages of {lf.path} failed: {exc}") from exc
        stats.seconds = time.perf_counter() - t0
        return stats

    def _read_native(self, lf: LayerFile, pages: np.ndarray, page_index: np.ndarray, slot: np.ndarray,
                     out: np.ndarray, stats: ReadStats) -> None:
        begin, npages = extents(pages, self.max_coalesce_pages)
        read_of_page = np.repeat(np.arange(len(begin)), npages)
        read_of_row = read_of_page[page_index]
        first_row = np.searchsorted(read_of_row, np.arange(len(begin) + 1))
        row_off = (page_index - begin[read_of_row]) * PAGE_BYTES + slot * lf.layout.row_bytes
        scratch = self.buffers.get()
        try:
            got, bad = self.reader.read_rows(lf.file.fd, out, lf.layout.row_bytes, pages[begin] * PAGE_BYTES,
                                             npages * PAGE_BYTES, first_row, row_off, scratch, page_crcs=lf.crcs)
        finally:
            self.buffers.put(scratch)
        stats.pages += len(pages)
        stats.reads += len(begin)
        stats.bytes += got
        if len(bad):
            stats.bad_pages = np.concatenate([stats.bad_pages, bad])

    def _read_chunk(self, lf: LayerFile, pages: np.ndarray, page_pos: np.ndarray, slot: np.ndarray,
                    out: np.ndarray, stats: ReadStats) -> None:
        n = len(pages)
        begin, npages = extents(pages, self.max_coalesce_pages)
        buf = self.buffers.get()
        try:
            got = self.reader.read(lf.file.fd, buf, pages[begin] * PAGE_BYTES, npages * PAGE_BYTES, begin * PAGE_BYTES)
            if lf.crcs is not None:
                bad = pages[check_pages(buf, lf.crcs[pages])]
                if len(bad):
                    stats.bad_pages = np.concatenate([stats.bad_pages, bad])
            layout = lf.layout
            body = as_array(buf, n * PAGE_BYTES).reshape(n, PAGE_BYTES)[:, : layout.rows_per_page * layout.row_bytes]
            out[...] = body.reshape(n, layout.rows_per_page, layout.row_bytes)[page_pos, slot]
            stats.pages += n
            stats.reads += len(begin)
            stats.bytes += got
        finally:
            self.buffers.put(buf)

    def close(self) -> None:
        for lf in self.files.values():
            if lf.file is not None:
                lf.file.close()
