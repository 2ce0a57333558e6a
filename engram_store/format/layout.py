"""Where a row lives in a layer file: the page layout rule.

No row straddles a page: a page of ``page_bytes`` (4 KiB) holds
``rows_per_page = page_bytes // row_bytes`` whole rows from its start, the rest
of the page is zero padding. A cold row therefore costs exactly one aligned
page read, and every file is a whole number of pages (readable with O_DIRECT).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import TableFormatError

PAGE_BYTES = 4096


@dataclass(frozen=True)
class PageLayout:
    """Row-to-page arithmetic for one layer file."""

    rows: int  # rows in the layer
    row_bytes: int  # bytes per row
    page_bytes: int = PAGE_BYTES  # page size of the file

    def __post_init__(self) -> None:
        if not 0 < self.row_bytes <= self.page_bytes:
            raise TableFormatError(f"row_bytes {self.row_bytes} must be in 1..{self.page_bytes}")
        if self.rows < 0:
            raise TableFormatError(f"row count {self.rows} must not be negative")

    @property
    def rows_per_page(self) -> int:
        return self.page_bytes // self.row_bytes

    @property
    def pages(self) -> int:
        return -(-self.rows // self.rows_per_page)

    @property
    def file_bytes(self) -> int:
        return self.pages * self.page_bytes

    def page_of(self, row_ids: np.ndarray) -> np.ndarray:
        """Page index of each row (int64, same shape)."""
        return row_ids // self.rows_per_page

    def byte_offset(self, row_ids: np.ndarray) -> np.ndarray:
        """File offset of each row's first byte (int64, same shape)."""
        page, slot = np.divmod(row_ids, self.rows_per_page)
        return page * self.page_bytes + slot * self.row_bytes

    def pack(self, rows: "np.ndarray | Sequence[np.ndarray]") -> np.ndarray:
        """Lay rows out as pages: uint8 ``[ceil(n / rows_per_page), page_bytes]``.

        ``rows`` is uint8 ``[n, row_bytes]``, or a sequence of column parts
        (uint8 ``[n, w_i]`` with the ``w_i`` summing to ``row_bytes``, e.g. payload
        and scales) that are interleaved into rows without an intermediate copy.
        The first row of ``rows`` must start a page."""
        parts = [rows] if isinstance(rows, np.ndarray) else list(rows)
        n = parts[0].shape[0]
        rpp = self.rows_per_page
        out = np.empty((-(-n // rpp), self.page_bytes), dtype=np.uint8)
        out[:, rpp * self.row_bytes :] = 0
        full = n // rpp
        tail = n - full * rpp
        body = out[:full, : rpp * self.row_bytes].reshape(full, rpp, self.row_bytes)
        last = out[full, : rpp * self.row_bytes].reshape(rpp, self.row_bytes) if tail else None
        col = 0
        for part in parts:
            w = part.shape[1]
            body[:, :, col : col + w] = part[: full * rpp].reshape(full, rpp, w)
            if last is not None:
                last[:tail, col : col + w] = part[full * rpp :]
                last[tail:, col : col + w] = 0
            col += w
        if col != self.row_bytes:
            raise TableFormatError(f"row parts are {col} bytes wide, rows are {self.row_bytes}")
        return out

    def unpack(self, pages: np.ndarray, first_row: int, n: int) -> np.ndarray:
        """Inverse of :meth:`pack` for pages starting at the page holding ``first_row``
        (``first_row`` must be page aligned): uint8 ``[n, row_bytes]``."""
        rpp = self.rows_per_page
        body = pages.reshape(-1, self.page_bytes)[:, : rpp * self.row_bytes]
        return body.reshape(-1, self.row_bytes)[:n]


def extents(pages: np.ndarray, max_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Reads covering sorted distinct ``pages``: runs of consecutive pages, cut every
    ``max_pages``. Returns (index of each read's first page in ``pages``, read lengths in
    pages). The one coalescing rule of every reader of layer files (the NVMe tier, a
    client executing a read plan)."""
    n = len(pages)
    start = np.ones(n, dtype=bool)
    np.not_equal(pages[1:], pages[:-1] + 1, out=start[1:])
    if max_pages > 1:
        run_start = np.flatnonzero(start)
        offset_in_run = np.arange(n) - run_start[np.cumsum(start) - 1]
        start |= offset_in_run % max_pages == 0
    else:
        start[:] = True
    begin = np.flatnonzero(start)
    return begin, np.diff(np.append(begin, n))
