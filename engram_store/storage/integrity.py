"""Which pages of the table set are known corrupt, and the typed error for their rows.

Every page the store reads is checked against its crc32c where it is read (the
NVMe reader as each read completes, the resident fill once per chunk, the
scrub); whoever finds a bad page reports it here with :meth:`PageHealth.mark`.
A read that fails (an I/O error, a short read) is retried on halves of its
pages until the pages that cannot be read are found (:func:`failing_items`):
only those, and those whose crc32c fails, are marked, never a whole chunk.
A page is logged once when it turns bad (ERROR, with layer, page and file
offset, and who found it; at most :data:`LOG_LINES_PER_WINDOW` lines per
:data:`LOG_WINDOW_SECONDS`, the rest counted in the next line) and counted; in
resident mode its rows are then refused on every lookup (the sealed arena
holds zeros for them), in cached mode it is never admitted to the cache, and
a later read that finds it good (the file repaired, a transient error gone)
clears it (:meth:`PageHealth.clear`).

Memory: a set of page numbers per layer, and a bitmap of a layer's pages
(one byte each, allocated zeroed at the first bad page of that layer) for the
vectorized row check.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import numpy as np

from ..errors import CorruptRows
from ..format.layout import PAGE_BYTES, PageLayout

log = logging.getLogger(__name__)

LOGGED_PER_CALL = 8  # pages logged one by one per report; the rest in one summary line
LOG_LINES_PER_WINDOW = 32  # page lines (bad or cleared) logged per window at most; the rest are counted
LOG_WINDOW_SECONDS = 60.0


def failing_items(n: int, attempt: Callable[[int, int], None], retry: type[BaseException] | tuple = OSError,
                  whole_failed: bool = True) -> list[int]:
    """The items ``i`` of ``0..n-1`` that fail on their own: ``attempt(lo, hi)`` handles items
    ``lo..hi-1`` and raises ``retry`` when any of them fails. Ranges that fail are halved until
    single items remain (a few bad items among many cost O(bad x log n) attempts; every
    item that can be handled is handled once more). ``whole_failed``: ``attempt(0, n)`` is
    known to have failed already, start with its halves."""
    bad = []
    stack = [(n // 2, n), (0, n // 2)] if whole_failed and n > 1 else [(0, n)]
    while stack:
        lo, hi = stack.pop()
        if lo >= hi:
            continue
        try:
            attempt(lo, hi)
        except retry:
            if hi - lo == 1:
                bad.append(lo)
            else:
                mid = (lo + hi) // 2
                stack += [(mid, hi), (lo, mid)]
    return sorted(bad)


class _LogBudget:
    """At most ``lines`` log lines per ``window`` seconds; the lines held back are counted."""

    def __init__(self, lines: int = LOG_LINES_PER_WINDOW, window: float = LOG_WINDOW_SECONDS) -> None:
        self.lines, self.window = lines, window
        self._start, self._used, self._held = -window, 0, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[int, int]:
        """Of ``n`` lines wanted now: (how many to log, how many were held back earlier and are
        to be told now, in one line)."""
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self.window:
                self._start, self._used = now, 0
            ok = max(0, min(n, self.lines - self._used))
            self._used += ok
            told = 0
            if ok:
                told, self._held = self._held, 0
            self._held += n - ok
            return ok, told


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
        self._log = _LogBudget()

    # --- reporting ----------------------------------------------------------------
    def mark(self, layer: int, pages, found_by: str) -> int:
        """Record ``pages`` (page numbers of ``layer``'s file) as corrupt or unreadable; returns
        how many were not known before. Each new page is logged once (rate-limited)."""
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
        shown, held = self._log.take(min(len(new), LOGGED_PER_CALL))
        if held:
            log.error("corrupt or unreadable pages: %d more page lines held back in the last %.0fs (see bad_pages)",
                      held, LOG_WINDOW_SECONDS)
        for p in new[:shown]:
            log.error("corrupt page: layer %d page %d (%s) does not match its crc32c or cannot be read (found by %s); "
                      "its rows are refused, the rest of the layer is served; repair the table set (engram-store "
                      "verify, then re-import or re-synth)", layer, p, self.where(layer, p), found_by)
        if len(new) > shown and shown:
            log.error("corrupt pages: layer %d, %d more pages, %d..%d (found by %s)", layer,
                      len(new) - shown, new[shown], new[-1], found_by)
        return len(new)

    def clear(self, layer: int, pages, found_by: str) -> int:
        """``pages`` of ``layer`` were just read and matched their crc32c: those marked bad are
        not any more (the file was repaired, or an I/O error was transient). Returns how many."""
        if layer not in self._bitmap:
            return 0
        pages = np.unique(np.asarray(pages, dtype=np.int64))
        with self._lock:
            known = self._bad.get(layer, set())
            good = [p for p in pages.tolist() if p in known]
            if not good:
                return 0
            known.difference_update(good)
            if known:
                self._bitmap[layer][good] = 0
            else:  # nothing bad left: lookups skip the bitmap again
                del self._bitmap[layer], self._bad[layer]
        shown, _ = self._log.take(1)
        if shown:
            log.warning("layer %d: %d page(s) marked bad read good again (found by %s): %s; their rows are served",
                        layer, len(good), found_by, good[:8] + (["..."] if len(good) > 8 else []))
        return len(good)

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
