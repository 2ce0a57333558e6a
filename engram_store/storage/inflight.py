"""NVMe reads in flight, shared: concurrent lookups that miss the same rows read them once.

The TP ranks of an SGLang server (its shared host-table layout gathers every head on every rank)
ask the daemon for the very same rows of a cached layer at the same moment, and prefetching
clients overlap. A lookup claims the missing rows no other lookup of the layer is reading now
(:meth:`InFlight.claim`), reads them, and publishes the bytes (:meth:`InFlight.done`); a lookup
whose missing rows are being read by another waits for that read and copies the rows from it.

Vectorized: a claim compares the sorted rows with each read in flight of the layer (a
``searchsorted``; there are at most as many reads in flight as lookup workers), never row by row.
A read that fails, or a wait past :data:`WAIT_SECONDS`, leaves the waiter to read those rows itself.
A lookup never waits behind a much larger read still in progress (more than :data:`WAIT_MAX_ROWS`
rows and :data:`WAIT_RATIO` times its own: a prefill chunk's, when the lookup is a decode step's):
it reads those few rows itself, so a step's latency never becomes a chunk's.

The hint reader (:mod:`.hint_reader`) claims its rows too (``hint=True``): its claims never wait
(rows a lookup is reading are left out), and it reads only while no lookup reads
(:meth:`InFlight.wait_for_lookups`). A lookup that claims rows to read, or waits for a hint's read,
raises :attr:`InFlight.hint_stop`: the hint read queues no more pages and ends within the reads it
has in flight; a read ended early publishes the rows it read (``valid``), its waiters read the others.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

WAIT_SECONDS = 30.0  # the longest a lookup waits for another's read of its rows, then reads them itself
WAIT_MAX_ROWS, WAIT_RATIO = 8192, 4  # a lookup waits for reads of at most max(these rows, RATIO x its own)


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
    valid: int | None = None  # rows[:valid] were read (a read that gave way); None: all of them


@dataclass
class Wait:
    """Rows of a claim that another lookup's read brings: ``at`` in the claim, ``pos`` in the read."""

    read: Read
    at: np.ndarray
    pos: np.ndarray

    def take(self, out: np.ndarray) -> np.ndarray:
        """Copy the rows into ``out[at]`` once the read is over; returns which of them were copied (bool, per
        ``at``): none when it failed or took too long, those it read when it gave way early."""
        read = self.read
        if not read.finished.wait(WAIT_SECONDS) or read.failed or read.data is None:
            return np.zeros(len(self.at), dtype=bool)
        got = np.ones(len(self.at), dtype=bool) if read.valid is None else self.pos < read.valid
        out[self.at[got]] = read.data[self.pos[got]]
        return got


class InFlight:
    """The reads in flight of a store. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # notified whenever a read ends
        self._reads: list[Read] = []
        self._lookups = 0  # reads in flight that are lookups' (not the hint reader's)
        self.hint_stop = np.zeros(1, dtype=np.int32)  # raised by a lookup's claim: the hint read gives way
        self.shared_rows = 0  # rows a lookup took from another's read instead of reading them

    def claim(self, layer: int, rows: np.ndarray, *, hint: bool = False,
              cached: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[Read | None, np.ndarray, list[Wait]]:
        """For sorted distinct ``rows`` of ``layer``: (the read of the rows nobody is reading, or None;
        their positions in ``rows``; the waits for the others). ``hint``: the hint reader's claim: no
        waits (the rows others are reading are simply not in the read). ``cached(rows) -> bool mask``: rows
        to leave out as well, asked under the claims' lock (a lookup puts its rows in the cache before it
        lets go of its read: so none is read twice)."""
        waits = []
        with self._lock:
            taken = np.zeros(len(rows), dtype=bool) if cached is None else cached(rows)
            most = max(WAIT_MAX_ROWS, WAIT_RATIO * len(rows))
            for read in self._reads:
                covered = read.rows if read.valid is None else read.rows[: read.valid]  # a read that gave way
                if read.layer != layer or not len(covered):
                    continue
                if not hint and not read.hint and len(read.rows) > most and not read.finished.is_set():
                    continue  # a much larger read (a prefill chunk's): read these rows rather than wait for it
                pos = np.minimum(np.searchsorted(covered, rows), len(covered) - 1)
                hit = (covered[pos] == rows) & ~taken
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
            if read is not None or any(w.read.hint for w in waits):
                self.hint_stop[0] = 1  # a lookup reads now: the hint read stops queueing pages
            self.shared_rows += int(np.count_nonzero(taken))
        return read, mine, waits

    def done(self, read: Read, data: np.ndarray | None, bad_pages: np.ndarray | None = None,
             valid: int | None = None, keep: bool = False) -> None:
        """Publish ``read``'s rows (``data`` None: the read failed; ``valid``: only its first rows were read)
        and release its waiters. ``keep``: its rows stay claimed (later claims take them from ``data``), and
        a lookup's read counts as reading, until :meth:`release`: a lookup keeps its read until its rows are
        in the cache, so that nobody (the hint reader least) reads them again in between."""
        read.data = data
        read.failed = data is None
        if bad_pages is not None:
            read.bad_pages = bad_pages
        with self._lock:
            read.valid = valid  # under the lock: claims read it
            if not keep:
                self._reads.remove(read)
                self._lookups -= not read.hint
                self._quiet.notify_all()
        read.finished.set()

    def release(self, read: Read) -> None:
        """A read kept by :meth:`done` is no longer claimed."""
        with self._lock:
            self._reads.remove(read)
            self._lookups -= not read.hint
            self._quiet.notify_all()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """A lookup's reads, from its claim to its last wait: it counts as reading (the hint reader waits) and
        raises :attr:`hint_stop` (a hint read in flight gives way)."""
        with self._lock:
            self._lookups += 1
            self.hint_stop[0] = 1
        try:
            yield
        finally:
            with self._lock:
                self._lookups -= 1
                self._quiet.notify_all()

    def wait_for_lookups(self, timeout: float) -> bool:
        """Block until no lookup is reading (True) or ``timeout`` seconds pass (False)."""
        with self._quiet:
            return self._quiet.wait_for(lambda: not self._lookups, timeout)

    @property
    def lookups_reading(self) -> int:
        return self._lookups
