"""The operations HTTP endpoint: Prometheus metrics and the health probes.

The exporter reads the plain stats objects at scrape time and owns nothing
else: it is kept apart from ``stats.py`` and the store's ``stats()`` so neither
knows about Prometheus, and a private registry keeps the process-global one
untouched. The same listener answers the probes (no credentials, no rows):

* ``/livez``: 200 while the process serves HTTP at all (during the DRAM fill too);
* ``/readyz``: 200 once the tables are loaded and every listener is open, 503
  before that and while draining after SIGTERM (the body says which);
* ``/healthz``: the same as ``/readyz``;
* ``/metrics``: the Prometheus text format;

and 404 for any other path.
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .config import parse_hostport
from .stats import LATENCY_BUCKETS, DaemonStats, hit_ratio

log = logging.getLogger(__name__)

# store.stats() key -> (metric name, kind, help). Keys the store does not report are skipped.
_STORE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("requests", "engram_store_store_requests", "counter", "Lookups served by the store (all transports)"),
    ("nvme_reads", "engram_store_nvme_reads", "counter", "Read calls to the NVMe tier (coalesced pages)"),
    ("nvme_pages_read", "engram_store_nvme_pages_read", "counter", "Pages read from the NVMe tier"),
    ("nvme_bytes_read", "engram_store_nvme_read_bytes", "counter", "Bytes read from the NVMe tier"),
    ("nvme_read_seconds", "engram_store_nvme_read_seconds", "counter", "Time spent in NVMe reads"),
    ("arena_bytes", "engram_store_arena_bytes", "gauge", "Bytes of the resident arena"),
    ("arena_huge_pages", "engram_store_arena_huge_pages", "gauge",
     "Pages backing the resident arena: 0 4 KiB pages, 1 transparent huge pages, 2 reserved huge pages (hugetlb)"),
    ("cache_slots", "engram_store_cache_slots", "gauge", "Row slots of the DRAM cache"),
    ("cache_slots_used", "engram_store_cache_slots_used", "gauge", "Row slots of the DRAM cache holding a row"),
    ("dram_bytes", "engram_store_dram_bytes", "gauge", "Bytes of DRAM the store holds"),
    ("corrupt_pages", "engram_store_corrupt_pages", "counter",
     "Distinct 4 KiB pages found not matching their crc32c (their rows are refused, never served)"),
    ("corrupt_rows_refused", "engram_store_corrupt_rows_refused", "counter",
     "Rows of lookups refused because their page is corrupt"),
    ("scrub_bytes", "engram_store_scrub_bytes", "counter", "Bytes read and checked by the background scrub"),
    ("scrub_passes", "engram_store_scrub_passes", "counter", "Complete scrub passes over the table set"),
    ("plan_rows_planned", "engram_store_plan_rows_planned", "counter",
     "Row positions of plan lookups left to the client's read plan (read by the engine process)"),
    ("plan_pages_planned", "engram_store_plan_pages_planned", "counter", "Distinct pages in the read plans sent"),
    ("plan_admitted_rows", "engram_store_plan_admitted_rows", "counter",
     "Planned rows read, checked and admitted into the cache in the background"),
    ("plan_admit_dropped_rows", "engram_store_plan_admit_dropped_rows", "counter",
     "Planned rows not admitted because the background queue was full"),
)


class DaemonCollector:
    """A prometheus-client custom collector over DaemonStats and ``store_stats()``."""

    def __init__(self, stats: DaemonStats, store_stats: Callable[[], dict[str, int | float]], mode: str,
                 placement: dict[int, str] | None = None) -> None:
        self.stats, self.store_stats, self.mode = stats, store_stats, mode
        self.placement = dict(placement or {})

    def collect(self) -> Iterator[Metric]:
        store = self.store_stats()
        info = GaugeMetricFamily("engram_store_info", "Daemon facts (value is always 1)", labels=["mode"])
        info.add_metric([self.mode], 1)
        yield info
        layers = GaugeMetricFamily("engram_store_layer_resident", "1 for a layer served whole from the resident "
                                   "arena, 0 for a cached one", labels=["layer"])
        for layer, where in sorted(self.placement.items()):
            layers.add_metric([str(layer)], int(where == "resident"))
        yield layers
        requests = CounterMetricFamily("engram_store_requests", "Lookup requests", labels=["transport"])
        native = CounterMetricFamily("engram_store_native_requests", "Lookup requests answered by the native "
                                     "Unix path (resident mode)", labels=["transport"])
        rows = CounterMetricFamily("engram_store_rows", "Rows served", labels=["transport"])
        nbytes = CounterMetricFamily("engram_store_bytes", "Row bytes served", labels=["transport"])
        errs = CounterMetricFamily("engram_store_request_errors", "Failed requests", labels=["transport", "code"])
        clients = GaugeMetricFamily("engram_store_connected_clients", "Connected Unix-socket clients (gRPC has no "
                                    "connection state of its own)", labels=["transport"])
        latency = HistogramMetricFamily("engram_store_request_latency_seconds", "Lookup latency in the daemon",
                                        labels=["transport"])
        for t in self.stats.transports():
            snap = t.snapshot()
            requests.add_metric([t.name], snap[f"{t.name}_requests"])
            rows.add_metric([t.name], snap[f"{t.name}_rows"])
            nbytes.add_metric([t.name], snap[f"{t.name}_bytes"])
            if t.name == "unix":
                clients.add_metric([t.name], snap[f"{t.name}_connected_clients"])
                native.add_metric([t.name], snap[f"{t.name}_native_requests"])
            for code, count in t.errors.copy().items():
                errs.add_metric([t.name, code], count)
            counts, total = t.histogram()
            cumulative, buckets = 0, []
            for bound, count in zip(LATENCY_BUCKETS + (float("inf"),), counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            latency.add_metric([t.name], buckets, total)
        yield from (requests, native, rows, nbytes, errs, clients, latency)
        tier_rows = CounterMetricFamily("engram_store_tier_rows", "Rows served per tier", labels=["tier"])
        tier_bytes = CounterMetricFamily("engram_store_tier_bytes", "Row bytes served per tier", labels=["tier"])
        for tier in ("dram", "nvme"):
            tier_rows.add_metric([tier], float(store.get(f"rows_{tier}", 0)))
            tier_bytes.add_metric([tier], float(store.get(f"bytes_{tier}", 0)))
        yield tier_rows
        yield tier_bytes
        yield GaugeMetricFamily("engram_store_hit_ratio", "Share of rows served from DRAM", value=hit_ratio(store))
        yield CounterMetricFamily("engram_store_protocol_errors", "Unix connections closed for garbage frames",
                                  value=self.stats.protocol_errors)
        dropped = CounterMetricFamily("engram_store_dropped_clients", "Unix clients refused or dropped by a bound, "
                                      "by reason (see DaemonStats.dropped_clients)", labels=["reason"])
        for reason, count in sorted(self.stats.drops().items()):
            dropped.add_metric([reason], count)
        yield dropped
        for key, name, kind, doc in _STORE_METRICS:
            if isinstance(store.get(key), (int, float)):
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, doc, value=float(store[key]))
        slots = float(store.get("cache_slots", 0) or 0)
        if slots:
            yield GaugeMetricFamily("engram_store_cache_occupancy_ratio", "Share of DRAM cache slots in use",
                                    value=float(store.get("cache_slots_used", 0)) / slots)


STARTING, READY, STOPPING = "starting", "ready", "stopping"
_TEXT = [("Content-Type", "text/plain; charset=utf-8")]


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # probes and scrapes every few seconds: not logged
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the daemon's exit


class MetricsServer:
    """The HTTP endpoint on ``address`` (port 0 picks a free one): ``/metrics``, ``/livez``,
    ``/readyz``, ``/healthz``; 404 elsewhere.

    Started before the tables are opened, so that ``/livez`` answers during a fill of
    minutes; the daemon attaches the collector (:meth:`attach`) once the store is open and moves
    :attr:`state` from ``starting`` to ``ready`` (then ``stopping`` on SIGTERM).
    """

    def __init__(self, address: str, collector: DaemonCollector | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        if collector is not None:
            self.registry.register(collector)
        self.host, self.port = parse_hostport(address, "metrics")
        self.state = STARTING
        self._metrics_app = make_wsgi_app(self.registry)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def attach(self, collector: DaemonCollector) -> None:
        """Serve ``collector`` under ``/metrics`` (before: an empty page)."""
        self.registry.register(collector)

    def set_state(self, state: str) -> None:
        if state not in (STARTING, READY, STOPPING):
            raise ValueError(f"unknown state {state!r}")
        self.state = state

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/livez":
            status, body = "200 OK", "ok\n"
        elif path in ("/readyz", "/healthz"):
            state = self.state
            status = "200 OK" if state == READY else "503 Service Unavailable"
            body = {READY: "ok\n", STARTING: "starting: loading the tables\n", STOPPING: "stopping: draining\n"}[state]
        else:
            status, body = "404 Not Found", "not found: /metrics, /livez, /readyz, /healthz\n"
        data = body.encode() if environ.get("REQUEST_METHOD") != "HEAD" else b""
        start_response(status, _TEXT + [("Content-Length", str(len(body)))])
        return [data]

    def start(self) -> str:
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_Server", (_Server,), {"address_family": family})
        self._server = make_server(self.host, self.port, self._app, server_class, _Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="engram-metrics", daemon=True)
        self._thread.start()
        port = self._server.server_address[1]
        self.address = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
        log.info("metrics on http://%s/metrics, probes /livez /readyz", self.address)
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join()
            self._server = None
