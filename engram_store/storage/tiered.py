"""``TieredStore``: serve rows of a table set from DRAM when it can and NVMe when it must.

::

    store = TieredStore.open("tables/", dram_bytes=64 << 30)
    out = np.empty(row_ids.shape + (store.row_bytes,), np.uint8)
    call = store.lookup_into(14, row_ids, out)   # LookupStats of this call
    store.stats()                                 # cumulative counters

Each layer is *resident* or *cached* (:mod:`.placement`; by default from capacity:
every layer resident when ``dram_bytes`` holds the table set densely, else the
earliest layers that fit, then the rest cached). Resident layers sit densely
in one sealed memfd in the engines' layout (see :meth:`arena`); cached layers
share a slot arena (what ``dram_bytes`` leaves, less per-slot bookkeeping), and
their missing rows come from NVMe (O_DIRECT page reads) and are offered to the
cache policy. :attr:`mode` is ``resident``, ``cached`` or ``mixed``.

Layer files are opened one by one: a layer whose file (or page checksum
file) is missing or truncated is reported (``StorageError`` on lookup,
``layer_errors()``) while the other layers keep serving.

Integrity: every page read from NVMe, by the resident fill, a lookup or the
background scrub (cached mode, ``scrub_bytes_per_second``), is checked
against its crc32c. A page that fails is logged once and counted
(``corrupt_pages``); its rows are refused with :class:`~engram_store.errors.CorruptRows`
(the whole request fails, naming the rows and pages) and never enter the
DRAM tier, while every other row keeps being served (:mod:`.integrity`).

Thread-safe: any number of threads may look up at once. :meth:`close` waits
for the lookups in flight; later calls raise ``StorageError("the store is closed")``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Mapping

import numpy as np

from ..errors import StorageError
from ..format.arena_layout import ArenaInfo
from ..format.checksums import implementation as checksum_implementation
from ..format.manifest import Manifest
from ..native.readers import DEFAULT_QUEUE_DEPTH
from ..wire.frames import ReadPlan
from .cached_path import CachedPath
from .checked_reads import CheckedReads
from .hint_queue import HintSettings
from .hint_service import HintService
from .native_access import NativeAccess
from .nvme import DEFAULT_MAX_COALESCE_PAGES
from .opening import MAX_QUEUE_DEPTH, check_open_args, open_parts, start_scrub  # noqa: F401  (MAX_QUEUE_DEPTH: config checks it)
from .parts import StoreParts
from .placement import CACHED, RESIDENT, format_placement
from .plan import Planner
from .profile import DEFAULT_CAPACITY
from .request_checks import check_request, checked_layer
from .resident_tier import ResidentTier
from .scrub import Scrubber
from .stats import LookupStats
from .warmup import ProfileWarmUp

log = logging.getLogger(__name__)


class TieredStore:
    """A table set served from a DRAM tier in front of an NVMe tier. Implements ``RowStore``.

    Built from :class:`~.parts.StoreParts` (see :meth:`open`) and composed of one component per
    concern, each given the parts it uses: the resident tier (:mod:`.resident_tier`), the cached
    path (:mod:`.cached_path`), plan lookups (:mod:`.plan`), hints (:mod:`.hint_service`), native
    access (:mod:`.native_access`) and warm-up (:mod:`.warmup`). Its methods pass the close gate and
    delegate. :attr:`parts` and :attr:`cached_path` are there for tests and profiles that look
    inside; nothing else should use them, and no caller may close or replace a part.
    """

    accepts_split_out = True  # lookup_into writes a SplitOut (a client's staging) as well as rows

    def __init__(self, parts: StoreParts, *, hints: HintSettings | None = None, scrub: Scrubber | None = None,
                 bulk_reader: str = "none") -> None:
        self.parts = parts
        self.directory = parts.directory
        self.manifest: Manifest = parts.manifest
        self.bulk_reader = bulk_reader  # what filled the arena: "kvikio", "posix" or "none"
        self._files, self._resident, self._counters, self._gate = parts.files, parts.resident, parts.counters, parts.gate
        self._row_bytes = parts.row_bytes
        self._scrub = scrub
        checks = CheckedReads(parts.nvme, parts.health, parts.files, parts.counters, self._row_bytes)
        self._resident_tier = ResidentTier(parts.arena, parts.gather, parts.sampler, parts.counters, checks,
                                           self._row_bytes)
        self._cached = CachedPath(parts.cache, parts.gather, parts.overlap, parts.inflight, parts.nvme, parts.health,
                                  parts.files, parts.sampler, parts.counters, parts.gate, checks, self._row_bytes)
        self._planner = Planner(parts.files, parts.resident, parts.cache, parts.health, parts.sampler, parts.gate,
                                checks, self._lookup_into, self._row_bytes)
        self._hints = HintService(hints, parts.files, parts.resident, parts.cache, parts.nvme, parts.inflight,
                                  parts.health, parts.gate, checks, self._row_bytes)
        self._native = NativeAccess(parts.directory, parts.manifest, parts.files, parts.resident, parts.arena,
                                    parts.cache, parts.health, parts.sampler, parts.counters, parts.gate)
        self._warmup = ProfileWarmUp(parts.files, parts.resident, parts.cache, parts.sampler, checks)

    # --- opening -------------------------------------------------------
    @classmethod
    def open(cls, directory: str | os.PathLike, *, dram_bytes: int, mode: str = "auto",
             queue_depth: int = DEFAULT_QUEUE_DEPTH, policy: str = "s3fifo", huge_pages: bool = True,
             gds: str = "auto", reader: str = "auto", max_coalesce_pages: int = DEFAULT_MAX_COALESCE_PAGES,
             warmup: str | os.PathLike | np.ndarray | None = None, profile_capacity: int = DEFAULT_CAPACITY,
             gather_threads: int | None = None, scrub_bytes_per_second: int = 0,
             placement: Mapping[int, str] | None = None, hints: HintSettings | None = None) -> "TieredStore":
        """Open the table set in ``directory``.

        ``dram_bytes``: DRAM budget of the DRAM tier. ``mode``: ``auto`` (layers resident,
        earliest first, as far as ``dram_bytes`` holds them densely; the rest cached),
        ``resident`` or ``cached`` (every layer so). ``placement``: ``{layer: "resident" |
        "cached"}`` for the layers to place by hand (with ``mode="auto"``).
        ``queue_depth``: NVMe reads in flight. ``policy``: cache policy (``s3fifo``, ``lru``).
        ``huge_pages``: use huge pages where the host allows. ``gds``: ``auto``/``on``/``off``,
        kvikio for the resident fill. ``reader``: ``auto``/``native``/``uring``/``aio``/``threads``.
        ``warmup``: an access profile (a file, or its pairs) to load into the cache at start.
        ``gather_threads``: threads copying rows of one large request (default: CPU count, at most 8).
        ``scrub_bytes_per_second``: cached mode, read and check every page in the background at
        this rate (0: no scrub; pages are checked when read either way). ``hints``: how hinted rows
        are read and kept (:class:`~.hint_queue.HintSettings`; default: its defaults).
        """
        check_open_args(mode=mode, policy=policy, gds=gds, dram_bytes=dram_bytes, queue_depth=queue_depth,
                        max_coalesce_pages=max_coalesce_pages, scrub_bytes_per_second=scrub_bytes_per_second)
        parts, bulk_name = open_parts(directory, dram_bytes=dram_bytes, mode=mode, queue_depth=queue_depth,
                                      policy=policy, huge_pages=huge_pages, gds=gds, reader=reader,
                                      max_coalesce_pages=max_coalesce_pages, profile_capacity=profile_capacity,
                                      gather_threads=gather_threads, placement=placement)
        store = cls(parts, hints=hints, scrub=start_scrub(parts, scrub_bytes_per_second), bulk_reader=bulk_name)
        files, health = parts.files, parts.health
        unavailable = sum(lf.file is None for lf in files.values())
        log.info("opened %s: %s mode (%s), %d layers (%d unavailable), reader %s, queue depth %d, page checks crc32c "
                 "(%s)%s", parts.directory, store.mode, format_placement(parts.placement), len(files), unavailable,
                 parts.nvme.reader.name, queue_depth, checksum_implementation(),
                 f", {health.pages} corrupt pages refused" if health.pages else "")
        if warmup is not None:
            try:
                store.warm_up(warmup)
            except BaseException:
                store.close()
                raise
        return store

    @property
    def cached_path(self) -> CachedPath:
        """The cached layers' lookups (for a profile that times their steps: ``bench/_store_profile.py``)."""
        return self._cached

    # --- RowStore ------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._files))

    @property
    def row_bytes(self) -> int:
        return self._row_bytes

    @property
    def spec(self):
        return self.manifest.spec

    @property
    def mode(self) -> str:
        """``resident`` (every layer), ``cached`` (every layer) or ``mixed``."""
        kinds = set(self.parts.placement.values())
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def placement(self) -> dict[int, str]:
        """``{layer: "resident" | "cached"}`` for every layer of the table set."""
        return dict(self.parts.placement)

    def rows(self, layer: int) -> int:
        return checked_layer(self._files, layer).layout.rows

    def layer_errors(self) -> dict[int, str]:
        """Layers that cannot be served, with the reason."""
        return {k: lf.error or "" for k, lf in self._files.items() if lf.file is None}

    def lookup(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        ids = row_ids if isinstance(row_ids, np.ndarray) else np.asarray(row_ids)
        out = np.empty(ids.shape + (self._row_bytes,), dtype=np.uint8)
        self.lookup_into(layer, ids, out)
        return out

    def expect(self, rows: int) -> None:
        """Hint that a lookup of ``rows`` rows is about to come (e.g. a request frame has
        arrived): the gather threads are woken while the caller still parses it."""
        self.parts.gather.expect(rows)

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> LookupStats:
        """Fill ``out[i]`` with the bytes of row ``row_ids[i]`` (see ``RowStore``); returns
        the stats of this call. Raises CorruptRows when a row sits in a corrupt page. ``out`` may
        be a :class:`~engram_store.native.gather.split_out.SplitOut` (a client's staging, rows written
        once every one is checked; :attr:`accepts_split_out`)."""
        t0 = time.perf_counter()
        self._gate.enter()
        try:
            return self._lookup_into(layer, row_ids, out, t0)
        finally:
            self._gate.exit()

    def lookup_into_deferred(self, layer: int, row_ids: np.ndarray,
                             out: np.ndarray) -> tuple[LookupStats, Callable[[], None] | None]:
        """:meth:`lookup_into`, but the rows it read from NVMe are offered to the cache by the callable
        returned (None when there are none), which the caller runs once its reply is out: the cache's
        admission (its evictions) then costs the lookup nothing. Any thread may run it, once."""
        t0 = time.perf_counter()
        later: list[Callable[[], None]] = []
        self._gate.enter()
        try:
            st = self._lookup_into(layer, row_ids, out, t0, later)
        finally:
            self._gate.exit()
        return st, (later[0] if later else None)

    def _lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray, t0: float,
                     admit_later: list | None = None) -> LookupStats:
        """:meth:`lookup_into` inside the close gate (:class:`~.parts.ServeRows`): checks, then the layer's tier."""
        lf = checked_layer(self._files, layer)
        flat, out2 = check_request(lf, row_ids, out, self._row_bytes)
        if lf.file is None:
            self._counters.error()
            raise StorageError(f"layer {lf.layer} is unavailable: {lf.error}")
        if lf.layer in self._resident:
            return self._resident_tier.lookup(lf, flat, out2, t0)
        return self._cached.lookup(lf, flat, out2, t0, admit_later)

    def bad_pages(self) -> dict[int, list[list[int]]]:
        """Pages known corrupt: ``{layer: [[first_page, end_page), ...]}`` (file offset of a page:
        ``page * 4096``; rows ``page * rows_per_page ..`` of it). Their rows are refused; in
        resident mode the arena holds zeros for them, so a reader of the arena in place must
        skip them itself."""
        return self.parts.health.bad_ranges()

    @property
    def gather_threads(self) -> int:
        """Threads one large gather may use (``gather_threads`` of :meth:`open`)."""
        return self.parts.gather.threads

    def arena(self) -> ArenaInfo | None:
        """The sealed read-only arena (resident mode), else None. The store owns the fd."""
        return self.parts.arena.info() if self.parts.arena is not None else None

    # --- plan lookups (PlanningStore) ------------------------------------
    def plan_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray, *,
                  max_plan_bytes: int) -> ReadPlan | None:
        """Copy the rows this store holds in DRAM into ``out`` and return the read plan of the
        others, unread (``out`` at their positions is left as it was); None when every row is
        in ``out``: a resident layer, all rows cached, a layer without page checksums, a
        striped layer (a plan names one file; the store reads the stripes itself), or a
        plan that would exceed ``max_plan_bytes`` (then the misses are read here as by
        :meth:`lookup_into`). Rows of pages known corrupt are refused with CorruptRows, as by
        :meth:`lookup_into`. The planned rows are queued for background admission into the
        cache (bounded; dropped when the queue is full). Same argument checks as
        :meth:`lookup_into`."""
        t0 = time.perf_counter()
        self._gate.enter()
        try:
            return self._planner.plan_into(layer, row_ids, out, max_plan_bytes, t0)
        finally:
            self._gate.exit()

    def plan_admission_idle(self) -> bool:
        """No planned rows wait for background admission (for tests and drains)."""
        return self._planner.idle()

    # --- hints (HintingStore) --------------------------------------------
    @property
    def hint_settings(self) -> HintSettings:
        """How hinted rows are read and kept (``hints`` of :meth:`open`)."""
        return self._hints.settings

    def hint(self, layer: int, row_ids: np.ndarray, key: int, holder: str, *, rate_limited: int = 0,
             owner: str | None = None) -> int:
        """Queue rows an engine will look up soon; see :meth:`.hint_service.HintService.hint`."""
        return self._hints.hint(layer, row_ids, key, holder, rate_limited=rate_limited, owner=owner)

    def withdraw(self, key: int, holder: str) -> int:
        """``holder`` no longer needs its client's hint ``key``; see :meth:`.hint_service.HintService.withdraw`."""
        return self._hints.withdraw(key, holder)

    def withdraw_holder(self, holder: str) -> int:
        """``holder`` is gone: every hint it holds is withdrawn."""
        return self._hints.withdraw_holder(holder)

    def hints_idle(self) -> bool:
        """No hint queued and none being read (rows read are in the cache's hinted share)."""
        return self._hints.idle()

    def hint_stats(self) -> dict[str, int | float]:
        """The ``hint_*`` counters of :meth:`stats`."""
        return self._hints.stats()

    # --- native access (ResidentStore) and access profiles (ProfiledStore) ---------------
    def layer_files(self) -> dict[int, dict]:
        """See :meth:`.native_access.NativeAccess.layer_files`."""
        return self._native.layer_files()

    def resident_views(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """See :meth:`.native_access.NativeAccess.resident_views`."""
        return self._native.resident_views()

    def cached_views(self) -> dict | None:
        """See :meth:`.native_access.NativeAccess.cached_views`."""
        return self._native.cached_views()

    def record_native_lookup(self, layer: int, ids: np.ndarray, seconds: float) -> None:
        """See :meth:`.native_access.NativeAccess.record_native_lookup`."""
        self._native.record_native_lookup(layer, ids, seconds)

    def warm_up(self, profile: str | os.PathLike | np.ndarray) -> int:
        """Load the rows of an access profile (a path or int64 ``[n, 2]`` pairs, hottest
        first) into the cache, up to its capacity. Returns rows loaded (0 when resident)."""
        self._gate.enter()
        try:
            return self._warmup.warm_up(profile)
        finally:
            self._gate.exit()

    def hot_rows(self) -> np.ndarray:
        """int64 ``[n, 2]`` (layer, row), hottest first: the cache's rows (cached mode)
        then rows sampled from live traffic."""
        return self._warmup.hot_rows()

    def write_profile(self, path: str | os.PathLike) -> int:
        """Write :meth:`hot_rows` as an access profile; returns the number of rows."""
        return self._warmup.write_profile(path)

    # --- stats, memory, close --------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """Cumulative counters (units in the names); see ``LookupStats`` for per-call ones."""
        p = self.parts
        d = self._counters.snapshot()
        d["resident"] = int(self.mode == "resident")
        d["resident_layers"] = sum(where == RESIDENT for where in p.placement.values())
        d["cached_layers"] = sum(where == CACHED for where in p.placement.values())
        d["layers_unavailable"] = len(self.layer_errors())
        d["corrupt_pages"] = p.health.pages
        d["corrupt_rows_refused"] = p.health.rows_refused
        d["scrub_bytes"] = self._scrub.bytes_checked if self._scrub is not None else 0
        d["scrub_passes"] = self._scrub.passes if self._scrub is not None else 0
        d["arena_bytes"] = p.arena.nbytes if p.arena is not None else 0
        d["arena_huge_pages"] = {"none": 0, "thp": 1, "hugetlb": 2}[p.arena.huge_pages] if p.arena else 0
        c = p.cache
        d["cache_bytes"] = c.nbytes if c is not None else 0
        d["cache_slots"] = c.n_slots if c is not None else 0
        d["cache_slots_used"] = c.used if c is not None else 0
        d["cache_admitted_rows"] = c.admitted if c is not None else 0
        d["cache_evicted_rows"] = c.evicted if c is not None else 0
        d["cache_not_admitted_rows"] = c.not_admitted if c is not None else 0
        d.update(self._planner.counters.snapshot())
        d.update(self.hint_stats())
        d.update(self.memory())
        d["dram_bytes"] = d["arena_bytes"] + d["cache_bytes"] + d["cache_metadata_bytes"]
        return d

    def memory(self) -> dict[str, int | float]:
        """Bytes the store holds besides the arena (or slot arena), against the table size."""
        p = self.parts
        c = p.cache
        table = sum(e.file_bytes for e in self.manifest.layers)
        meta = c.metadata_bytes() if c is not None else 0
        maps = c.map_bytes() if c is not None else 0
        staging = p.nvme.buffers.nbytes * p.nvme.buffers.retained()
        crcs = sum(lf.crcs.nbytes for lf in self._files.values() if lf.crcs is not None)
        beyond = maps + staging + p.sampler.nbytes + crcs
        return {
            "table_bytes": table,
            "cache_metadata_bytes": meta,  # inside the dram_bytes budget
            "row_map_bytes": maps,  # allocated zeroed: untouched pages cost nothing
            "staging_bytes": staging,
            "page_crc_bytes": crcs,  # expected crc32c of every page: 4 bytes per 4 KiB
            "beyond_dram_bytes": beyond,
            "beyond_dram_fraction": beyond / table if table else 0.0,
        }

    def close(self) -> None:
        """Wait for the lookups in flight, then release files and memory; later lookups raise
        StorageError("the store is closed")."""
        self._planner.stop()  # drops queued admissions, waits for the one being read
        self._hints.stop()  # drops queued hints, waits for the chunk being read
        if not self._gate.close():
            return
        if self._scrub is not None:
            self._scrub.stop()
        self.parts.release()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
