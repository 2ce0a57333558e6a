"""Plan lookups, the store's side: counters and the background admission of planned rows.

A plan lookup (:meth:`.tiered.TieredStore.plan_into`) copies the rows a cached
layer holds in DRAM and hands back a :class:`~engram_store.wire.frames.ReadPlan`
of the others, without reading them: the client reads those pages itself (from
NVMe into host or device memory) and checks them. So that hot rows still end up
in DRAM, the planned rows are offered to :class:`Admitter`, a single background
thread that reads them through the normal NVMe path (every page checked against
its crc32c; a corrupt page is marked and its rows never admitted) and admits them
per the cache's policy. Its queue is bounded in rows: when it is full the rows
are dropped (counted), never waited for; a plan reply never waits on NVMe.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, fields
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

MAX_QUEUED_ROWS = 1 << 18  # planned rows waiting for background admission at most; more are dropped


@dataclass
class PlanCounters:
    """Cumulative counters of plan lookups (``store_plan_*`` in the daemon's stats). Rows count
    positions of requests, duplicates included; ``admit_*`` count distinct rows."""

    requests: int = 0  # plan lookups answered
    rows: int = 0  # positions asked for
    rows_dram: int = 0  # positions written from the DRAM cache
    rows_planned: int = 0  # positions left to the client's read plan
    pages_planned: int = 0  # distinct pages in the plans sent
    rows_served: int = 0  # positions served by the daemon instead (resident layer, plan too large)
    admit_queued_rows: int = 0  # distinct planned rows queued for background admission
    admit_dropped_rows: int = 0  # ... dropped because the queue was full
    admitted_rows: int = 0  # ... read, checked and admitted into the cache
    admit_bytes_read: int = 0  # bytes the background admission read from NVMe

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"plan_{f.name}": getattr(self, f.name) for f in fields(self)}


class Admitter:
    """One background thread that admits planned rows: ``admit(layer, rows)`` (distinct
    sorted int64 rows) is called for each queued batch, in order. ``offer`` never blocks.
    Started at the first offer; :meth:`stop` drops what is queued and joins the thread."""

    def __init__(self, admit: Callable[[int, np.ndarray], None], counters: PlanCounters,
                 max_rows: int = MAX_QUEUED_ROWS) -> None:
        self._admit, self._counters, self._max_rows = admit, counters, max_rows
        self._queue: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def offer(self, layer: int, rows: np.ndarray) -> bool:
        """Queue ``rows`` of ``layer`` for admission; False (dropped, counted) when the queue is full."""
        with self._cond:
            if self._stopped or self._queued + len(rows) > self._max_rows:
                self._counters.add(admit_dropped_rows=len(rows))
                return False
            self._queue.append((layer, rows))
            self._queued += len(rows)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="engram-plan-admit", daemon=True)
                self._thread.start()
            self._cond.notify()
        self._counters.add(admit_queued_rows=len(rows))
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                layer, rows = self._queue.popleft()
                self._queued -= len(rows)
            try:
                self._admit(layer, rows)
            except Exception:  # a failed read must not end the thread; the client had its plan anyway
                log.exception("background admission of %d planned rows of layer %d failed", len(rows), layer)

    def idle(self) -> bool:
        """Nothing queued (a batch may still be being read)."""
        with self._cond:
            return not self._queue

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._counters.add(admit_dropped_rows=self._queued)
            self._queue.clear()
            self._queued = 0
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
