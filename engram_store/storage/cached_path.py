"""A cached layer's lookups inside :class:`~.tiered.TieredStore` (mixed into it): hits gathered from
the row cache's slots, misses read from NVMe (shared with lookups reading the same pages now,
:mod:`.inflight`), each page checked against its crc32c, verified rows offered to the cache, rows of
corrupt pages refused with CorruptRows."""

from __future__ import annotations

import functools

import numpy as np

from ..errors import StorageError
from .nvme import ReadStats
from .stats import LookupStats

OVERLAP_MIN_HITS = 256  # a lookup with fewer hits copies them itself, before its reads (a hand-off costs more)


class CachedLookups:
    """The cached-layer methods of :class:`~.tiered.TieredStore`. They use the store's own parts:
    ``_cache``, ``_gather``, ``_inflight``, ``_nvme``, ``_overlap``, ``_health``, ``_files``,
    ``_counters``, ``_enter``/``_exit`` (the close gate) and ``row_bytes``."""

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
        cache, n, rb = self._cache, len(flat), self.row_bytes
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
                    copying = self._overlap.start(self._copy_hits, token, found[at] - 1, block[:n_hit])
                if copying is None:
                    self._gather.take(cache.slots, found[at] - 1, block[:n_hit])
        finally:
            if copying is None:
                cache.end(token)  # slots read above may be reused from here on
        try:
            distinct, inverse, rs, shared = self._read_misses(layer, flat[miss] if n_hit else flat, block[n_hit:])
        finally:
            if copying is not None:
                copying.result()  # done long before the reads (raises what the copy raised)
        data = block[n_hit: n_hit + len(distinct)]
        self._clear_good(layer, distinct, rs.bad_pages, "an NVMe read")
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
        st.nvme_rows_shared = shared
        st.nvme_pages_read, st.nvme_reads, st.nvme_bytes_read, st.nvme_read_seconds = rs.pages, rs.reads, rs.bytes, rs.seconds
        if admit_later is None:
            st.cache_admitted = cache.admit(layer, distinct, data)
        else:
            admit_later.append(functools.partial(self._admit_read, layer, distinct, data))

    def _copy_hits(self, token: int, slots: np.ndarray, into: np.ndarray) -> None:
        """A lookup's hits (``slots``) into ``into``, on a helper; then the lookup's cache read ends."""
        try:
            self._gather.take(self._cache.slots, slots, into)
        finally:
            self._cache.end(token)

    def _read_misses(self, layer: int, missed: np.ndarray, into: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                      ReadStats, int]:
        """The distinct rows of ``missed`` read into the first rows of ``into`` (C-contiguous, at least
        as many rows as ``missed``): (distinct rows, the position of each of ``missed`` among them,
        what was read, rows taken from another lookup's read)."""
        distinct, inverse = np.unique(missed, return_inverse=True)
        rs, shared = self._read_missing(layer, distinct, into[: len(distinct)])
        return distinct, inverse, rs, shared

    def _admit_read(self, layer: int, rows: np.ndarray, data: np.ndarray) -> None:
        """A lookup's rows read from NVMe offered to the cache after its reply (``admit_later``); nothing
        once the store is closing."""
        try:
            self._enter()
        except StorageError:
            return
        try:
            self._counters.admitted(self._cache.admit(layer, rows, data))
        finally:
            self._exit()

    def _read_missing(self, layer: int, distinct: np.ndarray, data: np.ndarray) -> tuple[ReadStats, int]:
        """The bytes of sorted distinct ``distinct`` from NVMe into ``data`` (C-contiguous uint8
        ``[len(distinct), row_bytes]``): rows another lookup is reading now are taken from its read
        (:mod:`.inflight`), the others read here. Returns (what was read here, with every bad page
        met; rows taken from another read)."""
        read, mine, waits = self._inflight.claim(layer, distinct)
        rs = ReadStats()
        if read is not None:
            part = data if not waits else np.empty((len(mine), self.row_bytes), dtype=np.uint8)
            try:
                rs = self._nvme.read_rows(layer, read.rows, part)
            except BaseException:
                self._inflight.done(read, None)
                raise
            self._inflight.done(read, part, rs.bad_pages)
            if waits:
                data[mine] = part
        shared = 0
        for wait in waits:
            if wait.take(data):
                shared += len(wait.at)
                rpp = self._files[layer].layout.rows_per_page
                met = np.intersect1d(wait.read.bad_pages, distinct[wait.at] // rpp)
                rs.bad_pages = np.union1d(rs.bad_pages, met).astype(np.int64)
                continue
            part = np.empty((len(wait.at), self.row_bytes), dtype=np.uint8)  # that read failed: read them here
            got = self._nvme.read_rows(layer, distinct[wait.at], part)
            data[wait.at] = part
            rs.pages, rs.reads, rs.bytes = rs.pages + got.pages, rs.reads + got.reads, rs.bytes + got.bytes
            rs.seconds += got.seconds
            rs.bad_pages = np.union1d(rs.bad_pages, got.bad_pages).astype(np.int64)
        return rs, shared

    def _refuse_known_bad(self, layer: int, flat: np.ndarray) -> None:
        """CorruptRows when any of ``flat`` sits in a page already known corrupt (rows read in place)."""
        if self._health.has_bad(layer):
            bad = self._health.bad_rows(layer, flat)
            if bad.any():
                self._counters.error()
                raise self._health.refuse(layer, np.unique(flat[bad]), int(np.count_nonzero(bad)))

    def _read_verified(self, layer: int, rows: np.ndarray, who: str) -> tuple[np.ndarray, np.ndarray, int]:
        """Read distinct sorted ``rows`` from NVMe for the cache (warm-up, background admission):
        pages failing their crc32c are marked (found by ``who``) and their rows dropped. Returns
        (rows kept, their bytes, bytes read)."""
        data = np.empty((len(rows), self.row_bytes), dtype=np.uint8)
        rs = self._nvme.read_rows(layer, rows, data)
        self._clear_good(layer, rows, rs.bad_pages, who)
        if len(rs.bad_pages):
            self._health.mark(layer, rs.bad_pages, who)
            good = ~np.isin(rows // self._files[layer].layout.rows_per_page, rs.bad_pages)
            rows, data = rows[good], data[good]
        return rows, data, rs.bytes

    def _clear_good(self, layer: int, rows: np.ndarray, bad_pages: np.ndarray, who: str) -> None:
        """Pages of ``rows`` just read that matched their crc32c are not bad (any more)."""
        if self._health.has_bad(layer):
            pages = np.unique(rows // self._files[layer].layout.rows_per_page)
            self._health.clear(layer, np.setdiff1d(pages, bad_pages), who)

    def _refuse_read(self, layer: int, distinct: np.ndarray, inverse: np.ndarray, data: np.ndarray,
                     bad_pages: np.ndarray) -> None:
        """Rows just read include some of corrupt pages: admit the verified ones, raise CorruptRows."""
        self._health.mark(layer, bad_pages, "an NVMe read")
        bad = np.isin(distinct // self._files[layer].layout.rows_per_page, bad_pages)
        good = np.flatnonzero(~bad)
        if len(good):
            self._cache.admit(layer, distinct[good], data[good])
        raise self._health.refuse(layer, distinct[bad], int(np.count_nonzero(bad[inverse])))
