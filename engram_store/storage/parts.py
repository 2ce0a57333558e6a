"""The shared parts of a :class:`~.tiered.TieredStore`, and the seams between the components built on them.

``open()`` (:func:`.opening.open_parts`) builds one :class:`StoreParts`: the layer files, the NVMe
tier and its page reader, the resident arena and the row cache (either may be None), the gather
threads and their helpers, the reads in flight, the page health, the access sampler, the counters
and the close gate. Each component of the store (:mod:`.resident_tier`, :mod:`.cached_path`,
:mod:`.plan`, :mod:`.hint_service`, :mod:`.native_access`, :mod:`.warmup`, :mod:`.checked_reads`)
is constructed with exactly the parts it uses; none reads another's private state. Where a
component needs another component, it takes it through a Protocol declared here.

Ownership: the parts belong to the store; :meth:`StoreParts.release` frees them once its close gate
has closed. Components never close a part.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..format.manifest import Manifest
from ..native.gather import Gatherer
from .close_gate import CloseGate
from .inflight import InFlight
from .integrity import PageHealth
from .layer_file import LayerFile
from .nvme import NvmeTier
from .overlap import ReadOverlap
from .profile import AccessSampler
from .resident import ResidentArena
from .row_cache import RowCache
from .stats import LookupStats, StoreCounters


@dataclass(frozen=True, eq=False)
class StoreParts:
    """What the components of one store share. The fields are fixed once opened; the objects they
    name are thread-safe (each documents how)."""

    directory: Path  # the table set's directory
    manifest: Manifest
    files: dict[int, LayerFile]  # every layer's file; one that could not be opened has ``file`` None and ``error``
    placement: dict[int, str]  # {layer: "resident" | "cached"} for every layer
    resident: frozenset[int]  # the layers the arena holds (servable resident layers)
    nvme: NvmeTier  # rows -> checked page reads; ``nvme.reader`` is the page reader
    arena: ResidentArena | None  # the sealed arena of the resident layers, None when none is
    cache: RowCache | None  # the slot cache of the cached layers, None when none is
    gather: Gatherer  # native row copies (threads for large requests)
    overlap: ReadOverlap  # helper threads for a lookup's copies beside its reads
    inflight: InFlight  # NVMe reads in flight, shared by lookups (and the hint reader) missing the same rows
    health: PageHealth  # pages known corrupt
    sampler: AccessSampler  # rows sampled from live traffic (access profiles)
    counters: StoreCounters  # cumulative lookup counters
    gate: CloseGate  # lookups in flight; close() waits for them

    @property
    def row_bytes(self) -> int:
        return self.manifest.spec.row_bytes

    def release(self) -> None:
        """Free threads, files and memory, in that order. Only once the close gate has closed (no call is
        inside) and the background readers have stopped."""
        self.overlap.close()
        self.nvme.close()
        self.nvme.reader.close()
        self.gather.close()
        if self.arena is not None:
            self.arena.close()
        if self.cache is not None:
            self.cache.close()


class PageChecks(Protocol):
    """Checked NVMe reads and what their checks found, shared by every component that reads pages.

    Contract: every method is thread-safe and is called from inside the store's close gate (it takes
    none itself). Bad pages are recorded in the store's :class:`~.integrity.PageHealth`, never returned
    as good bytes. ``rows`` are distinct, sorted int64 row ids of ``layer`` within bounds."""

    def refuse_known_bad(self, layer: int, flat: np.ndarray) -> None:
        """Raise CorruptRows (and count a request error) when any of ``flat`` sits in a page known corrupt."""
        ...

    def clear_good(self, layer: int, rows: np.ndarray, bad_pages: np.ndarray, who: str) -> None:
        """The pages of ``rows`` just read, except ``bad_pages``, matched their crc32c: no longer known bad."""
        ...

    def read_verified(self, layer: int, rows: np.ndarray, who: str) -> tuple[np.ndarray, np.ndarray, int]:
        """Read ``rows`` from NVMe; pages that fail their check are marked (found by ``who``) and their rows
        dropped. Returns (rows kept, their bytes ``[n, row_bytes]``, bytes read)."""
        ...


class ServeRows(Protocol):
    """The store's plain lookup: :meth:`~.tiered.TieredStore.lookup_into` without the close gate.

    Contract: the caller is inside the close gate. Same arguments, checks, errors and result as
    ``lookup_into`` (``t0``: ``time.perf_counter()`` when the request began, for its ``seconds``)."""

    def __call__(self, layer: int, row_ids: np.ndarray, out: np.ndarray, t0: float,
                 admit_later: list | None = None) -> LookupStats: ...
