"""The hints component of a :class:`~.tiered.TieredStore`: the store's side of :mod:`.hint_queue`.

``hint(layer, rows, key, holder)`` queues rows an engine will look up soon; the store's hint reader
(:mod:`.hint_reader`) reads their pages behind the lookups and puts the rows into the cache's
hinted share (:meth:`~.row_cache.RowCache.admit_hinted`), every page checked against its crc32c as
any read. ``withdraw(key, holder)`` drops what a finished request still had queued. A hint for a
resident layer, or a store with hints off (``HintSettings.cache_share`` 0), queues nothing.
"""

from __future__ import annotations

import time

import numpy as np

from typing import Collection, Mapping

from ..errors import StorageError
from ..format import requests
from .close_gate import CloseGate
from .hint_queue import ROW_BYTES, HintCounters, HintQueue, HintSettings
from .hint_reader import STARVE_SECONDS, HintReader
from .inflight import InFlight
from .integrity import PageHealth
from .layer_file import LayerFile
from .nvme import NvmeTier
from .parts import PageChecks
from .request_checks import checked_layer
from .row_cache import RowCache

STARVED_READS = 4  # lookups read for STARVE_SECONDS on end: this many times the hint queue depth in rows go anyway
ADMIT_PATIENCE_SECONDS = 0.05  # the hint reader waits this long at most for slots evicted under readers
NO_SLOT_PAUSE_SECONDS = 0.25  # the cache had no free or cold slot for a hinted row: read none for this long

class HintService:
    """A store's hints: their queue, their reader thread and their counters. ``settings``: how hinted rows
    are read and kept (default: :class:`~.hint_queue.HintSettings`'s defaults). Thread-safe."""

    def __init__(self, settings: HintSettings | None, files: Mapping[int, LayerFile], resident: Collection[int],
                 cache: RowCache | None, nvme: NvmeTier, inflight: InFlight, health: PageHealth, gate: CloseGate,
                 checks: PageChecks, row_bytes: int) -> None:
        self._files, self._resident, self._cache, self._nvme = files, resident, cache, nvme
        self._inflight, self._health, self._gate, self._checks, self._row_bytes = inflight, health, gate, checks, row_bytes
        self.settings = settings or HintSettings()
        self._hint_counters = HintCounters()
        self._hints = HintQueue(self.settings, self._hint_counters)
        self._hint_reader = HintReader(self._hints, self._hint_room, self._read_hinted, self._settle_hints)

    # --- the daemon's side -------------------------------------------------------------------
    def hint(self, layer: int, row_ids: np.ndarray, key: int, holder: str, *, rate_limited: int = 0,
             owner: str | None = None) -> int:
        """Queue ``row_ids`` of ``layer`` (any integer array; in the order the engine will ask for them)
        as the hint ``key`` of ``holder`` (a connection of the client ``owner``; default: a client of its
        own); returns the rows queued. Never waits for NVMe.
        ``rate_limited``: rows of this hint the caller dropped for the client's rate (counted). Raises
        UnknownLayer, RowOutOfRange or InvalidRequest for bad input, StorageError when the layer is
        unavailable or the store closed."""
        lf = checked_layer(self._files, layer)
        rows = requests.flat_row_ids(requests.row_ids(row_ids))
        requests.check_bounds(lf.layer, rows, lf.layout.rows)
        if lf.file is None:
            raise StorageError(f"layer {lf.layer} is unavailable: {lf.error}")
        self._gate.enter()
        try:
            if lf.layer in self._resident or self._cache is None or not self.settings.enabled or not len(rows):
                self._hint_counters.add(requests=1, rows_received=len(rows) + rate_limited, rows_skipped=len(rows))
                self._hint_counters.drop("rate", rate_limited)
                return 0
            queued = self._hints.add(lf.layer, rows, int(key), holder, rate_limited, owner=owner)
            if queued:
                self._hint_reader.start()
            return queued
        finally:
            self._gate.exit()

    def withdraw(self, key: int, holder: str) -> int:
        """``holder`` no longer needs its client's hint ``key`` (its request finished or was aborted): rows
        no other holder holds are dropped unread. Returns those rows."""
        return self._hints.withdraw(int(key), holder)

    def withdraw_holder(self, holder: str) -> int:
        """``holder`` is gone: every hint it holds is withdrawn."""
        return self._hints.withdraw_holder(holder)

    def idle(self) -> bool:
        """No hint queued and none being read (rows read are in the cache's hinted share)."""
        return self._hint_reader.idle()

    def stats(self) -> dict[str, int | float]:
        d = self._hint_counters.snapshot()
        d["hint_rows_queued"] = self._hints.queued_rows
        d["hint_queued_bytes"] = self._hints.queued_cost * ROW_BYTES  # ids and bookkeeping: what the bound counts
        d["hint_cache_slots_used"] = self._cache.hinted_count if self._cache is not None else 0
        d["hint_cache_slots_limit"] = self._hint_limit()
        return d

    def stop(self) -> None:
        """Drop the queued hints and wait for the chunk being read (before the store closes its gate)."""
        self._hint_reader.stop()

    # --- the hint reader's side ---------------------------------------------------------------
    def _hint_limit(self) -> int:
        return int(self._cache.n_slots * self.settings.cache_share) if self._cache is not None else 0

    def _hint_room(self) -> int:
        """Slots the hinted share may still take: none for a while after the cache had no free or cold slot
        (every row in it one that lookups keep hitting), so the reader waits instead of reading rows it
        could not keep."""
        if time.monotonic() - self._cache.hint_no_slot_at < NO_SLOT_PAUSE_SECONDS:
            return 0
        return self._hint_limit() - self._cache.hinted_count

    def _settle_hints(self) -> None:
        if self._cache is None:
            return
        handed, freed = self._cache.settle_hints(time.monotonic(), self.settings.max_age_seconds)
        self._hint_counters.add(rows_hit=handed)
        self._hint_counters.drop("expired", freed)

    def _read_hinted(self, layer: int, rows: np.ndarray) -> None:
        """One batch of a hint: its rows not in DRAM, read behind the lookups (a read that a lookup interrupts
        resumes once no lookup reads), checked, and put into the hinted share."""
        try:
            self._gate.enter()
        except StorageError:
            return  # closing
        try:
            want = np.unique(rows[self._not_cached(layer, rows)])
            skipped = len(rows) - len(want)
            while len(want):
                if self._hint_reader.stopping.is_set():  # closing: the rest is dropped
                    self._hint_counters.drop("withdrawn", len(want))
                    break
                quiet = self._inflight.wait_for_lookups(STARVE_SECONDS)
                self._inflight.hint_stop[0] = 0
                # lookups kept reading all along: a few pages go anyway, whatever they do (hints still move)
                candidates = want if quiet else want[: STARVED_READS * self.settings.queue_depth]
                rest = want[len(candidates):]
                read, mine, _ = self._inflight.claim(layer, candidates, hint=True,  # rows in DRAM now left out too
                                                     cached=lambda r: ~self._not_cached(layer, r))
                skipped += len(candidates) - len(mine)  # in DRAM now, or being read by a lookup
                want = rest if read is None else np.concatenate([self._read_hint_rows(layer, read, quiet), rest])
            self._hint_counters.add(rows_skipped=skipped)
        finally:
            self._gate.exit()

    def _read_hint_rows(self, layer: int, read, give_way: bool) -> np.ndarray:
        """Read ``read``'s rows (with ``give_way``, until a lookup raises the stop flag); put those read into
        the hinted share. Returns the rows not read (a lookup interrupted the read)."""
        lf, settings = self._files[layer], self.settings
        data = np.empty((len(read.rows), self._row_bytes), dtype=np.uint8)
        try:
            rs = self._nvme.read_rows(layer, read.rows, data, queue_depth=settings.queue_depth,
                                      stop=self._inflight.hint_stop if give_way else None)
        except BaseException:
            self._inflight.done(read, None)
            raise
        done = len(read.rows) if rs.rows_read is None else rs.rows_read
        # kept claimed until its rows are in the cache: a lookup that misses them meanwhile takes them from here
        self._inflight.done(read, data, rs.bad_pages, None if done == len(read.rows) else done, keep=True)
        try:
            rows, data = read.rows[:done], data[:done]
            self._checks.clear_good(layer, rows, rs.bad_pages, "a hint read")
            if len(rs.bad_pages):  # their rows are not kept (counted as skipped); a lookup of them is refused
                self._health.mark(layer, rs.bad_pages, "a hint read")
                good = ~np.isin(rows // lf.layout.rows_per_page, rs.bad_pages)
                self._hint_counters.add(rows_skipped=int(np.count_nonzero(~good)))
                rows, data = rows[good], data[good]
            put, cached = self._cache.admit_hinted(layer, rows, data, self._hint_limit(), time.monotonic(),
                                                   patience=ADMIT_PATIENCE_SECONDS)
        finally:
            self._inflight.release(read)
        self._hint_counters.add(rows_read=put, rows_skipped=cached, pages_read=rs.pages, bytes_read=rs.bytes,
                                read_seconds=rs.seconds)  # cached: a lookup that shared the read admitted them
        self._hint_counters.drop("no_room", len(rows) - put - cached)  # share full, or no slot free at once
        return read.rows[done:]

    def _not_cached(self, layer: int, rows: np.ndarray) -> np.ndarray:
        cache = self._cache
        with cache.lock:
            return cache.maps[cache.layer_index[layer]][rows] == 0
