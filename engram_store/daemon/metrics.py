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
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from .config import parse_hostport
from .exporter import DaemonCollector

log = logging.getLogger(__name__)

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
