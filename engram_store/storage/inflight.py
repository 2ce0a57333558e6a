"""NVMe reads in flight, shared: concurrent lookups that miss the same rows read them once.

The TP ranks of an SGLang server (its shared host-table layout gathers every head on every rank)
ask the daemon for the very same rows of a cached layer at the same moment, and prefetching
clients overlap. A lookup claims the missing rows no other lookup of the layer is reading now
(:meth:`InFlight.claim`), reads them, and publishes the bytes (:meth:`InFlight.done`); a lookup
whose missing rows are being read by another waits for that read and copies the rows from it.

Vectorized: a claim compares the sorted rows with each read in flight of the layer (a
``searchsorted``; there are at most as many reads in flight as lookup workers), never row by row.
A read that fails, or a wait past :data:`WAIT_SECONDS`, leaves the waiter to read those rows itself.

The hint reader (:mod:`.hint_reader`) claims its rows too (``hint=True``): a lookup missing rows it
is reading waits for them as for any read, and its claims never wait: rows a lookup is reading are
left out (``skip_taken``). It reads only while no lookup reads (:meth:`InFlight.wait_for_lookups`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

WAIT_SECONDS = 30.0  # the longest a lookup waits for another's read of its rows, then reads them itself


@dataclass(eq=False)
class Read:
    """One lookup's read of distinct rows of a layer, shared with the lookups that wait for it."""

    layer: int
    rows: np.ndarray  # sorted, distinct int64
    data: np.ndarray | None = None  # [len(rows), row_bytes] once read
    bad_pages: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # pages that failed their check
    failed: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    hint: bool = False  # the hint reader's (lookups' reads go first)


@dataclass
class Wait:
    """Rows of a claim that another lookup's read brings: ``at`` in the claim, ``pos`` in the read."""

    read: Read
    at: np.ndarray
    pos: np.ndarray

    def take(self, out: np.ndarray) -> bool:
        """Copy the rows into ``out[at]`` once the read is over; False when it failed or took too long."""
        if not self.read.finished.wait(WAIT_SECONDS) or self.read.failed or self.read.data is None:
            return False
        out[self.at] = self.read.data[self.pos]
        return True


class InFlight:
    """The reads in flight of a store. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # notified whenever a read ends
        self._reads: list[Read] = []
        self._lookups = 0  # reads in flight that are lookups' (not the hint reader's)
        self.shared_rows = 0  # rows a lookup took from another's read instead of reading them

    def claim(self, layer: int, rows: np.ndarray, *, hint: bool = False) -> tuple[Read | None, np.ndarray, list[Wait]]:
        """For sorted distinct ``rows`` of ``layer``: (the read of the rows nobody is reading, or None;
        their positions in ``rows``; the waits for the others). ``hint``: the hint reader's claim: no
        waits (the rows others are reading are simply not in the read)."""
        taken = np.zeros(len(rows), dtype=bool)
        waits = []
        with self._lock:
            for read in self._reads:
                if read.layer != layer or not len(read.rows):
                    continue
                pos = np.minimum(np.searchsorted(read.rows, rows), len(read.rows) - 1)
                hit = (read.rows[pos] == rows) & ~taken
                if hit.any():
                    at = np.flatnonzero(hit)
                    waits.append(Wait(read, at, pos[at]))
                    taken |= hit
            mine = np.flatnonzero(~taken)
            read = Read(layer, rows[mine], hint=hint) if len(mine) else None
            if read is not None:
                self._reads.append(read)
                self._lookups += not hint
            if hint:
                return read, mine, []
            self.shared_rows += int(np.count_nonzero(taken))
        return read, mine, waits

    def done(self, read: Read, data: np.ndarray | None, bad_pages: np.ndarray | None = None) -> None:
        """Publish ``read``'s rows (``data`` None: the read failed) and release its waiters."""
        read.data = data
        read.failed = data is None
        if bad_pages is not None:
            read.bad_pages = bad_pages
        with self._lock:
            self._reads.remove(read)
            self._lookups -= not read.hint
            self._quiet.notify_all()
        read.finished.set()

    def wait_for_lookups(self, timeout: float) -> bool:
        """Block until no lookup is reading (True) or ``timeout`` seconds pass (False)."""
        with self._quiet:
            return self._quiet.wait_for(lambda: not self._lookups, timeout)

    @property
    def lookups_reading(self) -> int:
        return self._lookups
