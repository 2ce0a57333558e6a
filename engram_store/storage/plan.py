"""Plan lookups, the store's side: counters and the background admission of planned rows.

A plan lookup (:meth:`Planner.plan_into`, behind the store's ``plan_into``) copies the rows a cached
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
import os
import threading
from dataclasses import dataclass, fields
from typing import Callable, Collection, Mapping

import numpy as np

from ..errors import StorageError
from ..format import requests
from ..wire.frames import ReadPlan
from .close_gate import CloseGate
from .integrity import PageHealth
from .layer_file import LayerFile
from .parts import PageChecks, ServeRows
from .profile import AccessSampler
from .request_checks import check_request, checked_layer
from .row_cache import RowCache

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


class Planner:
    """Plan lookups of a store, and the background admission of the rows they planned. ``serve``: the
    store's plain lookup, for what a plan does not cover. Thread-safe."""

    def __init__(self, files: Mapping[int, LayerFile], resident: Collection[int], cache: RowCache | None,
                 health: PageHealth, sampler: AccessSampler, gate: CloseGate, checks: PageChecks, serve: ServeRows,
                 row_bytes: int) -> None:
        self._files, self._resident, self._cache, self._health = files, resident, cache, health
        self._sampler, self._gate, self._checks, self._serve, self._row_bytes = sampler, gate, checks, serve, row_bytes
        self.counters = PlanCounters()
        self._admitter = Admitter(self._admit_planned, self.counters)
        self._file_ids: dict[int, tuple[str, int, int]] = {}  # layer -> (absolute path, st_dev, st_ino)

    def plan_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray, max_plan_bytes: int,
                  t0: float) -> ReadPlan | None:
        """The store's ``plan_into`` (which see), inside its close gate; ``t0``: when the request began."""
        lf = checked_layer(self._files, layer)
        flat, out2 = check_request(lf, row_ids, out, self._row_bytes)
        n = len(flat)
        if lf.layer in self._resident or lf.file is None or lf.crcs is None or lf.stripes or self._cache is None or not n:
            self._serve(layer, row_ids, out, t0)
            self.counters.add(requests=1, rows=n, rows_served=n)
            return None
        requests.check_bounds(lf.layer, flat, lf.layout.rows)
        if self._health.has_bad(lf.layer) and self._health.bad_rows(lf.layer, flat).any():
            # rows of pages marked bad: read and checked here as by lookup_into, which refuses them
            # or finds them good again (cleared), so a plan and a plain lookup always agree
            self._serve(layer, row_ids, out, t0)
            self.counters.add(requests=1, rows=n, rows_served=n)
            return None
        path, dev, ino = self._file_id(lf)
        cache = self._cache
        token, found = cache.begin(lf.layer, flat)
        try:
            hit = found > 0
            miss = np.flatnonzero(~hit)
            rpp = lf.layout.rows_per_page
            distinct, inverse = np.unique(flat[miss], return_inverse=True)
            pages, page_of_distinct = np.unique(distinct // rpp, return_inverse=True)
            if ReadPlan.nbytes(len(path.encode()), len(pages), len(miss)) > max_plan_bytes:
                plan = None
            else:
                plan = ReadPlan(path, lf.file.size, dev, ino, self._row_bytes, pages, lf.crcs[pages], miss,
                                page_of_distinct[inverse], flat[miss] % rpp)
                if len(miss) < n:
                    at = np.flatnonzero(hit)
                    out2[at] = cache.slots[found[at] - 1]
        finally:
            cache.end(token)  # slots read above may be reused from here on
        if plan is None:  # too large to send: served here like any lookup
            self._serve(layer, row_ids, out, t0)
            self.counters.add(requests=1, rows=n, rows_served=n)
            return None
        self._sampler.record(lf.layer, flat)
        self.counters.add(requests=1, rows=n, rows_dram=n - len(miss), rows_planned=len(miss),
                          pages_planned=len(pages))
        if len(miss):
            self._admitter.offer(lf.layer, distinct)
        return plan if len(miss) else None

    def _file_id(self, lf: LayerFile) -> tuple[str, int, int]:
        """(absolute path, st_dev, st_ino) of the file the NVMe tier reads for ``lf``."""
        got = self._file_ids.get(lf.layer)
        if got is None:
            st = os.fstat(lf.file.fd)
            got = self._file_ids[lf.layer] = (os.path.abspath(lf.path), st.st_dev, st.st_ino)
        return got

    def _admit_planned(self, layer: int, rows: np.ndarray) -> None:
        """The background admission of planned rows (the :class:`Admitter`'s thread): those not
        cached meanwhile are read from NVMe, checked, and offered to the cache."""
        try:
            self._gate.enter()
        except StorageError:
            return  # closing
        try:
            cache = self._cache
            li = cache.layer_index[layer]
            with cache.lock:
                rows = rows[cache.maps[li][rows] == 0]
            if not len(rows):
                return
            rows, data, nbytes = self._checks.read_verified(layer, rows, "a background admission")
            admitted = cache.admit(layer, rows, data) if len(rows) else 0
            self.counters.add(admitted_rows=admitted, admit_bytes_read=nbytes)
        finally:
            self._gate.exit()

    def idle(self) -> bool:
        """No planned rows wait for background admission."""
        return self._admitter.idle()

    def stop(self) -> None:
        """Drop the queued admissions and wait for the one being read (before the store closes its gate)."""
        self._admitter.stop()
