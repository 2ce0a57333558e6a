"""What every page reader shares: the :class:`PageReader` protocol and the queue-depth and page-check limits
of the native readers."""

from __future__ import annotations

from typing import Protocol

import numpy as np

DEFAULT_QUEUE_DEPTH = 64
MAX_NATIVE_QD = 256  # the native readers clamp queue depth here
MAX_CHECKED_PAGES = 64  # the native readers check extents of at most this many pages


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
