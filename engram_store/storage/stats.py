"""Plain stat objects of the storage engine (units in the names).

:class:`LookupStats` describes one ``lookup_into`` call and is its return value;
:class:`StoreCounters` accumulates them. Exporting (Prometheus) lives elsewhere.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass


@dataclass
class LookupStats:
    """What one lookup did. ``rows_*`` and ``bytes_*`` count positions of the request
    (duplicates included), ``nvme_*`` what was read from the NVMe tier."""

    rows: int = 0
    rows_dram: int = 0
    rows_nvme: int = 0
    bytes_dram: int = 0
    bytes_nvme: int = 0
    nvme_rows_distinct: int = 0  # distinct rows read from NVMe
    nvme_rows_shared: int = 0  # distinct rows taken from a concurrent lookup's NVMe read (read once for both)
    nvme_pages_read: int = 0  # distinct 4 KiB pages read
    nvme_reads: int = 0  # read calls after coalescing adjacent pages
    nvme_bytes_read: int = 0
    nvme_read_seconds: float = 0.0
    cache_admitted: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)


_FIELDS = tuple(f.name for f in dataclasses.fields(LookupStats))


class StoreCounters:
    """Cumulative counters, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = LookupStats()
        self.requests = 0
        self.errors = 0

    def add(self, s: LookupStats) -> None:
        with self._lock:
            self.requests += 1
            t = self._total
            for name in _FIELDS:
                setattr(t, name, getattr(t, name) + getattr(s, name))

    def add_dram(self, rows: int, nbytes: int, seconds: float) -> None:
        """:meth:`add` for a lookup served wholly from DRAM (the resident fast path)."""
        with self._lock:
            self.requests += 1
            t = self._total
            t.rows += rows
            t.rows_dram += rows
            t.bytes_dram += nbytes
            t.seconds += seconds

    def admitted(self, rows: int) -> None:
        """Rows a lookup read were admitted into the cache after it returned (its ``cache_admitted``)."""
        with self._lock:
            self._total.cache_admitted += rows

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            d = self._total.as_dict()
            d["lookup_seconds"] = d.pop("seconds")
            d["requests"] = self.requests
            d["request_errors"] = self.errors
        d["hit_rate"] = d["rows_dram"] / d["rows"] if d["rows"] else 0.0
        return d
