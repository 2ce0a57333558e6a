"""Which pages of the table set are known corrupt, and the typed error for their rows.

Every page the store reads is checked against its crc32c where it is read (the
NVMe reader as each read completes, the resident fill once per chunk, the
scrub); whoever finds a bad page reports it here with :meth:`PageHealth.mark`.
A page is logged once (ERROR, with layer, page and file offset, and who found
it) and counted; in resident mode its rows are then refused on every lookup,
in cached mode it is never admitted to the cache (each read checks it again).

Memory: a set of page numbers per layer, and a bitmap of a layer's pages
(one byte each, allocated zeroed at the first bad page of that layer) for the
vectorized row check.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from ..errors import CorruptRows
from ..format.layout import PAGE_BYTES, PageLayout

log = logging.getLogger(__name__)

LOGGED_PER_CALL = 8  # pages logged one by one per report; the rest in one summary line


class PageHealth:
    """Bad pages of every layer. Thread-safe."""

    def __init__(self, layouts: dict[int, PageLayout], paths: dict[int, str | list[str]]) -> None:
        """``paths``: each layer's data file, or the list of its stripe files (page p in stripe
        p % K at (p // K) * 4096)."""
        self._layouts = layouts
        self._paths = {layer: [p] if isinstance(p, str) else list(p) for layer, p in paths.items()}
        self._lock = threading.Lock()
        self._bad: dict[int, set[int]] = {}
        self._bitmap: dict[int, np.ndarray] = {}  # layer -> uint8 [pages], 1 = bad
        self.rows_refused = 0  # request positions refused because their page is corrupt

    # --- reporting ----------------------------------------------------------------
    def mark(self, layer: int, pages, found_by: str) -> int:
        """Record ``pages`` (page numbers of ``layer``'s file) as corrupt; returns how many
        were not known before. Each new page is logged once."""
        pages = np.unique(np.asarray(pages, dtype=np.int64))
        if not len(pages):
            return 0
        with self._lock:
            known = self._bad.setdefault(layer, set())
            new = [p for p in pages.tolist() if p not in known]
            if not new:
                return 0
            known.update(new)
            bitmap = self._bitmap.get(layer)
            if bitmap is None:
                bitmap = self._bitmap[layer] = np.zeros(self._layouts[layer].pages, dtype=np.uint8)
            bitmap[new] = 1
        for p in new[:LOGGED_PER_CALL]:
            log.error("corrupt page: layer %d page %d (%s) does not match its crc32c (found by %s); its rows are "
                      "refused, the rest of the layer is served; repair the table set (engram-store verify, then "
                      "re-import or re-synth)", layer, p, self.where(layer, p), found_by)
        if len(new) > LOGGED_PER_CALL:
            log.error("corrupt pages: layer %d, %d more pages, %d..%d (found by %s)", layer,
                      len(new) - LOGGED_PER_CALL, new[LOGGED_PER_CALL], new[-1], found_by)
        return len(new)

    # --- asking ---------------------------------------------------------------------
    def has_bad(self, layer: int) -> bool:
        return layer in self._bitmap  # a dict read: no lock needed on the lookup path

    def bad_rows(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """bool mask over ``rows`` (in-range int64): which sit in a page known corrupt."""
        bitmap = self._bitmap.get(layer)
        if bitmap is None:
            return np.zeros(len(rows), dtype=bool)
        return bitmap[rows // self._layouts[layer].rows_per_page].astype(bool)

    def bad_pages(self, layer: int) -> np.ndarray:
        """Sorted int64 page numbers of ``layer`` known corrupt."""
        with self._lock:
            return np.array(sorted(self._bad.get(layer, ())), dtype=np.int64)

    def bad_ranges(self) -> dict[int, list[list[int]]]:
        """``{layer: [[first_page, end_page), ...]}`` for every layer with a corrupt page."""
        out = {}
        for layer in sorted(self._bad):
            pages = self.bad_pages(layer)
            if len(pages):
                runs = np.split(pages, np.flatnonzero(np.diff(pages) != 1) + 1)
                out[layer] = [[int(run[0]), int(run[-1]) + 1] for run in runs]
        return out

    @property
    def pages(self) -> int:
        """Distinct pages known corrupt, every layer."""
        with self._lock:
            return sum(len(s) for s in self._bad.values())

    def where(self, layer: int, page: int) -> str:
        """Where layer page ``page`` sits on disk: ``file offset N of PATH`` (of its stripe file)."""
        paths = self._paths.get(layer) or [""]
        k = len(paths)
        return f"file offset {(page // k) * PAGE_BYTES} of {paths[page % k]}"

    # --- the error ---------------------------------------------------------------------
    def refuse(self, layer: int, rows: np.ndarray, positions: int) -> CorruptRows:
        """The error for a request of ``layer`` whose ``rows`` (distinct, in bad pages) were
        asked at ``positions`` places of the request; counted in :attr:`rows_refused`."""
        rpp = self._layouts[layer].rows_per_page
        pages = np.unique(rows // rpp)
        with self._lock:
            self.rows_refused += positions
        shown = ", ".join(f"page {p} at {self.where(layer, p)}" for p in pages[:4].tolist())
        more = f" and {len(pages) - 4} more" if len(pages) > 4 else ""
        row_list = ", ".join(map(str, rows[:8].tolist())) + (", ..." if len(rows) > 8 else "")
        return CorruptRows(f"layer {layer}: {len(rows)} row(s) asked ({row_list}) are in {len(pages)} corrupt page(s) "
                           f"({shown}{more}: crc32c mismatch); the layer's other rows "
                           "are served; repair the table set (engram-store verify, then re-import or re-synth)",
                           layer, tuple(pages.tolist()))
