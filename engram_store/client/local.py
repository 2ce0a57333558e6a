"""The "tables in process memory" baseline: a client with EngramClient's surface over a RowStore.

:class:`LocalClient` wraps any :class:`engram_store.storage.base.RowStore`
(``engram_store.TieredStore`` in process, or :class:`MemoryTables` below) and answers
``lookup_into`` / ``lookup`` / ``info`` / ``stats`` / ``arena`` exactly like the
daemon client does, so the prefetcher, the tiny model and the benchmarks run
unchanged against either.

:class:`MemoryTables` loads a table set into one sealed read-only memfd laid out
exactly like the daemon's resident arena (:mod:`engram_store.format.arena_layout`:
the engines' weights and scales blocks), so the resident fast path can be
exercised without a daemon.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engram_store.errors import CorruptRows, InvalidRequest
from engram_store.format import requests
from engram_store.format.arena_layout import ArenaInfo, ArenaLayout, ArenaView
from engram_store.format.checksums import bad_pages
from engram_store.format.layout import PAGE_BYTES
from engram_store.format.tableset import TableSet
from engram_store.native import syscalls
from engram_store.models.spec import ModelSpec

if TYPE_CHECKING:
    from engram_store.storage.base import RowStore

log = logging.getLogger(__name__)


class MemoryTables:
    """A RowStore holding a whole table set in process memory (one sealed memfd).

    Thread-safe: lookups only read the mapping.
    """

    def __init__(self, spec: ModelSpec, layers: dict[int, np.ndarray]) -> None:
        self.spec = spec
        self._row_bytes = spec.row_bytes
        fmt = spec.row_format
        layout = ArenaLayout.plan([(layer, rows.shape[0]) for layer, rows in layers.items()], fmt.payload_bytes,
                                  fmt.scale_count)
        self._fd = os.memfd_create("engram-local-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._fd, layout.size)
        for entry, rows in zip(layout.layers, layers.values()):
            os.pwrite(self._fd, np.ascontiguousarray(rows[:, : fmt.payload_bytes]), entry.weight_offset)
            os.pwrite(self._fd, np.ascontiguousarray(rows[:, fmt.payload_bytes:]), entry.scale_offset)
        syscalls.seal_read_only(self._fd)
        self._view = ArenaView.map_fd(self._fd, layout)
        self._rows_of = {a.layer: a.rows for a in layout.layers}
        self._arena = ArenaInfo(self._fd, layout)
        self._requests = 0
        self._rows = 0

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "MemoryTables":
        """Read every layer of the table set at ``directory`` into memory."""
        ts = TableSet.open(Path(directory))
        try:
            layers = {}
            for layer in ts.layers:
                entry = ts.manifest.layer(layer)
                pages = ts.read_pages(layer)  # in layer page order, striped or not
                bad = bad_pages(pages, ts.page_crcs(layer))
                if len(bad):  # never serve a row whose bytes were not verified
                    raise CorruptRows(f"layer {layer}: {len(bad)} page(s) of its data fail their crc32c "
                                      f"(first: page {int(bad[0])}, offset {int(bad[0]) * PAGE_BYTES}); "
                                      "run `engram-store verify`, then re-import or re-synth")
                layers[layer] = entry.layout.unpack(pages, 0, entry.rows)
            return cls(ts.spec, layers)
        finally:
            ts.close()

    # --- RowStore -------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(a.layer for a in self._view.layers)

    @property
    def row_bytes(self) -> int:
        return self._row_bytes

    @property
    def mode(self) -> str:
        return "resident"

    def rows(self, layer: int) -> int:
        return self._rows_of[requests.check_layer(layer, self._rows_of)]

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> None:
        layer, flat, out_rows = requests.check_lookup(layer, self._rows_of, None, self._row_bytes, row_ids, out)
        self._view.gather_into(layer, flat, out_rows)
        self._requests += 1
        self._rows += flat.size

    def lookup(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(row_ids)
        out = np.empty(ids.shape + (self._row_bytes,), dtype=np.uint8)
        self.lookup_into(layer, ids, out)
        return out

    def arena(self) -> ArenaInfo | None:
        return self._arena

    def placement(self) -> dict[int, str]:
        return {layer: "resident" for layer in self._rows_of}

    def expect(self, rows: int) -> None:
        pass  # one thread gathers: nothing to wake

    def layer_errors(self) -> dict[int, str]:
        return {}  # every layer was read whole, or load() failed

    def bad_pages(self) -> dict[int, list[list[int]]]:
        return {}  # load() refuses a table set with a corrupt page (CorruptRows)

    def stats(self) -> dict[str, int | float]:
        return {"requests": self._requests, "rows_dram": self._rows, "bytes_dram": self._rows * self._row_bytes,
                "rows_nvme": 0, "bytes_nvme": 0, "arena_bytes": self._arena.size}

    def close(self) -> None:
        if self._fd >= 0:
            self._view.close()
            os.close(self._fd)
            self._fd = -1


class LocalClient:
    """An in-process client: the EngramClient surface over a RowStore, no daemon involved."""

    def __init__(self, store: RowStore, spec: ModelSpec | None = None) -> None:
        if spec is None:
            spec = getattr(store, "spec", None)  # RowStore.spec; a bare test double passes spec= instead
        if not isinstance(spec, ModelSpec):
            raise InvalidRequest("LocalClient needs the table set's ModelSpec: pass spec= or a store with .spec")
        self.store = store
        self.spec = spec
        self._arena: ArenaView | None = None

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "LocalClient":
        """A client over the table set at ``directory``, loaded whole into process memory
        (:class:`MemoryTables`). For the daemon's engine without the daemon, wrap an
        in-process store: ``LocalClient(engram_store.TieredStore.open(directory, ...))``."""
        return cls(MemoryTables.load(directory))

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> None:
        self.store.lookup_into(layer, row_ids, out)

    def lookup(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        return self.store.lookup(layer, row_ids)

    @property
    def arena(self) -> ArenaView | None:
        """The store's resident arena mapped read-only (like ``EngramClient.arena``), else None."""
        if self._arena is None:
            info = self.store.arena()
            if info is not None:
                self._arena = ArenaView.map_fd(info.fd, info.layout)
        return self._arena

    def info(self) -> dict[str, Any]:
        return {"layers": list(self.store.layers), "rows": {layer: self.store.rows(layer) for layer in self.store.layers},
                "row_bytes": self.store.row_bytes, "mode": self.store.mode, "spec": self.spec.to_dict(),
                "transport": "local"}

    def stats(self) -> dict[str, int | float]:
        return self.store.stats()

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self.store.close()

    def __enter__(self) -> "LocalClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
