"""The fallback page reader: a pool of threads calling ``os.preadv``, one Python call per read."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class ThreadReader:
    """:class:`~engram_store.native.readers.PageReader` over ``os.preadv`` on up to
    ``queue_depth`` threads. Does not stream rows (the NVMe tier reads chunks instead)."""

    name = "threads"
    streams_rows = False

    def __init__(self, queue_depth: int) -> None:
        self.queue_depth = queue_depth
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def read(self, fd: int, buf, file_offsets: np.ndarray, lengths: np.ndarray, buf_offsets: np.ndarray,
             queue_depth: int | None = None) -> int:
        qd = queue_depth or self.queue_depth
        n = len(file_offsets)
        if n == 0:
            return 0
        mv = memoryview(buf).cast("B")
        offs, lens, dsts = (np.asarray(a, dtype=np.int64).tolist() for a in (file_offsets, lengths, buf_offsets))

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

    def read_rows(self, *args, **kwargs) -> tuple[int, np.ndarray]:
        raise ValueError("the threads reader does not stream rows (read_rows needs a native reader)")

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(self.queue_depth, 1), thread_name_prefix="engram-pread")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
