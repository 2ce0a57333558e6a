"""A lookup's NVMe reads on a helper thread, so that its CPU work runs while the pages come.

A cached-layer lookup with both hits and misses has CPU work that does not depend on its reads:
copying the hits out of the row cache's slots. :class:`ReadOverlap` runs the reads (which release
the GIL for their whole batch) on one of a few helper threads while the calling thread copies the
hits; the caller then waits for the reads (:meth:`Future.result`). Each helper thread keeps its own
ring of the page reader, as every reading thread does.

Bounded: at most ``threads`` reads run on helpers at once. :meth:`start` never queues a read
behind another lookup's: with every helper busy it returns None and the caller reads on its own
thread, as it would without helpers.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class ReadOverlap:
    """Up to ``threads`` helper threads for reads a lookup overlaps with its own work. Thread-safe."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None  # made on first use: a resident store never needs it
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False
        self.started = 0  # reads run on a helper (for tests and stats)

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
        """Wait for the reads running on helpers, then end the threads. Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
