"""Client-side bookkeeping of the shared region: its allocator. (The mapped arena is
``engram_store.format.arena_layout.ArenaView``.)"""

from __future__ import annotations

import threading
import time

from .. import errors

ALLOC_TIMEOUT = 30.0  # seconds a lookup waits for shared-region space before ResourceExhausted


class Extents:
    """First-fit allocator of aligned extents of the shared region."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, bytes), sorted, merged
        self.cond = threading.Condition()

    def try_alloc(self, nbytes: int) -> int | None:
        with self.cond:
            return self._take(nbytes)

    def alloc(self, nbytes: int, timeout: float = ALLOC_TIMEOUT) -> int:
        if nbytes > self.size:
            raise errors.ResourceExhausted(f"a lookup needs {nbytes} bytes of shared region, the region has {self.size}; "
                                           "use lookup_into (it splits) or connect with a larger shm_bytes")
        deadline = time.monotonic() + timeout
        with self.cond:
            while (off := self._take(nbytes)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.ResourceExhausted(f"no {nbytes} bytes of shared region free after {timeout:.0f}s: "
                                                   "release lookup views you no longer need")
                self.cond.wait(left)
            return off

    def _take(self, nbytes: int) -> int | None:
        for i, (off, size) in enumerate(self.free):
            if size >= nbytes:
                self.free[i:i + 1] = [(off + nbytes, size - nbytes)] if size > nbytes else []
                return off
        return None

    def release(self, off: int, nbytes: int) -> None:
        with self.cond:
            self.free.append((off, nbytes))
            self.free.sort()
            merged: list[tuple[int, int]] = []
            for o, s in self.free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self.free = merged
            self.cond.notify_all()
