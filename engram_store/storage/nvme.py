"""The NVMe tier: rows read from layer files with O_DIRECT, page by page.

:class:`NvmeTier` turns rows into reads: the distinct 4 KiB pages that hold a
request's missing rows are read once each, adjacent pages coalesced into one
read of up to ``max_coalesce_pages``, through a :class:`~engram_store.native.readers.PageReader`.
With a reader that streams rows, reads land in a ring of ``queue_depth`` slots
and each row is copied out as soon as its read completes, so a request never
holds all its pages in memory; otherwise pages are read in chunks of
``chunk_pages`` into a pooled staging buffer and the rows gathered with one
numpy fancy index per chunk.

Every page read is checked against its crc32c (``LayerFile.crcs``, from the
layer's checksum file): natively, as each read completes and before a row is
copied out of it; in the fallback, once per chunk. Pages that fail come back
in ``ReadStats.bad_pages`` (their rows in ``out`` are not to be used); the
caller decides what that means for the request (see ``TieredStore``). A read
that fails (an I/O error, a short read of a truncated file) is retried on
halves of the request's pages until the pages that cannot be read are found:
those are reported in ``bad_pages`` too and the others are read and checked as
usual.

A striped layer (``LayerFile.stripes``) is read per stripe: the request's
distinct pages are grouped by stripe (page ``p`` is local page ``p // K`` of
stripe ``p % K``), coalesced in local page numbers and read concurrently, one
thread per stripe (the calling thread takes the first stripe with pages, a
small pool owned by the tier the others). With the io_uring reader each thread
has its own ring, so each device is driven by its own ring. Rows land in
``out`` at their positions; bad pages are reported as layer page numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from ..errors import StorageError
from ..format.checksums import bad_pages as check_pages
from ..format.layout import PAGE_BYTES, extents
from ..native.readers import MAX_CHECKED_PAGES, MAX_NATIVE_QD, PageReader
from ..native.syscalls import aligned_buffer, as_array
from .integrity import failing_items
from .layer_file import LayerFile

log = logging.getLogger(__name__)

DEFAULT_CHUNK_PAGES = 8192  # 32 MiB of pages per read batch
DEFAULT_MAX_COALESCE_PAGES = 16
POOLED_BUFFERS = 4


@dataclass
class ReadStats:
    pages: int = 0  # distinct 4 KiB pages read
    reads: int = 0  # read calls after coalescing
    bytes: int = 0
    seconds: float = 0.0
    bad_pages: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, dtype=np.int64))  # failed crc32c
    rows_read: int | None = None  # with a stop flag raised: the rows read, from the first (None: all of them)
    rows_from_hints: int = 0  # rows a hint read brought (its read in flight, or the cache it filled): not read here


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


class NvmeTier:
    """Reads rows of layer files. Thread-safe; owns the files' descriptors.

    With a reader that streams rows the pages of a request are read into a small ring of
    slots (``queue_depth * max_coalesce_pages`` pages) and rows are copied out as
    each read completes; otherwise, pages are read in chunks of ``chunk_pages``
    into a staging buffer and gathered with numpy.
    """

    def __init__(self, files: dict[int, LayerFile], reader: PageReader, *,
                 max_coalesce_pages: int = DEFAULT_MAX_COALESCE_PAGES, chunk_pages: int = DEFAULT_CHUNK_PAGES) -> None:
        self.files = files
        self.reader = reader
        self.max_coalesce_pages = min(max(1, max_coalesce_pages), MAX_CHECKED_PAGES)
        self.chunk_pages = max(self.max_coalesce_pages, chunk_pages)
        if reader.streams_rows:
            self.buffers = BufferPool(min(reader.queue_depth, MAX_NATIVE_QD) * self.max_coalesce_pages * PAGE_BYTES)
        else:
            self.buffers = BufferPool(self.chunk_pages * PAGE_BYTES)
        self._stripe_threads = max((len(lf.stripes) for lf in files.values()), default=0) - 1
        self._pool: ThreadPoolExecutor | None = None  # the stripe readers, made on the first striped read
        self._pool_lock = threading.Lock()

    def read_rows(self, layer: int, rows: np.ndarray, out: np.ndarray, queue_depth: int | None = None,
                  stop: np.ndarray | None = None) -> ReadStats:
        """Fill ``out[i]`` (C-contiguous uint8 ``[n, row_bytes]``) with row ``rows[i]``;
        ``rows`` int64, sorted ascending and distinct. ``queue_depth``: reads in flight at most
        (default: the reader's). ``stop``: an int32 flag another thread may raise to end the read
        early (the io_uring reader watches it; the stats' ``rows_read`` then says how many rows, from
        the first, were read). Raises StorageError when the layer cannot be read."""
        lf = self.files[layer]
        if lf.file is None:
            raise StorageError(f"layer {layer} is unavailable: {lf.error}")
        if lf.stripes and len(rows):
            return self._read_striped(lf, rows, out, queue_depth)
        return self._read_file(lf, rows, out, queue_depth, stop)

    def _read_striped(self, lf: LayerFile, rows: np.ndarray, out: np.ndarray, queue_depth: int | None) -> ReadStats:
        t0 = time.perf_counter()
        rpp = lf.layout.rows_per_page
        k_total = len(lf.stripes)
        page, slot = np.divmod(rows, rpp)
        local, stripe = np.divmod(page, k_total)
        order = np.argsort(stripe, kind="stable")  # by stripe; rows (so local pages) stay ascending within one
        bounds = np.searchsorted(stripe[order], np.arange(k_total + 1))
        work = [(lf.stripes[k], order[bounds[k]: bounds[k + 1]]) for k in range(k_total) if bounds[k + 1] > bounds[k]]

        def read(view: LayerFile, at: np.ndarray) -> ReadStats:
            part = np.empty((len(at), lf.layout.row_bytes), dtype=np.uint8)
            got = self._read_file(view, local[at] * rpp + slot[at], part, queue_depth)
            out[at] = part
            got.bad_pages = view.layer_pages(got.bad_pages)
            return got

        futures = [self._stripe_pool().submit(read, view, at) for view, at in work[1:]]
        try:
            results = [read(*work[0])]
        finally:
            wait(futures)  # every stripe's read is over before out is handed back, even on an error
        results += [f.result() for f in futures]
        stats = ReadStats()
        for got in results:
            stats.pages += got.pages
            stats.reads += got.reads
            stats.bytes += got.bytes
        stats.bad_pages = np.sort(np.concatenate([got.bad_pages for got in results]))
        stats.seconds = time.perf_counter() - t0
        return stats

    def _stripe_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max(1, self._stripe_threads), thread_name_prefix="engram-stripe")
            return self._pool

    def _read_file(self, lf: LayerFile, rows: np.ndarray, out: np.ndarray, queue_depth: int | None = None,
                   stop: np.ndarray | None = None) -> ReadStats:
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
        row_start = np.append(np.flatnonzero(first), len(rows))  # rows of distinct page i: row_start[i]:[i+1]
        slot = rows % rpp
        t0 = time.perf_counter()

        def read_span(i0: int, i1: int, into: ReadStats) -> None:
            """Distinct pages i0..i1-1 and their rows (OSError when a read fails)."""
            r0, r1 = int(row_start[i0]), int(row_start[i1])
            if self.reader.streams_rows:
                self._read_native(lf, distinct[i0:i1], page_index[r0:r1] - i0, slot[r0:r1], out[r0:r1], into,
                                  queue_depth, stop)
                return
            for lo in range(i0, i1, self.chunk_pages):
                hi = min(lo + self.chunk_pages, i1)
                a, b = int(row_start[lo]), int(row_start[hi])
                self._read_chunk(lf, distinct[lo:hi], page_index[a:b] - lo, slot[a:b], out[a:b], into, queue_depth)

        try:
            read_span(0, len(distinct), stats)
        except OSError as exc:  # find the pages that cannot be read; read the others
            log.debug("layer %d: reading %d pages of %s failed (%s); reading them by halves", lf.layer,
                      len(distinct), lf.path, str(exc))
            stats = ReadStats()
            stop = None  # the retries read every page they can
            unreadable = failing_items(len(distinct), lambda i0, i1: read_span(i0, i1, stats))
            stats.bad_pages = np.union1d(stats.bad_pages, distinct[unreadable]).astype(np.int64)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _read_native(self, lf: LayerFile, pages: np.ndarray, page_index: np.ndarray, slot: np.ndarray,
                     out: np.ndarray, stats: ReadStats, queue_depth: int | None = None,
                     stop: np.ndarray | None = None) -> None:
        begin, npages = extents(pages, self.max_coalesce_pages)
        read_of_page = np.repeat(np.arange(len(begin)), npages)
        read_of_row = read_of_page[page_index]
        first_row = np.searchsorted(read_of_row, np.arange(len(begin) + 1))
        row_off = (page_index - begin[read_of_row]) * PAGE_BYTES + slot * lf.layout.row_bytes
        scratch = self.buffers.get()
        try:
            got, bad, *done = self.reader.read_rows(lf.file.fd, out, lf.layout.row_bytes, pages[begin] * PAGE_BYTES,
                                                    npages * PAGE_BYTES, first_row, row_off, scratch,
                                                    queue_depth=queue_depth, page_crcs=lf.crcs,
                                                    **({} if stop is None else {"stop": stop}))
        finally:
            self.buffers.put(scratch)
        reads = done[0] if done else len(begin)  # a raised stop: only the first `reads` extents were read
        if reads < len(begin):
            stats.rows_read = int(first_row[reads])
        stats.pages += int(npages[:reads].sum()) if reads < len(begin) else len(pages)
        stats.reads += reads
        stats.bytes += got
        if len(bad):
            stats.bad_pages = np.concatenate([stats.bad_pages, bad])

    def _read_chunk(self, lf: LayerFile, pages: np.ndarray, page_pos: np.ndarray, slot: np.ndarray,
                    out: np.ndarray, stats: ReadStats, queue_depth: int | None = None) -> None:
        n = len(pages)
        begin, npages = extents(pages, self.max_coalesce_pages)
        buf = self.buffers.get()
        try:
            got = self.reader.read(lf.file.fd, buf, pages[begin] * PAGE_BYTES, npages * PAGE_BYTES, begin * PAGE_BYTES,
                                   queue_depth=queue_depth)
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
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for lf in self.files.values():
            lf.close()
