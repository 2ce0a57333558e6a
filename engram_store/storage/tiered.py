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
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ..errors import ConfigError, StorageError
from ..format import requests
from ..format.arena_layout import ArenaInfo
from ..format.checksums import implementation as checksum_implementation
from ..format.manifest import Manifest
from ..native.gather import Gatherer
from ..native.split_out import SplitOut
from ..native.readers import DEFAULT_QUEUE_DEPTH, open_reader
from .cached_path import CachedLookups
from .gds import make_bulk_reader
from .hinted import StoreHints
from .hints import HintSettings
from .inflight import InFlight
from .integrity import PageHealth
from .layer_file import LayerFile, open_layer
from .native_access import NativeAccess
from .nvme import DEFAULT_CHUNK_PAGES, DEFAULT_MAX_COALESCE_PAGES, NvmeTier
from .opening import MAX_QUEUE_DEPTH, check_open_args  # noqa: F401  (MAX_QUEUE_DEPTH: config checks it)
from .overlap import ReadOverlap
from .placement import CACHED, RESIDENT, cache_slots, format_placement, plan_store, slot_bytes
from .plan import Admitter, PlanCounters, PlanLookups
from .profile import DEFAULT_CAPACITY, AccessSampler
from .resident import ResidentArena
from .row_cache import RowCache
from .scrub import Scrubber
from .stats import LookupStats, StoreCounters
from .warmup import ProfileWarmUp

log = logging.getLogger(__name__)

def _disk_paths(files: dict[int, LayerFile]) -> dict[int, str | list[str]]:
    """Each layer's data file, or its stripe files in order (for messages naming a bad page)."""
    return {k: [part.path for part in lf.stripes] if lf.stripes else lf.path for k, lf in files.items()}


class TieredStore(CachedLookups, PlanLookups, StoreHints, NativeAccess, ProfileWarmUp):
    """A table set served from a DRAM tier in front of an NVMe tier. Implements ``RowStore``."""

    accepts_split_out = True  # lookup_into writes a SplitOut (a client's staging) as well as rows

    def __init__(self, directory: Path, manifest: Manifest, files: dict[int, LayerFile], nvme: NvmeTier,
                 arena: ResidentArena | None, cache: RowCache | None, sampler: AccessSampler, gatherer: Gatherer,
                 health: PageHealth | None = None, placement: Mapping[int, str] | None = None,
                 hints: HintSettings | None = None) -> None:
        self.directory = directory
        self.manifest = manifest
        self._files = files
        self._nvme = nvme
        self._arena = arena
        self._cache = cache
        self._placement = dict(placement) if placement is not None else \
            {layer: RESIDENT if arena is not None else CACHED for layer in files}
        self._resident = frozenset(arena.blocks) if arena is not None else frozenset()
        self._sampler = sampler
        self._gather = gatherer
        self._counters = StoreCounters()
        self._health = health or PageHealth({k: lf.layout for k, lf in files.items()}, _disk_paths(files))
        self._scrub: Scrubber | None = None
        self._closed = False
        self._gate = threading.Condition()  # guards _closed and _active: close() waits for lookups in flight
        self._active = 0
        self.bulk_reader = "none"
        self._plan_counters = PlanCounters()
        self._admitter = Admitter(self._admit_planned, self._plan_counters)
        self._file_ids: dict[int, tuple[str, int, int]] = {}  # layer -> (absolute path, st_dev, st_ino)
        self._layer_files: dict[int, dict] = {}  # layer_files(), computed once per layer
        self._inflight = InFlight()  # NVMe reads of lookups in flight, shared by lookups missing the same rows
        self._overlap = ReadOverlap(gatherer.threads)  # lookups' reads on helper threads while they copy their hits
        self._init_hints(hints)  # rows engines will ask for soon, read behind the lookups (storage/hints.py)

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
        are read and kept (:class:`~.hints.HintSettings`; default: its defaults).
        """
        check_open_args(mode=mode, policy=policy, gds=gds, dram_bytes=dram_bytes, queue_depth=queue_depth,
                        max_coalesce_pages=max_coalesce_pages, scrub_bytes_per_second=scrub_bytes_per_second)
        try:
            page_reader = open_reader(queue_depth, reader)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        directory = Path(directory)
        manifest = Manifest.load(directory)
        files = {e.layer: open_layer(directory, e) for e in manifest.layers}
        health = PageHealth({k: lf.layout for k, lf in files.items()}, _disk_paths(files))
        table_pages = sum(e.layout.pages for e in manifest.layers)
        nvme = NvmeTier(files, page_reader, max_coalesce_pages=max_coalesce_pages,
                        chunk_pages=min(DEFAULT_CHUNK_PAGES, max(256, table_pages // 64)))
        healthy = [lf for lf in files.values() if lf.file is not None]
        row_bytes = manifest.spec.row_bytes
        arena = cache = None
        bulk_name = "none"
        try:
            plan = plan_store(manifest, dram_bytes=dram_bytes, mode=mode, policy=policy, placement=placement)
            resident = [lf for lf in healthy if plan[lf.layer] == RESIDENT]
            if resident:
                bulk, bulk_name = make_bulk_reader(page_reader, gds)
                arena = ResidentArena.build(resident, manifest.spec.row_format, bulk, huge=huge_pages, on_bad=health.mark)
            cached = {e.layer: e.rows for e in manifest.layers if plan[e.layer] == CACHED}
            if cached:
                n_slots = cache_slots(plan, {e.layer: e.rows for e in manifest.layers}, dram_bytes,
                                      arena.nbytes if arena is not None else 0, slot_bytes(row_bytes, policy))
                cache = RowCache(cached, row_bytes, n_slots, policy, huge=huge_pages)
        except BaseException:
            if arena is not None:
                arena.close()
            nvme.close()
            raise
        total_rows = sum(e.rows for e in manifest.layers)
        sampler = AccessSampler(min(profile_capacity, max(1024, total_rows // 64)))
        threads = gather_threads if gather_threads is not None else min(8, os.cpu_count() or 1)
        store = cls(directory, manifest, files, nvme, arena, cache, sampler, Gatherer(threads), health, plan, hints)
        store.bulk_reader = bulk_name
        if scrub_bytes_per_second and cache is not None:
            store._scrub = Scrubber([lf for lf in healthy if plan[lf.layer] == CACHED], page_reader, health,
                                    scrub_bytes_per_second).start()
        log.info("opened %s: %s mode (%s), %d layers (%d unavailable), reader %s, queue depth %d, page checks crc32c "
                 "(%s)%s", directory, store.mode, format_placement(plan), len(files), len(files) - len(healthy),
                 page_reader.name,
                 queue_depth, checksum_implementation(),
                 f", {health.pages} corrupt pages refused" if health.pages else "")
        if warmup is not None:
            try:
                store.warm_up(warmup)
            except BaseException:
                store.close()
                raise
        return store

    # --- RowStore ------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._files))

    @property
    def row_bytes(self) -> int:
        return self.manifest.spec.row_bytes

    @property
    def spec(self):
        return self.manifest.spec

    @property
    def mode(self) -> str:
        """``resident`` (every layer), ``cached`` (every layer) or ``mixed``."""
        kinds = set(self._placement.values())
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def placement(self) -> dict[int, str]:
        """``{layer: "resident" | "cached"}`` for every layer of the table set."""
        return dict(self._placement)

    def rows(self, layer: int) -> int:
        return self._layer(layer).layout.rows

    def layer_errors(self) -> dict[int, str]:
        """Layers that cannot be served, with the reason."""
        return {k: lf.error or "" for k, lf in self._files.items() if lf.file is None}

    def lookup(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        ids = row_ids if isinstance(row_ids, np.ndarray) else np.asarray(row_ids)
        out = np.empty(ids.shape + (self.row_bytes,), dtype=np.uint8)
        self.lookup_into(layer, ids, out)
        return out

    def expect(self, rows: int) -> None:
        """Hint that a lookup of ``rows`` rows is about to come (e.g. a request frame has
        arrived): the gather threads are woken while the caller still parses it."""
        self._gather.expect(rows)

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> LookupStats:
        """Fill ``out[i]`` with the bytes of row ``row_ids[i]`` (see ``RowStore``); returns
        the stats of this call. Raises CorruptRows when a row sits in a corrupt page. ``out`` may
        be a :class:`~engram_store.native.split_out.SplitOut` (a client's staging, rows written
        once every one is checked; :attr:`accepts_split_out`)."""
        t0 = time.perf_counter()
        self._enter()
        try:
            return self._lookup_into(layer, row_ids, out, t0)
        finally:
            self._exit()

    def lookup_into_deferred(self, layer: int, row_ids: np.ndarray,
                             out: np.ndarray) -> tuple[LookupStats, Callable[[], None] | None]:
        """:meth:`lookup_into`, but the rows it read from NVMe are offered to the cache by the callable
        returned (None when there are none), which the caller runs once its reply is out: the cache's
        admission (its evictions) then costs the lookup nothing. Any thread may run it, once."""
        t0 = time.perf_counter()
        later: list[Callable[[], None]] = []
        self._enter()
        try:
            st = self._lookup_into(layer, row_ids, out, t0, later)
        finally:
            self._exit()
        return st, (later[0] if later else None)

    def _enter(self) -> None:
        with self._gate:
            if self._closed:
                raise StorageError("the store is closed")
            self._active += 1

    def _exit(self) -> None:
        with self._gate:
            self._active -= 1
            if self._closed and not self._active:
                self._gate.notify_all()

    def _lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray, t0: float,
                     admit_later: list | None = None) -> LookupStats:
        lf = self._layer(layer)
        flat, out2 = self._check_request(lf, row_ids, out)
        if lf.file is None:
            self._counters.error()
            raise StorageError(f"layer {lf.layer} is unavailable: {lf.error}")
        n = len(flat)
        if lf.layer in self._resident and isinstance(out2, SplitOut):  # a client's staging: good rows only
            requests.check_bounds(lf.layer, flat, lf.layout.rows)
            self._refuse_known_bad(lf.layer, flat)
        if lf.layer in self._resident:
            # The fast path: bounds are checked by the gather itself (no extra pass over
            # the ids), and as little Python as possible runs after it, when the copy
            # has pushed the interpreter's working set out of the CPU caches.
            try:
                self._gather.take_split(*self._arena.blocks[lf.layer], flat, out2)
            except IndexError:  # the gather checks every id before it copies any
                requests.check_bounds(lf.layer, flat, lf.layout.rows)
                raise
            self._refuse_known_bad(lf.layer, flat)
            self._sampler.record(lf.layer, flat)
            seconds = time.perf_counter() - t0
            self._counters.add_dram(n, n * self.row_bytes, seconds)
            return LookupStats(rows=n, rows_dram=n, bytes_dram=n * self.row_bytes, seconds=seconds)
        requests.check_bounds(lf.layer, flat, lf.layout.rows)
        st = LookupStats(rows=n)
        try:
            if n:
                self._lookup_cached(lf.layer, flat, out2, st, admit_later)
        except StorageError:
            self._counters.error()
            raise
        st.bytes_dram = st.rows_dram * self.row_bytes
        st.bytes_nvme = st.rows_nvme * self.row_bytes
        self._sampler.record(lf.layer, flat)
        st.seconds = time.perf_counter() - t0
        self._counters.add(st)
        return st

    def bad_pages(self) -> dict[int, list[list[int]]]:
        """Pages known corrupt: ``{layer: [[first_page, end_page), ...]}`` (file offset of a page:
        ``page * 4096``; rows ``page * rows_per_page ..`` of it). Their rows are refused; in
        resident mode the arena holds zeros for them, so a reader of the arena in place must
        skip them itself."""
        return self._health.bad_ranges()

    @property
    def gather_threads(self) -> int:
        """Threads one large gather may use (``gather_threads`` of :meth:`open`)."""
        return self._gather.threads

    def _layer(self, layer) -> LayerFile:
        return self._files[requests.check_layer(layer, self._files)]

    def _check_request(self, lf: LayerFile, row_ids, out) -> tuple[np.ndarray, np.ndarray]:
        """Dtypes and shapes (bounds come later, with the gather); returns the flat int64 ids
        and ``out`` as rows."""
        ids = requests.row_ids(row_ids)
        if isinstance(out, SplitOut):  # rows into a client's staging (the daemon's Flag.SPLIT lookups)
            out.check(ids.size, self.row_bytes)
            return requests.flat_row_ids(ids), out
        out_rows = requests.rows_out(out, ids.shape, self.row_bytes)
        return requests.flat_row_ids(ids), out_rows

    def arena(self) -> ArenaInfo | None:
        """The sealed read-only arena (resident mode), else None. The store owns the fd."""
        return self._arena.info() if self._arena is not None else None

    def _cache_layers(self) -> list[int]:
        return sorted(self._cache.layer_index, key=self._cache.layer_index.get)

    # --- stats, memory, close --------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """Cumulative counters (units in the names); see ``LookupStats`` for per-call ones."""
        d = self._counters.snapshot()
        d["resident"] = int(self.mode == "resident")
        d["resident_layers"] = sum(where == RESIDENT for where in self._placement.values())
        d["cached_layers"] = sum(where == CACHED for where in self._placement.values())
        d["layers_unavailable"] = len(self.layer_errors())
        d["corrupt_pages"] = self._health.pages
        d["corrupt_rows_refused"] = self._health.rows_refused
        d["scrub_bytes"] = self._scrub.bytes_checked if self._scrub is not None else 0
        d["scrub_passes"] = self._scrub.passes if self._scrub is not None else 0
        d["arena_bytes"] = self._arena.nbytes if self._arena is not None else 0
        d["arena_huge_pages"] = {"none": 0, "thp": 1, "hugetlb": 2}[self._arena.huge_pages] if self._arena else 0
        c = self._cache
        d["cache_bytes"] = c.nbytes if c is not None else 0
        d["cache_slots"] = c.n_slots if c is not None else 0
        d["cache_slots_used"] = c.used if c is not None else 0
        d["cache_admitted_rows"] = c.admitted if c is not None else 0
        d["cache_evicted_rows"] = c.evicted if c is not None else 0
        d["cache_not_admitted_rows"] = c.not_admitted if c is not None else 0
        d.update(self._plan_counters.snapshot())
        d.update(self.hint_stats())
        d.update(self.memory())
        d["dram_bytes"] = d["arena_bytes"] + d["cache_bytes"] + d["cache_metadata_bytes"]
        return d

    def memory(self) -> dict[str, int | float]:
        """Bytes the store holds besides the arena (or slot arena), against the table size."""
        c = self._cache
        table = sum(e.file_bytes for e in self.manifest.layers)
        meta = c.metadata_bytes() if c is not None else 0
        maps = c.map_bytes() if c is not None else 0
        staging = self._nvme.buffers.nbytes * self._nvme.buffers.retained()
        crcs = sum(lf.crcs.nbytes for lf in self._files.values() if lf.crcs is not None)
        beyond = maps + staging + self._sampler.nbytes + crcs
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
        self._admitter.stop()  # drops queued admissions, waits for the one being read
        self._hint_reader.stop()  # drops queued hints, waits for the chunk being read
        with self._gate:
            if self._closed:
                return
            self._closed = True
            self._gate.wait_for(lambda: self._active == 0)
        if self._scrub is not None:
            self._scrub.stop()
        self._overlap.close()
        self._nvme.close()
        self._nvme.reader.close()
        self._gather.close()
        if self._arena is not None:
            self._arena.close()
        if self._cache is not None:
            self._cache.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

