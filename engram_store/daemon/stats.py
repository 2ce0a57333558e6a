"""Plain stats objects of the daemon: counters and latency histograms per transport.

They know nothing of Prometheus; ``metrics.py`` reads them at scrape time and
``snapshot()`` feeds the Stats request of both transports.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

# Latency bucket upper bounds in seconds (Prometheus style, +Inf implied).
LATENCY_BUCKETS: tuple[float, ...] = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3,
                                      100e-3, 200e-3, 500e-3, 1.0, 2.0, 5.0)


@dataclass
class TransportStats:
    """Counters of one transport ("unix" or "grpc"). Thread-safe through ``record``."""

    name: str
    requests: int = 0
    rows: int = 0
    bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # status name -> count
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum_seconds: float = 0.0
    connected_clients: int = 0
    native_requests: int = 0  # of requests, those answered by the native Unix path
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, rows: int, row_bytes: int, seconds: float, error: str | None = None, native: bool = False) -> None:
        slot = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            self.requests += 1
            self.native_requests += native
            self.latency_buckets[slot] += 1
            self.latency_sum_seconds += seconds
            if error is None:
                self.rows += rows
                self.bytes += rows * row_bytes
            else:
                self.errors[error] = self.errors.get(error, 0) + 1

    def client_delta(self, delta: int) -> None:
        with self._lock:
            self.connected_clients += delta

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            out: dict[str, int | float] = {
                f"{self.name}_requests": self.requests,
                f"{self.name}_rows": self.rows,
                f"{self.name}_bytes": self.bytes,
                f"{self.name}_errors": sum(self.errors.values()),
                f"{self.name}_latency_sum_seconds": self.latency_sum_seconds,
                f"{self.name}_connected_clients": self.connected_clients,
                f"{self.name}_native_requests": self.native_requests,
            }
            for name, count in self.errors.items():
                out[f"{self.name}_errors_{name.lower()}"] = count
            return out

    def histogram(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self.latency_buckets), self.latency_sum_seconds


# Why a Unix client is refused or dropped (DaemonStats.drop): the exporter shows each, 0 until it happens.
DROP_REASONS = ("refused", "region_budget", "handshake_timeout", "idle", "slow_reader", "fd_limit")


@dataclass
class DaemonStats:
    """Everything the daemon counts, besides what the store counts itself."""

    unix: TransportStats = field(default_factory=lambda: TransportStats("unix"))
    grpc: TransportStats = field(default_factory=lambda: TransportStats("grpc"))
    protocol_errors: int = 0  # connections closed for garbage frames
    # Unix clients refused or dropped by a bound, by reason: refused (max_clients, max_clients_per_uid),
    # region_budget, handshake_timeout, idle, slow_reader (unread replies past their bound or too long),
    # fd_limit (accept() failed: the daemon is out of file descriptors)
    dropped_clients: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)  # when the daemon began (uptime_seconds counts from here)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def protocol_error(self) -> None:
        with self._lock:
            self.protocol_errors += 1

    def drop(self, reason: str) -> None:
        with self._lock:
            self.dropped_clients[reason] = self.dropped_clients.get(reason, 0) + 1

    def drops(self) -> dict[str, int]:
        """Clients refused or dropped so far, by reason (a copy)."""
        with self._lock:
            return dict(self.dropped_clients)

    def transports(self) -> tuple[TransportStats, TransportStats]:
        return self.unix, self.grpc

    def snapshot(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {"protocol_errors": self.protocol_errors,
                                       "uptime_seconds": round(time.monotonic() - self.started, 3)}
        out.update({f"unix_dropped_clients_{reason}": n for reason, n in self.drops().items()})
        for t in self.transports():
            out.update(t.snapshot())
        return out


def combined_snapshot(daemon: DaemonStats, store_stats: dict[str, int | float]) -> dict[str, float]:
    """The Stats answer: store counters prefixed ``store_``, daemon counters as they are, plus hit ratio."""
    out = {f"store_{k}": float(v) for k, v in store_stats.items() if isinstance(v, (int, float))}
    out.update({k: float(v) for k, v in daemon.snapshot().items()})
    out["hit_ratio"] = hit_ratio(store_stats)
    return out


def hit_ratio(store_stats: dict[str, int | float]) -> float:
    """Share of rows served from DRAM (1.0 before any request and in resident mode)."""
    dram = float(store_stats.get("rows_dram", 0))
    nvme = float(store_stats.get("rows_nvme", 0))
    return dram / (dram + nvme) if dram + nvme else 1.0
