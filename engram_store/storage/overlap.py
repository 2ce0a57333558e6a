"""Helper threads for the CPU work a lookup can do beside its NVMe reads.

A cached-layer lookup with both hits and misses has work that does not depend on its reads:
copying the hits out of the row cache's slots. :class:`ReadOverlap` runs it on one of a few helper
threads (the copy is a native gather that releases the GIL) while the calling thread reads the
misses, so the reads start at once and the caller never waits for a thread hand-off after them: the
copy is long done when they end (:meth:`Future.result` returns at once).

Bounded: at most ``threads`` tasks run on helpers at once. :meth:`start` never queues a task
behind another lookup's: with every helper busy it returns None and the caller does the work on its
own thread, as it would without helpers.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class ReadOverlap:
    """Up to ``threads`` helper threads for work a lookup overlaps with its reads. Thread-safe."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None  # made on first use: a resident store never needs it
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False
        self.started = 0  # tasks run on a helper (for tests and stats)

    def start(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        """Run ``fn(*args)`` on an idle helper and return its future, or None (every helper busy, or
        closed): then the caller runs it itself."""
        with self._lock:
            if self._closed or self._busy >= self.threads:
                return None
            self._busy += 1
            self.started += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="engram-nvme-overlap")
            pool = self._pool
        try:
            return pool.submit(self._run, fn, args)
        except RuntimeError:  # shut down meanwhile
            self._done()
            return None

    def _run(self, fn: Callable[..., Any], args: tuple) -> Any:
        try:
            return fn(*args)
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._busy -= 1

    def close(self) -> None:
        """Wait for the tasks running on helpers, then end the threads. Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
