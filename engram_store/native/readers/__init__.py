"""Page readers: what moves 4 KiB pages of a layer file into memory, one module per backend.

A :class:`PageReader` reads extents (file offset, length) of an ``O_DIRECT``
file descriptor with ``queue_depth`` reads in flight. :func:`open_reader` picks
the backend by a probe, in this order, once per process, and logs the choice:

- ``uring`` (:mod:`.uring`): io_uring through raw syscalls in native code
  (``_uring.c``): a ring per reading thread with registered slots and files,
  batched submission and reaping, the GIL released for the whole batch; it
  *streams rows*: reads land in slots and each row is copied out (after its
  page's crc32c check) as soon as its read completes;
- ``aio`` (:mod:`.aio`): Linux AIO from one thread in native code (``_pread.c``),
  the GIL released for the whole batch; streams rows as ``uring`` does;
- ``threads`` (:mod:`.threads`): a pool of threads calling ``os.preadv``, the
  fallback when no native module is built (correct, about half of fio's IOPS).

``native`` asks for the best native backend and fails when none is built.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH = 64
MAX_NATIVE_QD = 256  # the native readers clamp queue depth here
MAX_CHECKED_PAGES = 64  # the native readers check extents of at most this many pages
BACKENDS = ("auto", "native", "uring", "aio", "threads")


class PageReader(Protocol):
    """Reads extents of a file into a buffer. Thread-safe: any thread may call any method;
    each call blocks its caller until every read of the call has completed."""

    name: str  # the backend ("uring", "aio", "threads")
    queue_depth: int
    streams_rows: bool  # implements read_rows

    def read(self, fd: int, buf, file_offsets: np.ndarray, lengths: np.ndarray, buf_offsets: np.ndarray,
             queue_depth: int | None = None) -> int:
        """Read ``lengths[i]`` bytes at ``file_offsets[i]`` into ``buf[buf_offsets[i]:]`` (``buf``
        4 KiB aligned, writable, large enough; offsets and lengths multiples of 4 KiB).
        Raises OSError on an I/O error or short read. Returns bytes read."""
        ...

    def read_rows(self, fd: int, out: np.ndarray, row_bytes: int, file_offsets: np.ndarray, lengths: np.ndarray,
                  first_row: np.ndarray, row_offsets: np.ndarray, scratch, queue_depth: int | None = None,
                  page_crcs: np.ndarray | None = None, stop: np.ndarray | None = None) -> tuple:
        """Only where ``streams_rows``: read extent i into a slot of ``scratch`` (aligned, at
        least ``min(queue_depth, MAX_NATIVE_QD) * max extent`` bytes) and copy rows
        ``first_row[i]:first_row[i+1]`` of ``out`` (uint8 ``[n, row_bytes]``) from the slot at
        ``row_offsets``, as soon as that read completes. With ``page_crcs`` (uint32, expected
        crc32c of every page of the file) each page is checked first and the rows of a page
        that fails are not copied. Returns (bytes read, int64 page numbers that failed). With ``stop`` (an
        int32 array another thread sets non-zero when this read must give way, e.g. to a lookup's), no
        extent is started once it is set, and a third item says how many extents, from the first, were
        read (the others' rows are untouched); a reader that does not watch it reads them all."""
        ...

    def close(self) -> None:
        """Release threads and kernel contexts; the reader is unusable afterwards."""
        ...


@functools.cache
def best_backend() -> str:
    """The backend ``auto`` means on this host: uring, else aio, else threads; probed once, logged."""
    from . import aio, uring

    why = uring.probe()
    if why is None:
        log.info("page reader: io_uring (native _uring)")
        return "uring"
    if aio.available():
        log.info("page reader: Linux AIO (native _pread); io_uring unavailable: %s", why)
        return "aio"
    log.warning("page reader: Python threads (os.preadv); io_uring unavailable: %s; _pread not built", why)
    return "threads"


def open_reader(queue_depth: int = DEFAULT_QUEUE_DEPTH, backend: str = "auto") -> PageReader:
    """A reader of the named backend; ``auto``: the best one this host can run (see
    :func:`best_backend`); ``native``: the best native one, or ValueError."""
    if queue_depth < 1:
        raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
    if backend not in BACKENDS:
        raise ValueError(f"reader backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    from . import aio, threads, uring

    if backend in ("auto", "native"):
        asked, backend = backend, best_backend()
        if backend == "threads" and asked == "native":
            raise ValueError("reader backend 'native' asked for but neither engram_store.native._uring (io_uring) "
                             "nor _pread (Linux AIO) can run here")
    if backend == "uring":
        why = uring.probe()
        if why is not None:
            raise ValueError(f"reader backend 'uring' asked for but io_uring cannot be used: {why}")
        return uring.UringReader(queue_depth)
    if backend == "aio":
        if not aio.available():
            raise ValueError("reader backend 'aio' asked for but engram_store.native._pread is not built")
        return aio.AioReader(queue_depth)
    return threads.ThreadReader(queue_depth)
