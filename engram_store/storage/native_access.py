"""A TieredStore's parts for same-host callers that read by themselves: the identity of each layer's files
(for the engines' fetch jobs, which read pages directly while the daemon is away), and the arena's and
row cache's views for the daemon's native Unix path, with the accounting of what that path served.
:class:`NativeAccess` is a component of :class:`~engram_store.storage.tiered.TieredStore`, which
delegates these methods to it."""

from __future__ import annotations

import logging
import os
import zlib
from pathlib import Path
from typing import Collection, Mapping

import numpy as np

from ..format.manifest import Manifest
from .close_gate import CloseGate
from .integrity import PageHealth
from .layer_file import LayerFile
from .profile import AccessSampler
from .resident import ResidentArena
from .row_cache import RowCache
from .stats import StoreCounters

log = logging.getLogger(__name__)


class NativeAccess:
    """What callers that read or gather by themselves are given, and their accounting. Thread-safe."""

    def __init__(self, directory: Path, manifest: Manifest, files: Mapping[int, LayerFile], resident: Collection[int],
                 arena: ResidentArena | None, cache: RowCache | None, health: PageHealth, sampler: AccessSampler,
                 counters: StoreCounters, gate: CloseGate) -> None:
        self._directory, self._manifest, self._files, self._resident = directory, manifest, files, resident
        self._arena, self._cache, self._health, self._sampler = arena, cache, health, sampler
        self._counters, self._gate, self._row_bytes = counters, gate, manifest.spec.row_bytes
        self._layer_files: dict[int, dict] = {}  # layer_files(), computed once per layer

    def layer_files(self) -> dict[int, dict]:
        """What a same-host client needs to read a servable layer's pages itself, checked: per layer
        ``{"crc_file", "crc32", "rows_per_page", "pages", "files": [[path, st_dev, st_ino, size], ...]}``
        (the data file, or each stripe in order, as fstat of the descriptors this store reads; ``crc32``:
        zlib.crc32 of the page checksums it checks against, so a client can tell it loaded the same)."""
        out = {}
        for layer, lf in self._files.items():
            if lf.file is None or lf.crcs is None:
                continue
            got = self._layer_files.get(layer)
            if got is None:
                entry = self._manifest.layer(layer)
                files = []
                for part in lf.parts():
                    st = os.fstat(part.file.fd)
                    files.append([os.path.abspath(part.path), st.st_dev, st.st_ino, st.st_size])
                got = self._layer_files[layer] = {
                    "crc_file": os.path.abspath(self._directory / entry.crc_file), "crc32": zlib.crc32(lf.crcs),
                    "rows_per_page": lf.layout.rows_per_page, "pages": lf.layout.pages, "files": files}
            out[layer] = got
        return out

    # --- for callers that gather from the arena themselves -----------------
    def resident_views(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Each servable resident layer's two blocks in the sealed arena, read-only
        ``(weights uint8 [rows, dim], scales uint8 [rows, scale_count])``; ``{}`` when no
        layer is resident. For a caller that gathers with its own native code (the daemon's Unix fast
        path): it must stop using the views before :meth:`close`, check every id against
        ``rows``, and report each lookup with :meth:`record_native_lookup`. A layer with a
        corrupt page (see :meth:`bad_pages`) is left out: only :meth:`lookup_into` refuses
        its rows, so its lookups must come here."""
        if self._arena is None or self._gate.closed:
            return {}
        views = {}
        for layer, lf in self._files.items():
            if lf.file is None or layer not in self._resident:
                continue
            if self._health.has_bad(layer):
                log.warning("layer %d has corrupt pages: its lookups take the checked path, not the caller's "
                            "native gather", layer)
                continue
            views[layer] = self._arena.blocks[layer]
        return views

    def cached_views(self) -> dict | None:
        """The row cache for a native reader (``RowCache.native_views``), its ``maps`` limited to the
        servable cached layers; None when there is none. See ``ResidentStore``."""
        if self._cache is None or self._gate.closed:
            return None
        views = self._cache.native_views()
        if views is None:
            return None
        views["maps"] = {layer: m for layer, m in views["maps"].items()
                         if self._files[layer].file is not None and layer not in self._resident}
        return views if views["maps"] else None

    def record_native_lookup(self, layer: int, ids: np.ndarray, seconds: float) -> None:
        """Count a lookup of ``ids`` served from :meth:`resident_views` or :meth:`cached_views` (stats,
        access sampling)."""
        self._sampler.record(layer, ids)
        n = len(ids)
        self._counters.add_dram(n, n * self._row_bytes, seconds)
