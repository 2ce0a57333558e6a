"""The DRAM tier: one memfd holding either the whole table set or a row cache.

*Resident* mode (:class:`ResidentArena`): every layer is loaded once at start,
in the engines' layout (:mod:`.arena_layout`: a block of all payloads, then a
block of all scales, each 2 MiB aligned), by large sequential reads whose 4 KiB
pages are checked against their crc32c (one native call per 64 MiB chunk) and
split into the two blocks as they arrive. The rows of a page that fails (or of
a chunk whose read fails) are left zero in the arena and reported, so the
store refuses them; a bad page never stops the fill. The memfd is then sealed
(no write, shrink or grow) so that any process receiving it can map it
read-only, gather rows by itself, or hand the blocks to an engine's kernel.

*Cached* mode (:class:`RowCache`): a slot arena of ``n_slots`` rows, one int32
row-to-slot array per layer (``slot + 1``, 0 when absent; allocated zeroed, so
pages of rows never cached cost no memory), and an eviction policy.

Slots are never reused under a reader, by epochs: a lookup registers the
current epoch while it copies out of slots; evicted slots are retired with the
epoch of their eviction and go back to the free stack only once every lookup
that started at or before that epoch has finished.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..errors import StorageError
from ..layout import PAGE_BYTES
from ..spec import RowFormat
from .arena_layout import ArenaLayout
from .base import ArenaInfo
from .checksums import bad_pages as check_pages
from .nvme import LayerFile
from .policy import make_policy
from .syscalls import HUGE_PAGE, aligned_buffer, as_array, create_memfd, map_fd, round_up, seal_read_only, shmem_thp

log = logging.getLogger(__name__)

LAYER_SHIFT = 40  # cache key = layer_index << LAYER_SHIFT | row
ROW_MASK = (1 << LAYER_SHIFT) - 1
FILL_CHUNK_BYTES = 64 << 20
BulkRead = Callable[[LayerFile, int, int, object], None]  # (layer file, file offset, nbytes, dest buffer)
OnBadPages = Callable[[int, np.ndarray, str], None]  # (layer, page numbers, who found them)


PARALLEL_MIN_ROWS = 16384  # fallback only: numpy gathers this large are split across Python threads


def native_gather():
    """The ``_gather`` extension module (row gathers on a native thread pool), or None."""
    try:
        from . import _gather
    except ImportError as exc:
        log.warning("native gather _gather not built (%s); using np.take on a Python thread pool", exc)
        return None
    return _gather


class Gatherer:
    """Copies rows ``src[index]`` into ``out`` (both uint8 ``[*, row_bytes]``, C-contiguous)
    on up to ``threads`` threads. With the native gather (``_gather.c``: software
    prefetch, GIL released, a pool of native threads claiming blocks of rows) when
    built, else ``np.take`` with large requests split across a Python thread pool.
    Thread-safe. Index bounds are checked (IndexError)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._native = native_gather()
        use_pool = self._native is None and self.threads > 1
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="engram-gather") if use_pool else None

    def expect(self, rows: int) -> None:
        """A gather of ``rows`` rows is about to come: wake the native pool's idle threads
        now (tens of microseconds on a VM), so that they are running when it starts."""
        if self._native is not None and self.threads > 1 and rows >= self._native.MIN_SPLIT_ROWS:
            self._native.prime()

    def take(self, src: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
        index = np.ascontiguousarray(index, dtype=np.int64)
        if self._native is not None:
            self._native.gather(src, src.shape[1], index, out, self.threads)
            return
        n = len(index)
        if n and (index.min() < 0 or index.max() >= len(src)):
            raise IndexError(f"gather: an index is outside [0, {len(src)})")
        parts = min(self.threads, n // PARALLEL_MIN_ROWS) if self._pool is not None else 1
        if parts <= 1:
            _numpy_take(src, index, out)
            return
        step = -(-n // parts)
        futures = [self._pool.submit(_numpy_take, src, index[lo : lo + step], out[lo : lo + step]) for lo in range(step, n, step)]
        _numpy_take(src, index[:step], out[:step])
        for f in futures:
            f.result()

    def take_split(self, weights: np.ndarray, scales: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = weights[index[i]] ++ scales[index[i]]``: rows of a table kept in the
        engines' two blocks (uint8 ``[rows, wb]`` and ``[rows, sb]``), ``out`` uint8
        ``[n, wb + sb]``. Bounds checked before anything is copied (IndexError)."""
        index = np.ascontiguousarray(index, dtype=np.int64)
        if self._native is not None:
            self._native.gather_split(weights, weights.shape[1], scales, scales.shape[1], index, out, self.threads)
            return
        if len(index) and (index.min() < 0 or index.max() >= len(weights)):
            raise IndexError(f"gather: an index is outside [0, {len(weights)})")
        wb = weights.shape[1]
        out[:, :wb] = weights[index]
        out[:, wb:] = scales[index]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@functools.cache
def shared_gatherer(threads: int = 1) -> Gatherer:
    """A process-wide :class:`Gatherer` per thread count, for in-process readers of an
    arena: clients gathering from a mapped resident arena and ``LocalClient``. One
    thread by default, on purpose: those callers run beside the model's compute and
    must not compete with it for every core unless asked to."""
    return Gatherer(threads)


def _numpy_take(src: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    np.take(src, index, axis=0, out=out, mode="clip")


def resident_layout(layer_rows: list[tuple[int, int]], row_format: RowFormat) -> ArenaLayout:
    """Where each ``(layer, rows)`` goes in the resident arena (the engines' layout)."""
    return ArenaLayout.plan(layer_rows, row_format.dim, row_format.scale_count)


class ResidentArena:
    """The whole table set in a sealed memfd, in the engines' layout. Read-only after :meth:`build`."""

    def __init__(self, memfd, mm, layout: ArenaLayout, huge_pages: str) -> None:
        self.memfd = memfd
        self._mm = mm
        self.layout = layout
        self.huge_pages = huge_pages
        data = as_array(mm)
        self.blocks = {a.layer: (data[a.weight_offset: a.weight_offset + a.rows * a.weight_bytes].reshape(a.rows, a.weight_bytes),
                                 data[a.scale_offset: a.scale_offset + a.rows * a.scale_bytes].reshape(a.rows, a.scale_bytes))
                       for a in layout.layers}

    @classmethod
    def build(cls, files: list[LayerFile], row_format: RowFormat, bulk_read: BulkRead, *, huge: bool = True,
              chunk_bytes: int = FILL_CHUNK_BYTES, on_bad: OnBadPages | None = None) -> "ResidentArena":
        """Allocate, fill from ``files`` (healthy layers only), seal, map read-only. Pages
        that fail their crc32c are reported to ``on_bad`` (their rows stay zero)."""
        layout = resident_layout([(lf.layer, lf.layout.rows) for lf in files], row_format)
        size = layout.size
        memfd = create_memfd("engram-arena", size, huge=huge)
        t0 = time.perf_counter()
        mm = map_fd(memfd.fd, size, writable=True, huge=huge)
        try:
            data = as_array(mm)
            for lf, a in zip(files, layout.layers):
                weights = data[a.weight_offset: a.weight_offset + a.rows * a.weight_bytes].reshape(a.rows, a.weight_bytes)
                scales = data[a.scale_offset: a.scale_offset + a.rows * a.scale_bytes].reshape(a.rows, a.scale_bytes)
                bad = fill_split(weights, scales, lf, bulk_read, chunk_bytes)
                if len(bad) and on_bad is not None:
                    on_bad(lf.layer, bad, "the resident fill")
            del data, weights, scales
        except BaseException:
            mm.close()
            memfd.close()
            raise
        mm.close()  # sealing against writes needs every writable mapping gone
        seal_read_only(memfd.fd)
        seconds = time.perf_counter() - t0
        huge_pages = "hugetlb" if memfd.hugetlb else ("thp" if huge and shmem_thp() else "none")
        log.info("resident arena: %d layers in the engines' layout, %.1f MiB filled in %.2fs (%.0f MB/s), "
                 "huge pages: %s%s", len(files), size / 2**20, seconds, size / max(seconds, 1e-9) / 1e6, huge_pages,
                 "" if huge_pages != "none" else " (reserve huge pages or set shmem THP to advise: GPU lookups "
                 "over 4 KiB pages are much slower; see README)")
        return cls(memfd, map_fd(memfd.fd, size, writable=False, huge=huge, populate=True), layout, huge_pages)

    def info(self) -> ArenaInfo:
        return ArenaInfo(self.memfd.fd, self.layout, self.huge_pages)

    @property
    def nbytes(self) -> int:
        return self.memfd.size

    def close(self) -> None:
        self.blocks = {}
        try:
            self._mm.close()
        except BufferError:
            log.debug("resident arena still referenced by a caller's array; unmapped when that is freed")
        self.memfd.close()


def fill_split(weights: np.ndarray, scales: np.ndarray, lf: LayerFile, bulk_read: BulkRead,
               chunk_bytes: int) -> np.ndarray:
    """Read ``lf`` front to back in chunks (the next chunk is read and checked while the
    current one is split) and write each row's payload into ``weights`` (uint8 ``[rows, wb]``)
    and its scales into ``scales`` (uint8 ``[rows, sb]``). Each chunk's pages are checked
    against ``lf.crcs`` (when set); returns the int64 page numbers that failed, or whose
    chunk could not be read (logged), whose rows are left zero."""
    layout = lf.layout
    rpp, rb, wb = layout.rows_per_page, layout.row_bytes, weights.shape[1]
    chunk_pages = max(1, chunk_bytes // PAGE_BYTES)
    spans = [(p, min(p + chunk_pages, layout.pages)) for p in range(0, layout.pages, chunk_pages)]
    if not spans:
        return np.empty(0, dtype=np.int64)
    buffers = [aligned_buffer(min(chunk_pages, layout.pages) * PAGE_BYTES) for _ in range(min(2, len(spans)))]

    def read(i: int) -> tuple[object, np.ndarray]:
        p0, p1 = spans[i]
        buf = buffers[i % len(buffers)]
        try:
            bulk_read(lf, p0 * PAGE_BYTES, (p1 - p0) * PAGE_BYTES, buf)
        except StorageError as exc:
            log.error("layer %d: pages %d..%d (file offsets %d..%d) unreadable, their rows are refused: %s",
                      lf.layer, p0, p1 - 1, p0 * PAGE_BYTES, p1 * PAGE_BYTES, exc)
            return buf, np.arange(p0, p1, dtype=np.int64)
        if lf.crcs is None:
            return buf, np.empty(0, dtype=np.int64)
        return buf, p0 + check_pages(buf, lf.crcs[p0:p1])

    bad_parts = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-fill") as ex:
        pending = ex.submit(read, 0)
        for i, (p0, p1) in enumerate(spans):
            buf, bad = pending.result()
            if i + 1 < len(spans):
                pending = ex.submit(read, i + 1)
            r0, r1 = p0 * rpp, min(p1 * rpp, layout.rows)
            pages = as_array(buf, (p1 - p0) * PAGE_BYTES).reshape(p1 - p0, PAGE_BYTES)
            rows = pages[:, : rpp * rb].reshape((p1 - p0) * rpp, rb)[: r1 - r0]
            weights[r0:r1] = rows[:, :wb]
            scales[r0:r1] = rows[:, wb:]
            if len(bad):  # never leave a corrupt page's bytes where an in-place reader could take them
                bad_parts.append(bad)
                bad_rows = (bad[:, None] * rpp + np.arange(rpp)).reshape(-1)
                bad_rows = bad_rows[bad_rows < layout.rows]
                weights[bad_rows] = 0
                scales[bad_rows] = 0
            del pages, rows
    for buf in buffers:
        buf.close()
    return np.concatenate(bad_parts) if bad_parts else np.empty(0, dtype=np.int64)


class RowCache:
    """Hot rows of a table set in a slot arena. Thread-safe (one lock, vectorized work)."""

    def __init__(self, layer_rows: dict[int, int], row_bytes: int, n_slots: int, policy: str = "s3fifo",
                 *, huge: bool = True) -> None:
        if n_slots < 1:
            raise ValueError(f"a row cache needs at least one slot, got {n_slots}")
        self.row_bytes = row_bytes
        self.n_slots = n_slots
        self.layer_index = {layer: i for i, layer in enumerate(sorted(layer_rows))}
        self.maps = [np.zeros(layer_rows[layer], dtype=np.int32) for layer in sorted(layer_rows)]
        size = round_up(n_slots * row_bytes, HUGE_PAGE)
        self.memfd = create_memfd("engram-cache", size, huge=huge)
        self._mm = map_fd(self.memfd.fd, size, writable=True, huge=huge)
        self.slots = as_array(self._mm, n_slots * row_bytes).reshape(n_slots, row_bytes)
        self.slot_key = np.full(n_slots, -1, dtype=np.int64)
        self.free = np.arange(n_slots - 1, -1, -1, dtype=np.int32)  # a stack: free[:free_top]
        self.free_top = n_slots
        self.limbo: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self.limbo_slots = 0
        self.epoch = 0
        self.active: dict[int, int] = {}
        self.policy = make_policy(policy, n_slots)
        self.admit_limit = max(1, n_slots // 4)
        self.lock = threading.Lock()
        self.admitted = 0
        self.evicted = 0
        self.not_admitted = 0

    # --- readers -------------------------------------------------------
    def begin(self, layer: int, rows: np.ndarray) -> tuple[int, np.ndarray]:
        """Register a reader; returns its epoch token and ``slot + 1`` per row (0 = miss).
        The slots stay valid until :meth:`end` is called with the token."""
        li = self.layer_index[layer]
        with self.lock:
            token = self.epoch
            self.active[token] = self.active.get(token, 0) + 1
            found = self.maps[li][rows]
            hit = found[found > 0] - 1
            if len(hit):
                self.policy.on_hit(hit)
        return token, found

    def end(self, token: int) -> None:
        with self.lock:
            left = self.active[token] - 1
            if left:
                self.active[token] = left
            else:
                del self.active[token]

    # --- admission -----------------------------------------------------
    def admit(self, layer: int, rows: np.ndarray, data: np.ndarray, *, main: bool = False) -> int:
        """Offer rows just read (``rows`` distinct int64, ``data`` their bytes); returns
        how many were admitted. Rows already cached (a concurrent admission) are skipped."""
        li = self.layer_index[layer]
        with self.lock:
            new = np.flatnonzero(self.maps[li][rows] == 0)
            if len(new) > self.admit_limit:
                self.not_admitted += len(new) - self.admit_limit
                new = new[np.linspace(0, len(new) - 1, self.admit_limit).astype(np.intp)]
            if not len(new):
                return 0
            slots = self._take_free(len(new))
            if len(slots) < len(new):
                self._retire(self.policy.evict(len(new) - len(slots), self.slot_key))
                slots = np.concatenate([slots, self._take_free(len(new) - len(slots))])
            self.not_admitted += len(new) - len(slots)
            new = new[: len(slots)]
            keys = np.int64(li << LAYER_SHIFT) | rows[new]
            self.slots[slots] = data[new]
            self.slot_key[slots] = keys
            self.maps[li][rows[new]] = slots + 1
            self.policy.insert(slots, keys, main=main)
            self.admitted += len(slots)
            return len(slots)

    def _take_free(self, n: int) -> np.ndarray:
        self._reclaim()
        n = min(n, self.free_top)
        taken = self.free[self.free_top - n : self.free_top].copy()
        self.free_top -= n
        return taken

    def _retire(self, victims: np.ndarray) -> None:
        if not len(victims):
            return
        keys = self.slot_key[victims]
        layer_of = keys >> LAYER_SHIFT
        for li in np.unique(layer_of):
            self.maps[li][keys[layer_of == li] & ROW_MASK] = 0
        self.slot_key[victims] = -1
        self.limbo.append((self.epoch, victims))
        self.limbo_slots += len(victims)
        self.epoch += 1
        self.evicted += len(victims)

    def _reclaim(self) -> None:
        oldest = min(self.active) if self.active else None
        while self.limbo and (oldest is None or self.limbo[0][0] < oldest):
            _, slots = self.limbo.popleft()
            self.free[self.free_top : self.free_top + len(slots)] = slots
            self.free_top += len(slots)
            self.limbo_slots -= len(slots)

    # --- introspection -------------------------------------------------
    def cached_keys(self) -> np.ndarray:
        """int64 keys of every cached row (for access profiles)."""
        with self.lock:
            return self.slot_key[self.slot_key >= 0].copy()

    @property
    def used(self) -> int:
        return self.n_slots - self.free_top - self.limbo_slots

    def metadata_bytes(self) -> int:
        """Bytes of bookkeeping per slot (slot keys, free stack, policy)."""
        return self.slot_key.nbytes + self.free.nbytes + self.policy.metadata_bytes()

    def map_bytes(self) -> int:
        return sum(m.nbytes for m in self.maps)

    @property
    def nbytes(self) -> int:
        return self.memfd.size

    def close(self) -> None:
        self.slots = np.zeros((0, self.row_bytes), dtype=np.uint8)
        try:
            self._mm.close()
        except BufferError:
            log.debug("row cache still referenced by a caller's array; unmapped when that is freed")
        self.memfd.close()
