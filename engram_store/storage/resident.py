"""The resident DRAM tier: the whole table set in one sealed memfd, in the engines' layout.

Every layer is loaded once at start, in the engines' layout
(:mod:`engram_store.format.arena_layout`: a block of all payloads, then a block
of all scales, each 2 MiB aligned), on the best pages the kernel grants
(:func:`arena_backings`: reserved huge pages of the largest size that holds it, with
that size's ``MFD_HUGE_*`` flag, else transparent huge pages, else ordinary pages),
by large sequential reads whose 4 KiB pages
are checked against their crc32c (one native call per 64 MiB chunk) and split
into the two blocks as they arrive. A chunk whose read fails is read again by
halves until the pages that cannot be read are found. The rows of a page that
fails its crc32c or cannot be read are left zero in the arena and reported, so
the store refuses them (until restart: the arena is sealed); a bad page never
stops the fill, and any other error raised in the fill propagates as itself. The memfd is then sealed (no write,
shrink or grow) so that any process receiving it can map it read-only, gather
rows by itself, or hand the blocks to an engine's kernel.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..errors import StorageError
from ..format.arena_layout import BLOCK_ALIGN, ArenaInfo, ArenaLayout
from ..format.checksums import bad_pages as check_pages
from ..format.layout import PAGE_BYTES
from ..native import pagesizes
from ..native.pagesizes import Backing, PageSizes
from ..native.syscalls import aligned_buffer, as_array, create_memfd_as, map_fd, seal_read_only
from ..models.spec import RowFormat
from .integrity import failing_items
from .layer_file import LayerFile

log = logging.getLogger(__name__)

FILL_CHUNK_BYTES = 64 << 20


BulkRead = Callable[[LayerFile, int, int, object], None]  # (layer file, file offset, nbytes, dest buffer)


OnBadPages = Callable[[int, np.ndarray, str], None]  # (layer, page numbers, who found them)


def resident_layout(layer_rows: list[tuple[int, int]], row_format: RowFormat, *,
                    page_bytes: int = BLOCK_ALIGN) -> ArenaLayout:
    """Where each ``(layer, rows)`` goes in the resident arena (the engines' layout), its size a
    whole number of ``page_bytes`` (the pages backing it; 2 MiB blocks hold any smaller page)."""
    return ArenaLayout.plan(layer_rows, row_format.payload_bytes, row_format.scale_count, page_bytes=page_bytes)


def arena_backings(layer_rows: list[tuple[int, int]], row_format: RowFormat, *, huge: bool = True,
                   sizes: PageSizes | None = None) -> list[Backing]:
    """The pages that may back the arena of ``layer_rows``, best first (:func:`.pagesizes.backings`
    on the kernel's page sizes, read now unless ``sizes`` are given): the first is what the arena
    gets unless the kernel refuses it when it is made. ``Backing.nbytes`` is the arena's size on it."""
    sizes = pagesizes.read_page_sizes() if sizes is None else sizes
    return pagesizes.backings(lambda page: resident_layout(layer_rows, row_format, page_bytes=page).size, sizes,
                              huge=huge)


class ResidentArena:
    """The whole table set in a sealed memfd, in the engines' layout. Read-only after :meth:`build`."""

    def __init__(self, memfd, mm, layout: ArenaLayout, huge_pages: str, page_bytes: int = 0) -> None:
        self.memfd = memfd
        self._mm = mm
        self.layout = layout
        self.huge_pages = huge_pages  # "hugetlb", "thp" or "none"
        self.page_bytes = page_bytes  # their size
        data = as_array(mm)
        self.blocks = {a.layer: (data[a.weight_offset: a.weight_offset + a.rows * a.weight_bytes].reshape(a.rows, a.weight_bytes),
                                 data[a.scale_offset: a.scale_offset + a.rows * a.scale_bytes].reshape(a.rows, a.scale_bytes))
                       for a in layout.layers}

    @classmethod
    def build(cls, files: list[LayerFile], row_format: RowFormat, bulk_read: BulkRead, *, huge: bool = True,
              chunk_bytes: int = FILL_CHUNK_BYTES, on_bad: OnBadPages | None = None,
              sizes: PageSizes | None = None) -> "ResidentArena":
        """Allocate (on the first of :func:`arena_backings` the kernel grants; ``sizes``: the
        kernel's page sizes, read now by default), fill from ``files`` (healthy layers only),
        seal, map read-only. Pages that fail their crc32c are reported to ``on_bad`` (their rows
        stay zero)."""
        layer_rows = [(lf.layer, lf.layout.rows) for lf in files]
        memfd = create_memfd_as("engram-arena", arena_backings(layer_rows, row_format, huge=huge, sizes=sizes))
        backing = memfd.backing
        layout = resident_layout(layer_rows, row_format,
                                 page_bytes=backing.page_bytes if backing.kind == "hugetlb" else BLOCK_ALIGN)
        size = layout.size
        assert size == memfd.size, (size, memfd.size)  # arena_backings sized it with this same layout
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
            _close_map(mm)  # the error raised in the fill is the one that propagates
            memfd.close()
            raise
        mm.close()  # sealing against writes needs every writable mapping gone
        seal_read_only(memfd.fd)
        seconds = time.perf_counter() - t0
        log.info("resident arena: %d layers in the engines' layout, %.1f MiB filled in %.2fs (%.0f MB/s), "
                 "on %s%s", len(files), size / 2**20, seconds, size / max(seconds, 1e-9) / 1e6, backing.describe(),
                 "" if backing.kind != "none" else " (reserve huge pages or set shmem THP to advise: GPU lookups "
                 "over small pages are much slower; see docs/sizing.md)")
        return cls(memfd, map_fd(memfd.fd, size, writable=False, huge=huge, populate=True), layout, backing.kind,
                   backing.page_bytes)

    def info(self) -> ArenaInfo:
        return ArenaInfo(self.memfd.fd, self.layout, self.huge_pages, self.page_bytes)

    @property
    def nbytes(self) -> int:
        return self.memfd.size

    def close(self) -> None:
        self.blocks = {}
        _close_map(self._mm)
        self.memfd.close()


def _close_map(mm) -> None:
    """Unmap ``mm`` now, or, while arrays still view it (a caller's, or the frames of a traceback
    being raised), when the last of them is freed."""
    try:
        mm.close()
    except BufferError:
        log.debug("resident arena still referenced by an array; unmapped when that is freed")


def fill_split(weights: np.ndarray, scales: np.ndarray, lf: LayerFile, bulk_read: BulkRead,
               chunk_bytes: int) -> np.ndarray:
    """Read ``lf`` front to back in chunks (the next chunk is read and checked while the
    current one is split) and write each row's payload into ``weights`` (uint8 ``[rows, wb]``)
    and its scales into ``scales`` (uint8 ``[rows, sb]``). Each chunk's pages are checked
    against ``lf.crcs`` (when set); returns the int64 page numbers that failed, or whose
    chunk could not be read (logged), whose rows are left zero. A striped layer is read
    stripe after stripe, each front to back; its local page q of stripe k is layer page
    k + K * q (see :meth:`LayerFile.layer_pages`)."""
    layout = lf.layout
    rpp, rb, wb = layout.rows_per_page, layout.row_bytes, weights.shape[1]
    chunk_pages = max(1, chunk_bytes // PAGE_BYTES)
    spans = [(part, q, min(q + chunk_pages, part.layout.pages)) for part in lf.parts()
             for q in range(0, part.layout.pages, chunk_pages)]
    if not spans:
        return np.empty(0, dtype=np.int64)
    biggest = max(q1 - q0 for _, q0, q1 in spans)
    buffers = [aligned_buffer(biggest * PAGE_BYTES) for _ in range(min(2, len(spans)))]

    def read(i: int) -> tuple[object, np.ndarray]:
        part, q0, q1 = spans[i]
        buf = buffers[i % len(buffers)]
        unreadable = _read_span(bulk_read, part, q0, q1, buf)
        if part.crcs is None:
            return buf, q0 + unreadable
        if not len(unreadable):
            return buf, q0 + check_pages(buf, part.crcs[q0:q1])
        readable = np.setdiff1d(np.arange(q1 - q0), unreadable)
        pages = as_array(buf, (q1 - q0) * PAGE_BYTES).reshape(q1 - q0, PAGE_BYTES)
        bad = readable[check_pages(pages[readable], part.crcs[q0 + readable])]
        return buf, q0 + np.union1d(unreadable, bad)

    bad_parts = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-fill") as ex:
        pending = ex.submit(read, 0)
        for i, (part, q0, q1) in enumerate(spans):
            buf, bad = pending.result()
            if i + 1 < len(spans):
                pending = ex.submit(read, i + 1)
            pages = as_array(buf, (q1 - q0) * PAGE_BYTES).reshape(q1 - q0, PAGE_BYTES)
            rows = pages[:, : rpp * rb].reshape((q1 - q0) * rpp, rb)
            if part.stripe_count == 1:  # the layer's own file: its rows are one run
                r0, r1 = q0 * rpp, min(q1 * rpp, layout.rows)
                weights[r0:r1] = rows[: r1 - r0, :wb]
                scales[r0:r1] = rows[: r1 - r0, wb:]
            else:  # a stripe: its pages are every K-th page of the layer
                at = (part.layer_pages(np.arange(q0, q1))[:, None] * rpp + np.arange(rpp)).reshape(-1)
                keep = at < layout.rows
                weights[at[keep]] = rows[keep, :wb]
                scales[at[keep]] = rows[keep, wb:]
            bad = part.layer_pages(bad)
            if len(bad):  # never leave a corrupt page's bytes where an in-place reader could take them
                bad_parts.append(bad)
                bad_rows = (bad[:, None] * rpp + np.arange(rpp)).reshape(-1)
                bad_rows = bad_rows[bad_rows < layout.rows]
                weights[bad_rows] = 0
                scales[bad_rows] = 0
            del pages, rows
    for buf in buffers:
        buf.close()
    return np.sort(np.concatenate(bad_parts)) if bad_parts else np.empty(0, dtype=np.int64)


def _read_span(bulk_read: BulkRead, part: LayerFile, q0: int, q1: int, buf) -> np.ndarray:
    """Pages ``q0..q1-1`` of ``part`` into ``buf`` by one bulk read; if it fails, the pages that
    cannot be read are found by reading halves (:func:`.integrity.failing_items`) and the others
    read. Returns the unreadable pages (0-based within the span), whose rows are refused."""
    def attempt(lo: int, hi: int) -> None:
        bulk_read(part, (q0 + lo) * PAGE_BYTES, (hi - lo) * PAGE_BYTES, as_array(buf)[lo * PAGE_BYTES: hi * PAGE_BYTES])

    try:
        attempt(0, q1 - q0)
        return np.empty(0, dtype=np.int64)
    except StorageError as exc:
        log.warning("layer %d: reading pages %d..%d of %s failed (%s); reading them by halves to find the "
                    "unreadable ones", part.layer, q0, q1 - 1, part.path, str(exc))
    return np.asarray(failing_items(q1 - q0, attempt, retry=StorageError), dtype=np.int64)
