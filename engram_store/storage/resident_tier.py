"""The resident tier's lookups: rows gathered from the sealed arena (:mod:`.resident`) in one native copy.

Every row of a resident layer is in DRAM, so a lookup is one gather (``take_split``: weights and scales
blocks into the caller's rows) that checks every id's bounds before it copies any. Rows of pages the fill
found corrupt (the arena holds zeros for them) are refused with CorruptRows: after the copy for an
ordinary lookup (a request that fails is not served), before it for a client's staging (a
:class:`~engram_store.native.gather.split_out.SplitOut`: its rows must be good once written).
"""

from __future__ import annotations

import time

import numpy as np

from ..format import requests
from ..native.gather import Gatherer
from ..native.gather.split_out import SplitOut
from .layer_file import LayerFile
from .parts import PageChecks
from .profile import AccessSampler
from .resident import ResidentArena
from .stats import LookupStats, StoreCounters


class ResidentTier:
    """Lookups of the layers in ``arena``. Thread-safe (the arena is sealed, read-only)."""

    def __init__(self, arena: ResidentArena | None, gather: Gatherer, sampler: AccessSampler,
                 counters: StoreCounters, checks: PageChecks, row_bytes: int) -> None:
        self._blocks = arena.blocks if arena is not None else {}  # layer -> (weights, scales)
        self._gather, self._sampler, self._counters, self._checks = gather, sampler, counters, checks
        self._row_bytes = row_bytes

    def lookup(self, lf: LayerFile, flat: np.ndarray, out2: np.ndarray, t0: float) -> LookupStats:
        """Fill ``out2`` (rows, or a SplitOut) with the rows ``flat`` of resident layer ``lf`` (checked:
        dtypes and shapes; bounds are checked here). ``t0``: when the request began."""
        if isinstance(out2, SplitOut):  # a client's staging: good rows only
            requests.check_bounds(lf.layer, flat, lf.layout.rows)
            self._checks.refuse_known_bad(lf.layer, flat)
        # The fast path: bounds are checked by the gather itself (no extra pass over
        # the ids), and as little Python as possible runs after it, when the copy
        # has pushed the interpreter's working set out of the CPU caches.
        try:
            self._gather.take_split(*self._blocks[lf.layer], flat, out2)
        except IndexError:  # the gather checks every id before it copies any
            requests.check_bounds(lf.layer, flat, lf.layout.rows)
            raise
        self._checks.refuse_known_bad(lf.layer, flat)
        self._sampler.record(lf.layer, flat)
        n, rb = len(flat), self._row_bytes
        seconds = time.perf_counter() - t0
        self._counters.add_dram(n, n * rb, seconds)
        return LookupStats(rows=n, rows_dram=n, bytes_dram=n * rb, seconds=seconds)
