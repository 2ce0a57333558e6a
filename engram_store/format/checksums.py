"""Page checksums: the crc32c (Castagnoli) of every 4 KiB page of a layer file.

One implementation does the work: ``_pread.c`` (the CPU's crc32c instruction:
SSE4.2 on x86-64, the ARMv8 CRC32 extension on aarch64; four pages interleaved,
or slicing-by-8 tables; probed once, the GIL released), which also checks pages inside the NVMe reader as their reads
complete. :func:`page_crcs_numpy` is the reference it is tested against, and
the fallback when the extension is not built (correct, about 100x slower).

Checksums are standard crc32c (``crc32c(b"123456789") == 0xE3069283``), so
any crc32c tool can check a page by hand.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from .. import native
from .layout import PAGE_BYTES

log = logging.getLogger(__name__)

POLY = 0x82F63B78  # crc32c, reflected


def _native():
    return native.load("_pread", "page checksums use numpy (slow)")


def implementation() -> str:
    """How page checksums are computed here: ``sse4.2`` (x86-64), ``armv8-crc32`` (aarch64), ``software``
    (C tables: no such instruction) or ``numpy`` (the native module is not built)."""
    native = _native()
    return native.CRC32C if native is not None else "numpy"


def crc32c(data, value: int = 0) -> int:
    """crc32c of a bytes-like object, continuing from ``value`` (like ``zlib.crc32``)."""
    native = _native()
    if native is not None:
        return native.crc32c(data, value)
    return _crc32c_numpy_bytes(np.frombuffer(data, dtype=np.uint8), value)


def page_crcs(data, n_pages: int | None = None) -> np.ndarray:
    """uint32 ``[n_pages]``: the crc32c of each 4 KiB page of ``data`` (a buffer of at least
    ``n_pages`` whole pages; default: all of it). One native call, GIL released."""
    view = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    n = len(view) // PAGE_BYTES if n_pages is None else n_pages
    view = view[: n * PAGE_BYTES]
    out = np.empty(n, dtype=np.uint32)
    native = _native()
    if native is not None:
        native.page_crcs(view, out)
    else:
        out[:] = page_crcs_numpy(view.reshape(n, PAGE_BYTES))
    return out


def bad_pages(data, expected: np.ndarray) -> np.ndarray:
    """Indices (int64) of the pages of ``data`` whose crc32c differs from ``expected``
    (uint32, one per page, ``data`` holding at least that many pages)."""
    return np.flatnonzero(page_crcs(data, len(expected)) != expected)


# --- the reference ---------------------------------------------------------------------
@functools.cache
def _table() -> np.ndarray:
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, (c >> 1) ^ np.uint32(POLY), c >> 1).astype(np.uint32)
    return c


def page_crcs_numpy(pages: np.ndarray) -> np.ndarray:
    """crc32c of each row of uint8 ``[n, width]``, bytewise over all rows at once (the
    reference implementation; plain numpy, no native code)."""
    table = _table()
    crc = np.full(pages.shape[0], 0xFFFFFFFF, dtype=np.uint32)
    for k in range(pages.shape[1]):
        crc = table[(crc ^ pages[:, k]) & 0xFF] ^ (crc >> 8)
    return crc ^ np.uint32(0xFFFFFFFF)


def _crc32c_numpy_bytes(data: np.ndarray, value: int) -> int:
    table = _table()
    crc = (value ^ 0xFFFFFFFF) & 0xFFFFFFFF
    for b in data.tolist():
        crc = int(table[(crc ^ b) & 0xFF]) ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF
