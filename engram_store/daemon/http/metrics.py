"""The operations HTTP endpoint: Prometheus metrics and the health probes.

The exporter (:mod:`.exporter`, ``DaemonCollector``) reads the plain stats objects at
scrape time and owns nothing else: it is kept apart from ``stats.py`` and the store's
``stats()`` so neither knows about Prometheus, and a private registry keeps the
process-global one untouched. The same listener answers the probes (no credentials, no rows):

* ``/livez``: 200 while the process serves HTTP at all (during the DRAM fill too);
* ``/readyz``: 200 once the tables are loaded and every listener is open, 503
  before that and while draining after SIGTERM (the body says which);
* ``/healthz``: the same as ``/readyz``;
* ``/metrics``: the Prometheus text format;

and 404 for any other path.

The server (:mod:`.server`) is bounded against clients that hold it: two threads
whatever they do, ``metrics_max_connections`` connections, ``metrics_request_timeout_seconds``
per request, one metrics render at a time and at most one every
:data:`~.server.RENDER_INTERVAL` seconds however many scrape, and the last
descriptors below the fd limit kept for Unix-socket clients.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..config import parse_hostport
from .exporter import DaemonCollector
from .server import RENDER, BoundedHTTPServer, Reply

log = logging.getLogger(__name__)

STARTING, READY, STOPPING = "starting", "ready", "stopping"
MAX_CONNECTIONS = 64  # DaemonConfig.metrics_max_connections's default
REQUEST_TIMEOUT_SECONDS = 5.0  # DaemonConfig.metrics_request_timeout_seconds's default


class MetricsServer:
    """The HTTP endpoint on ``address`` (port 0 picks a free one): ``/metrics``, ``/livez``,
    ``/readyz``, ``/healthz``; 404 elsewhere.

    Started before the tables are opened, so that ``/livez`` answers during a fill of
    minutes; the daemon attaches the collector (:meth:`attach`) once the store is open and moves
    :attr:`state` from ``starting`` to ``ready`` (then ``stopping`` on SIGTERM).
    """

    def __init__(self, address: str, collector: DaemonCollector | None = None, *,
                 max_connections: int = MAX_CONNECTIONS, request_timeout: float = REQUEST_TIMEOUT_SECONDS) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        if collector is not None:
            self.registry.register(collector)
        self.host, self.port = parse_hostport(address, "metrics")
        self.max_connections, self.request_timeout = max_connections, request_timeout
        self.state = STARTING
        self._server: BoundedHTTPServer | None = None
        self.address = ""

    def attach(self, collector: DaemonCollector) -> None:
        """Serve ``collector`` under ``/metrics`` (before: an empty page)."""
        self.registry.register(collector)

    def set_state(self, state: str) -> None:
        if state not in (STARTING, READY, STOPPING):
            raise ValueError(f"unknown state {state!r}")
        self.state = state

    def _route(self, path: str) -> object:
        if path == "/metrics":
            return RENDER
        if path == "/livez":
            return Reply("200 OK", b"ok\n")
        if path in ("/readyz", "/healthz"):
            state = self.state
            body = {READY: "ok\n", STARTING: "starting: loading the tables\n", STOPPING: "stopping: draining\n"}[state]
            return Reply("200 OK" if state == READY else "503 Service Unavailable", body.encode())
        return Reply("404 Not Found", b"not found: /metrics, /livez, /readyz, /healthz\n")

    def _render(self) -> bytes:
        return generate_latest(self.registry)

    def start(self) -> str:
        self._server = BoundedHTTPServer(self.host, self.port, self._route, self._render, CONTENT_TYPE_LATEST,
                                         max_connections=self.max_connections, request_timeout=self.request_timeout)
        port = self._server.port
        self.address = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
        log.info("metrics on http://%s/metrics, probes /livez /readyz (at most %d connections, %gs per request)",
                 self.address, self.max_connections, self.request_timeout)
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
