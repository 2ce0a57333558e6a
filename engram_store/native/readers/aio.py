"""The Linux AIO page reader: native code (``engram_store/native/readers/_pread.c``) from one thread."""

from __future__ import annotations

import functools
import logging

import numpy as np

from .. import load
from ..syscalls import PAGE as PAGE_BYTES

log = logging.getLogger(__name__)


@functools.cache
def native_reader():
    """The ``_pread`` extension module, or None (not built); probed once, logged."""
    module = load("_pread", "the AIO reader is unavailable (the next backend is used)")
    if module is not None:
        log.info("native reader _pread (Linux AIO) available")
    return module


def available() -> bool:
    return native_reader() is not None


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


class AioReader:
    """:class:`~engram_store.native.readers.PageReader` over Linux AIO; streams rows.
    Each call sets up its own AIO context, so concurrent calls never share one."""

    name = "aio"
    streams_rows = True

    def __init__(self, queue_depth: int) -> None:
        self.queue_depth = queue_depth
        self._native = native_reader()
        if self._native is None:
            raise ValueError("the AIO reader needs engram_store.native._pread, which is not built")

    def read(self, fd: int, buf, file_offsets: np.ndarray, lengths: np.ndarray, buf_offsets: np.ndarray,
             queue_depth: int | None = None) -> int:
        return self._native.read_batch(fd, buf, _i64(file_offsets), _i64(lengths), _i64(buf_offsets),
                                       queue_depth or self.queue_depth)

    def read_rows(self, fd: int, out: np.ndarray, row_bytes: int, file_offsets: np.ndarray, lengths: np.ndarray,
                  first_row: np.ndarray, row_offsets: np.ndarray, scratch, queue_depth: int | None = None,
                  page_crcs: np.ndarray | None = None, stop: np.ndarray | None = None) -> tuple:
        """As the protocol says; ``stop`` is not watched (every extent is read, and said so)."""
        done = () if stop is None else (len(lengths),)
        got, bad = self._read_rows(fd, out, row_bytes, file_offsets, lengths, first_row, row_offsets, scratch,
                                   queue_depth, page_crcs)
        return (got, bad) + done

    def _read_rows(self, fd: int, out: np.ndarray, row_bytes: int, file_offsets: np.ndarray, lengths: np.ndarray,
                   first_row: np.ndarray, row_offsets: np.ndarray, scratch, queue_depth: int | None,
                   page_crcs: np.ndarray | None) -> tuple[int, np.ndarray]:
        lengths = _i64(lengths)
        args = (fd, out, row_bytes, _i64(file_offsets), lengths, _i64(first_row), _i64(row_offsets), scratch,
                queue_depth or self.queue_depth)
        if page_crcs is None:
            got, _ = self._native.read_rows(*args)
            return got, np.empty(0, dtype=np.int64)
        bad = np.empty(int(lengths.sum()) // PAGE_BYTES, dtype=np.int64)
        got, n_bad = self._native.read_rows(*args, page_crcs, bad)
        return got, bad[:n_bad]

    def close(self) -> None:
        pass
