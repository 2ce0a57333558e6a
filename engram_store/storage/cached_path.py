"""The cached layers' lookups: hits gathered from the row cache's slots, misses read from NVMe (shared
with lookups reading the same pages now, :mod:`.inflight`), each page checked against its crc32c,
verified rows offered to the cache, rows of corrupt pages refused with CorruptRows."""

from __future__ import annotations

import functools
import time
from typing import Mapping

import numpy as np

from ..errors import StorageError
from ..format import requests
from ..native.gather import Gatherer
from .close_gate import CloseGate
from .inflight import InFlight
from .integrity import PageHealth
from .layer_file import LayerFile
from .nvme import NvmeTier, ReadStats
from .overlap import ReadOverlap
from .parts import PageChecks
from .profile import AccessSampler
from .row_cache import RowCache
from .stats import LookupStats, StoreCounters

OVERLAP_MIN_HITS = 256  # a lookup with fewer hits copies them itself, before its reads (a hand-off costs more)
MAX_RECLAIMS = 3  # rows a read that gave way left: claimed again this many times at most, then read unclaimed
AFTER_REPLY_PATIENCE_SECONDS = 0.005  # an admission after the reply waits this long at most for evicted slots


class CachedPath:
    """Lookups of the cached layers of ``cache`` (None: the store has none, and this is never asked).
    Thread-safe: any number of lookups at once."""

    def __init__(self, cache: RowCache | None, gather: Gatherer, overlap: ReadOverlap, inflight: InFlight,
                 nvme: NvmeTier, health: PageHealth, files: Mapping[int, LayerFile], sampler: AccessSampler,
                 counters: StoreCounters, gate: CloseGate, checks: PageChecks, row_bytes: int) -> None:
        self._cache, self._gather, self._overlap, self._inflight = cache, gather, overlap, inflight
        self._nvme, self._health, self._files, self._sampler = nvme, health, files, sampler
        self._counters, self._gate, self._checks, self._row_bytes = counters, gate, checks, row_bytes

    def lookup(self, lf: LayerFile, flat: np.ndarray, out2: np.ndarray, t0: float,
               admit_later: list | None = None) -> LookupStats:
        """Fill ``out2`` (rows, or a SplitOut) with the rows ``flat`` of cached layer ``lf`` (checked: dtypes
        and shapes; bounds are checked here); returns the call's stats, counted. ``t0``: when the request began.
        ``admit_later``: see :meth:`_lookup_cached`."""
        requests.check_bounds(lf.layer, flat, lf.layout.rows)
        n = len(flat)
        st = LookupStats(rows=n)
        try:
            if n:
                self._lookup_cached(lf.layer, flat, out2, st, admit_later)
        except StorageError:
            self._counters.error()
            raise
        st.bytes_dram = st.rows_dram * self._row_bytes
        st.bytes_nvme = st.rows_nvme * self._row_bytes
        self._sampler.record(lf.layer, flat)
        st.seconds = time.perf_counter() - t0
        self._counters.add(st)
        return st

    def _lookup_cached(self, layer: int, flat: np.ndarray, out2: np.ndarray, st: LookupStats,
                       admit_later: list | None = None) -> None:
        """Rows in DRAM gathered from the cache's slots, the others read from NVMe (shared with
        lookups reading them now) and offered to the cache. With both kinds, a helper thread
        (:mod:`.overlap`) copies the hits into a block (and ends the cache read) while this thread
        reads the misses, which land in the same block behind them; one native gather from that
        block then fills ``out2`` (numpy's fancy indexing of 264-byte rows costs several times a
        gather). The reads never wait for a thread hand-off: the copy is long done when they end.
        With ``admit_later`` (a list) the rows read are offered to the cache by a callable appended
        to it, for the caller to run once its reply is out, instead of before returning."""
        cache, n, rb = self._cache, len(flat), self._row_bytes
        hinted = cache.hint_admissions  # hinted rows put in after this: the misses are looked up again
        token, found = cache.begin(layer, flat)
        copying = None
        try:
            hit = found > 0
            n_hit = st.rows_dram = int(np.count_nonzero(hit))
            if n_hit == n:
                self._gather.take(cache.slots, found - 1, out2)
                return
            miss = np.flatnonzero(~hit) if n_hit else None
            block = np.empty((n, rb), dtype=np.uint8)  # [hits; distinct rows read] (at most n rows)
            if n_hit:
                at = np.flatnonzero(hit)
                if n_hit >= OVERLAP_MIN_HITS:  # copied by a helper during the reads; it ends the cache read
                    copying = self._overlap.start(self.copy_hits, token, found[at] - 1, block[:n_hit])
                if copying is None:
                    self._gather.take(cache.slots, found[at] - 1, block[:n_hit])
        finally:
            if copying is None:
                cache.end(token)  # slots read above may be reused from here on
        held: list = []
        try:
            distinct, inverse, rs, shared, held = self.read_misses(layer, flat[miss] if n_hit else flat,
                                                                   block[n_hit:], hinted)
        finally:
            if copying is not None:
                copying.result()  # done long before the reads (raises what the copy raised)
        try:  # until its rows are in the cache, the read stays claimed: nobody reads them again meanwhile
            data = block[n_hit: n_hit + len(distinct)]
            self._checks.clear_good(layer, distinct, rs.bad_pages, "an NVMe read")
            if len(rs.bad_pages):
                self._refuse_read(layer, distinct, inverse, data, rs.bad_pages)
            if not n_hit:
                self._gather.take(data, inverse, out2)
            else:
                source = np.empty(n, dtype=np.int64)  # row i of out2: block[source[i]]
                source[at] = np.arange(n_hit)
                source[miss] = n_hit + inverse
                self._gather.take(block, source, out2)
            st.rows_nvme = n - n_hit
            st.nvme_rows_distinct = len(distinct) - shared
            st.nvme_rows_shared = shared - rs.rows_from_hints  # those are the hint reader's reads
            st.nvme_pages_read, st.nvme_reads, st.nvme_bytes_read = rs.pages, rs.reads, rs.bytes
            st.nvme_read_seconds = rs.seconds
            if admit_later is None:
                st.cache_admitted = cache.admit(layer, distinct, data)
            else:
                admit_later.append(functools.partial(self._admit_read, layer, distinct, data, held))
                held = []  # the admission releases them
        finally:
            for read in held:
                self._inflight.release(read)

    def copy_hits(self, token: int, slots: np.ndarray, into: np.ndarray) -> None:
        """A lookup's hits (``slots``) into ``into``, on a helper; then the lookup's cache read ends.
        (One step of :meth:`lookup`, public for a profile that times the steps one by one.)"""
        try:
            self._gather.take(self._cache.slots, slots, into)
        finally:
            self._cache.end(token)

    def read_misses(self, layer: int, missed: np.ndarray, into: np.ndarray, hinted: int | None = None) -> tuple:
        """The distinct rows of ``missed`` read into the first rows of ``into`` (C-contiguous, at least
        as many rows as ``missed``): (distinct rows, the position of each of ``missed`` among them,
        what was read, rows taken from another read, the reads held claimed: release them once their
        rows are admitted). ``hinted``: the cache's ``hint_admissions`` when the misses were found.
        (One step of :meth:`lookup`, public for a profile that times the steps one by one.)"""
        distinct, inverse = np.unique(missed, return_inverse=True)
        with self._inflight.reading():  # the hint reader gives way from here to the last wait
            rs, shared, held = self._read_missing(layer, distinct, into[: len(distinct)], hinted=hinted)
        return distinct, inverse, rs, shared, held

    def _admit_read(self, layer: int, rows: np.ndarray, data: np.ndarray, held: list = ()) -> None:
        """A lookup's rows read from NVMe offered to the cache after its reply (``admit_later``); nothing
        once the store is closing. Then its reads (``held``) are no longer claimed."""
        try:
            try:
                self._gate.enter()
            except StorageError:
                return
            try:  # after the reply: a little patience costs no lookup its time, and keeps the rows
                self._counters.admitted(self._cache.admit(layer, rows, data, patience=AFTER_REPLY_PATIENCE_SECONDS))
            finally:
                self._gate.exit()
        finally:
            for read in held:
                self._inflight.release(read)

    def _read_missing(self, layer: int, distinct: np.ndarray, data: np.ndarray, depth: int = 0,
                      hinted: int | None = None) -> tuple:
        """The bytes of sorted distinct ``distinct`` from NVMe into ``data`` (C-contiguous uint8
        ``[len(distinct), row_bytes]``): rows another lookup is reading now are taken from its read
        (:mod:`.inflight`), the others read here. Returns (what was read here, with every bad page
        met; rows taken from another read; this lookup's reads, kept claimed until released). Rows the hint
        reader put into the cache since ``hinted`` (its ``hint_admissions`` then) are copied from there."""
        read, mine, waits = self._inflight.claim(layer, distinct)
        rs = ReadStats()
        from_cache = 0
        if read is not None:
            part = data if not waits else np.empty((len(mine), self._row_bytes), dtype=np.uint8)
            try:
                have = None
                if hinted is not None and self._cache.hint_admissions != hinted:  # a hint read ended meanwhile
                    have = self._copy_cached(layer, read.rows, part)
                    from_cache = int(np.count_nonzero(have))
                if from_cache:
                    rest = np.empty((len(read.rows) - from_cache, self._row_bytes), dtype=np.uint8)
                    rs = self._nvme.read_rows(layer, read.rows[~have], rest)
                    part[~have] = rest
                else:
                    rs = self._nvme.read_rows(layer, read.rows, part)
            except BaseException:
                self._inflight.done(read, None)
                raise
            rs.rows_from_hints = from_cache
            self._inflight.done(read, part, rs.bad_pages, keep=True)
            if waits:
                data[mine] = part
        held = [read] if read is not None else []
        try:
            shared = from_cache + self._take_waits(layer, distinct, data, waits, rs, held, depth)
        except BaseException:
            for kept in held:
                self._inflight.release(kept)
            raise
        return rs, shared, held

    def _copy_cached(self, layer: int, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copy those of ``rows`` the cache holds now into ``out`` (same positions); returns which they were."""
        token, found = self._cache.begin(layer, rows)
        try:
            have = found > 0
            if have.any():
                got = np.empty((int(np.count_nonzero(have)), self._row_bytes), dtype=np.uint8)
                self._gather.take(self._cache.slots, found[have] - 1, got)
                out[have] = got
        finally:
            self._cache.end(token)
        return have

    def _take_waits(self, layer: int, distinct: np.ndarray, data: np.ndarray, waits: list, rs: ReadStats,
                    held: list, depth: int) -> int:
        """Rows others' reads bring, into ``data``; those a failed read or one that gave way did not bring are
        claimed and read here (added to ``rs``, their reads to ``held``). Returns the rows taken from
        others' reads."""
        shared = 0
        for wait in waits:
            took = wait.take(data)
            if took.any():
                shared += int(np.count_nonzero(took))
                if wait.read.hint:  # the hint reader's read: its rows count as its (hint_rows_read)
                    rs.rows_from_hints += int(np.count_nonzero(took))
                rpp = self._files[layer].layout.rows_per_page
                met = np.intersect1d(wait.read.bad_pages, distinct[wait.at[took]] // rpp)
                rs.bad_pages = np.union1d(rs.bad_pages, met).astype(np.int64)
                if took.all():
                    continue
            left = wait.at[~took]  # that read failed, or gave way before them: read them here, claimed
            part = np.empty((len(left), self._row_bytes), dtype=np.uint8)
            if depth < MAX_RECLAIMS:
                got, again, kept = self._read_missing(layer, distinct[left], part, depth + 1)
                shared += again
                held.extend(kept)
            else:
                got = self._nvme.read_rows(layer, distinct[left], part)
            data[left] = part
            rs.pages, rs.reads, rs.bytes = rs.pages + got.pages, rs.reads + got.reads, rs.bytes + got.bytes
            rs.seconds += got.seconds
            rs.rows_from_hints += got.rows_from_hints
            rs.bad_pages = np.union1d(rs.bad_pages, got.bad_pages).astype(np.int64)
        return shared

    def _refuse_read(self, layer: int, distinct: np.ndarray, inverse: np.ndarray, data: np.ndarray,
                     bad_pages: np.ndarray) -> None:
        """Rows just read include some of corrupt pages: admit the verified ones, raise CorruptRows."""
        self._health.mark(layer, bad_pages, "an NVMe read")
        bad = np.isin(distinct // self._files[layer].layout.rows_per_page, bad_pages)
        good = np.flatnonzero(~bad)
        if len(good):
            self._cache.admit(layer, distinct[good], data[good])
        raise self._health.refuse(layer, distinct[bad], int(np.count_nonzero(bad[inverse])))
