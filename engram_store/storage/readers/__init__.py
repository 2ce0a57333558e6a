"""Page readers: what moves 4 KiB pages of a layer file into memory, one module per backend.

A :class:`PageReader` reads extents (file offset, length) of an ``O_DIRECT``
file descriptor with ``queue_depth`` reads in flight. :func:`open_reader` picks
the backend by a probe, once per process, and logs the choice:

- ``aio`` (:mod:`.aio`): Linux AIO from one thread in native code (``_pread.c``),
  the GIL released for the whole batch; it also *streams rows*: reads land in a
  small ring of slots and each row is copied out (after its page's crc32c
  check) as soon as its read completes;
- ``threads`` (:mod:`.threads`): a pool of threads calling ``os.preadv``, the
  fallback when the native module is not built (correct, about half of fio's IOPS).

``native`` asks for the best native backend and fails when none is built.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH = 64
MAX_NATIVE_QD = 256  # the native readers clamp queue depth here
MAX_CHECKED_PAGES = 64  # the native readers check extents of at most this many pages
BACKENDS = ("auto", "native", "aio", "threads")


class PageReader(Protocol):
    """Reads extents of a file into a buffer. Thread-safe: any thread may call any method;
    each call blocks its caller until every read of the call has completed."""

    name: str  # the backend ("aio", "threads")
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
                  page_crcs: np.ndarray | None = None) -> tuple[int, np.ndarray]:
        """Only where ``streams_rows``: read extent i into a slot of ``scratch`` (aligned, at
        least ``min(queue_depth, MAX_NATIVE_QD) * max extent`` bytes) and copy rows
        ``first_row[i]:first_row[i+1]`` of ``out`` (uint8 ``[n, row_bytes]``) from the slot at
        ``row_offsets``, as soon as that read completes. With ``page_crcs`` (uint32, expected
        crc32c of every page of the file) each page is checked first and the rows of a page
        that fails are not copied. Returns (bytes read, int64 page numbers that failed)."""
        ...

    def close(self) -> None:
        """Release threads and kernel contexts; the reader is unusable afterwards."""
        ...


def open_reader(queue_depth: int = DEFAULT_QUEUE_DEPTH, backend: str = "auto") -> PageReader:
    """A reader of the named backend; ``auto``: the best one this host can run."""
    if queue_depth < 1:
        raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
    if backend not in BACKENDS:
        raise ValueError(f"reader backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    from . import aio, threads

    if backend in ("auto", "native", "aio") and aio.available():
        return aio.AioReader(queue_depth)
    if backend in ("native", "aio"):
        raise ValueError(f"reader backend {backend!r} asked for but engram_store.native._pread is not built")
    return threads.ThreadReader(queue_depth)
