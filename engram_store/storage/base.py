"""The seams of the storage engine, as Protocols whose docstrings are contracts.

``RowStore`` is what the daemon serves from and what in-process users call;
``TieredStore`` implements it. Anything with this shape (a test double, a
remote client) can stand in for it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from ..format.arena_layout import ArenaInfo, ArenaLayer, ArenaLayout

__all__ = ["ArenaInfo", "ArenaLayer", "ArenaLayout", "RowStore"]  # ArenaInfo and the layout: engram_store.format.arena_layout


@runtime_checkable
class RowStore(Protocol):
    """Serves row bytes of a table set. Thread-safe: any number of threads may call
    ``lookup_into`` at once.

    Contract of ``lookup_into(layer, row_ids, out)``:
    - ``row_ids``: integer ndarray of any shape (int64 preferred; other integer
      dtypes are accepted and converted); ``out``: C-contiguous writable uint8
      ndarray of shape ``row_ids.shape + (row_bytes,)``, owned by the caller.
    - On return, ``out[i] == bytes of row row_ids[i]`` for every i; duplicates
      are allowed. Nothing else in ``out`` and nothing of the store changes
      visibly to other callers.
    - Raises ``UnknownLayer`` / ``RowOutOfRange`` / ``InvalidRequest`` (see
      ``engram_store.errors``) before touching ``out`` for bad input, and
      ``StorageError`` when a tier cannot read (other layers keep working).
    - Blocks until the bytes are there (NVMe reads included).
    """

    @property
    def layers(self) -> tuple[int, ...]: ...

    @property
    def row_bytes(self) -> int: ...

    @property
    def mode(self) -> str:  # "resident" or "cached"
        ...

    def rows(self, layer: int) -> int: ...

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> None: ...

    def lookup(self, layer: int, row_ids: np.ndarray) -> np.ndarray: ...

    def arena(self) -> ArenaInfo | None:
        """The sealed read-only arena in resident mode, else None."""
        ...

    def stats(self) -> "dict[str, int | float]":
        """Cumulative counters, units in the names: requests, rows_dram, rows_nvme,
        bytes_dram, bytes_nvme, nvme_pages_read, nvme_read_seconds, cache_slots,
        cache_slots_used, arena_bytes, ..."""
        ...

    def close(self) -> None: ...
