"""The metrics port cannot exhaust the daemon: idle connections, slow or oversized requests, floods near the
fd limit and crowds of scrapers each cost a bounded amount, and honest clients (Unix and gRPC lookups,
/readyz probes, a scrape) still get exact answers. Timings are measured by bench/metrics_load.py, never
asserted here."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables

from engram_store.client.client import EngramClient
from engram_store.daemon.http.server import MAX_REQUEST_BYTES, RENDER, BoundedHTTPServer, Reply

ROOT = Path(__file__).resolve().parents[1]
IDLE = 1000
SETTLE = 30.0  # longest wait for the daemon to close what it should (a bound on a hang, polled)


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _open_idle(address: str, n: int) -> list[socket.socket]:
    """``n`` connections that send the start of a request and never finish it."""
    host, port = address.rsplit(":", 1)
    held = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x")
        held.append(s)
    return held


def _poll(predicate, what: str) -> None:
    deadline = time.monotonic() + SETTLE
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)  # polling the daemon's state


def _check_honest(d: DaemonProcess, tables, ids: np.ndarray) -> None:
    with EngramClient.connect(d.unix, connect_timeout=10) as unix, \
            EngramClient.connect(d.grpc, token_file=d.token_file, connect_timeout=10) as grpc:
        for layer in tables.manifest.spec.layers:
            want = expected(tables, layer, ids)
            np.testing.assert_array_equal(unix.lookup(layer, ids), want)
            np.testing.assert_array_equal(grpc.lookup(layer, ids), want)
    assert _get(f"http://{d.ready['metrics']}/readyz", timeout=1) == (200, b"ok\n")
    status, body = _get(f"http://{d.ready['metrics']}/metrics")
    assert status == 200 and b"engram_store_lookups_total" in body


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=44)


def test_a_thousand_idle_connections_cost_no_thread_and_no_memory(tables, tmp_path):
    ids = np.arange(0, tables.rows(1), 11)
    with DaemonProcess(tables.directory, tmp_path) as d:
        _check_honest(d, tables, ids)  # the steady state: every path used once
        threads, fds, rss = len(os.listdir(f"/proc/{d.pid}/task")), d.fd_count(), _status(d.pid, "VmRSS")
        held = _open_idle(d.ready["metrics"], IDLE)
        try:
            assert len(os.listdir(f"/proc/{d.pid}/task")) <= threads  # no thread per connection
            assert d.fd_count() <= fds + 64 + 1  # metrics_max_connections, and one being refused
            _check_honest(d, tables, ids)  # lookups exact, /readyz 200 within a 1 s probe timeout
            peak = _status(d.pid, "VmRSS")
        finally:
            for s in held:
                s.close()
        _poll(lambda: d.fd_count() <= fds, "the daemon still holds HTTP connections")
        _check_honest(d, tables, ids)
        after = _status(d.pid, "VmRSS")
        assert after - rss < 10 << 10, f"RSS {rss} KiB before, {peak} with {IDLE} idle connections, {after} after"
        assert d.proc.poll() is None


def test_a_flood_near_the_fd_limit_never_keeps_a_unix_client_out(tables, tmp_path):
    """The daemon's limit leaves 40 descriptors free, fewer than metrics_max_connections: the flood gets
    503s, a Unix client still connects and reads exact rows."""
    ids = np.arange(0, tables.rows(1), 5)
    with DaemonProcess(tables.directory, tmp_path, extra=["--grpc", ""]) as d:
        soft, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
        used = max(int(fd) for fd in os.listdir(f"/proc/{d.pid}/fd"))
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (used + 40, hard))
        try:
            held = _open_idle(d.ready["metrics"], 200)
            try:
                with EngramClient.connect(d.unix, connect_timeout=10, reconnect_timeout=0) as client:
                    np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))
                status, body = _get(f"http://{d.ready['metrics']}/readyz", timeout=1)
                assert status == 503 and b"file descriptor limit" in body  # told at once, never hung
            finally:
                for s in held:
                    s.close()
        finally:
            resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert _get(f"http://{d.ready['metrics']}/readyz", timeout=1) == (200, b"ok\n")


# --- the server's bounds, one at a time --------------------------------------------------
class Page:
    """A render that counts itself (and can be slow), to see coalescing and freshness."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.count = seconds, 0

    def __call__(self) -> bytes:
        self.count += 1
        time.sleep(self.seconds)
        return f"render {self.count}\n".encode()


def _server(page: Page, **kw) -> BoundedHTTPServer:
    routes = {"/metrics": RENDER, "/readyz": Reply("200 OK", b"ok\n")}
    kw = {"max_connections": 4, "request_timeout": 0.5} | kw
    return BoundedHTTPServer("127.0.0.1", 0, routes.get, page, "text/plain", **kw)


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_slow_oversized_and_odd_requests_get_their_answer_and_are_closed():
    server = _server(Page())
    try:
        t0 = time.monotonic()
        assert _raw(server.port, b"GET /readyz HTTP/1.1\r\nHost:").startswith(b"HTTP/1.1 408 ")  # never finished
        assert time.monotonic() - t0 >= 0.5
        assert _raw(server.port, b"GET /" + b"a" * MAX_REQUEST_BYTES).startswith(b"HTTP/1.1 431 ")
        assert _raw(server.port, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
        assert _raw(server.port, b"hello\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert _raw(server.port, b"GET /nope HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
        head = _raw(server.port, b"HEAD /readyz HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
        assert _raw(server.port, b"GET /readyz?x=1 HTTP/1.1\r\n\r\n").endswith(b"\r\n\r\nok\n")
        _poll(lambda: server.connections == 0, "connections left open")
    finally:
        server.stop()


def test_at_the_limit_the_slowest_sender_gives_way_and_a_crowd_of_complete_requests_gets_503():
    page = Page(seconds=0.3)
    server = _server(page, max_connections=2, request_timeout=5.0)
    try:
        idle = _open_idle(f"127.0.0.1:{server.port}", 2)
        assert _raw(server.port, b"GET /readyz HTTP/1.1\r\n\r\n").endswith(b"ok\n")  # took the oldest's place
        assert idle[0].recv(100).startswith(b"HTTP/1.1 408 ")
        for s in idle:
            s.close()
        answers = []
        waiting = [threading.Thread(target=lambda: answers.append(_raw(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")))
                   for _ in range(2)]
        for t in waiting:
            t.start()
        _poll(lambda: server.connections == 2 and page.count >= 1, "two scrapes in flight")
        assert _raw(server.port, b"GET /readyz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 503 ")
        for t in waiting:
            t.join()
        assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers) and server.refused["busy"] >= 1
    finally:
        server.stop()


def test_a_crowd_of_scrapers_shares_renders_and_each_sees_a_render_started_after_its_request():
    page = Page(seconds=0.02)
    server = _server(page, max_connections=64, render_interval=0.2)
    threads_before = threading.active_count()
    try:
        answers = []
        crowd = [threading.Thread(target=lambda: answers.append(_raw(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")))
                 for _ in range(40)]
        for t in crowd:
            t.start()
        for t in crowd:
            t.join()
        assert len(answers) == 40 and all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
        assert page.count <= 4, f"{page.count} renders for 40 concurrent scrapes"
        seen = []
        for _ in range(3):  # one after another: each answer is a newer render
            seen.append(int(_raw(server.port, b"GET /metrics HTTP/1.1\r\n\r\n").rsplit(b" ", 1)[1]))
        assert seen == sorted(set(seen)) and seen[0] > max(int(a.rsplit(b" ", 1)[1]) for a in answers)
        assert threading.active_count() == threads_before
    finally:
        server.stop()


def test_the_bench_runs(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "metrics_load.py"), "--quick", "--idle", "100",
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "p99 ratio" in res.stdout and (tmp_path / "r.json").exists()
