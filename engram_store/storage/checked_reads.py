"""Checked NVMe reads for the components of a store: page checks recorded in its page health.

:class:`CheckedReads` implements :class:`~.parts.PageChecks`: rows read from NVMe for the cache
(warm-up, background admission), and what every read's crc32c checks found (pages marked bad,
pages found good again), and the refusal of rows of pages already known corrupt.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .integrity import PageHealth
from .layer_file import LayerFile
from .nvme import NvmeTier
from .stats import StoreCounters


class CheckedReads:
    """:class:`~.parts.PageChecks` over a store's NVMe tier and page health. Thread-safe."""

    def __init__(self, nvme: NvmeTier, health: PageHealth, files: Mapping[int, LayerFile], counters: StoreCounters,
                 row_bytes: int) -> None:
        self._nvme, self._health, self._files, self._counters = nvme, health, files, counters
        self._row_bytes = row_bytes

    def refuse_known_bad(self, layer: int, flat: np.ndarray) -> None:
        """CorruptRows when any of ``flat`` sits in a page already known corrupt (rows read in place)."""
        if self._health.has_bad(layer):
            bad = self._health.bad_rows(layer, flat)
            if bad.any():
                self._counters.error()
                raise self._health.refuse(layer, np.unique(flat[bad]), int(np.count_nonzero(bad)))

    def read_verified(self, layer: int, rows: np.ndarray, who: str) -> tuple[np.ndarray, np.ndarray, int]:
        """Read distinct sorted ``rows`` from NVMe for the cache (warm-up, background admission):
        pages failing their crc32c are marked (found by ``who``) and their rows dropped. Returns
        (rows kept, their bytes, bytes read)."""
        data = np.empty((len(rows), self._row_bytes), dtype=np.uint8)
        rs = self._nvme.read_rows(layer, rows, data)
        self.clear_good(layer, rows, rs.bad_pages, who)
        if len(rs.bad_pages):
            self._health.mark(layer, rs.bad_pages, who)
            good = ~np.isin(rows // self._files[layer].layout.rows_per_page, rs.bad_pages)
            rows, data = rows[good], data[good]
        return rows, data, rs.bytes

    def clear_good(self, layer: int, rows: np.ndarray, bad_pages: np.ndarray, who: str) -> None:
        """Pages of ``rows`` just read that matched their crc32c are not bad (any more)."""
        if self._health.has_bad(layer):
            pages = np.unique(rows // self._files[layer].layout.rows_per_page)
            self._health.clear(layer, np.setdiff1d(pages, bad_pages), who)
