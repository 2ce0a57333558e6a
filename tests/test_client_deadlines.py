"""Client deadlines: ``EngramClient.connect(timeout=...)`` bounds each call on a stopped
daemon, and a submitted lookup's ``wait()`` stops asking again after ``reconnect_timeout``
when the daemon is gone for good or crash-loops (each reconnect works, each lookup is lost),
with an Unavailable that says how long it tried."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables, sigstop

from engram_store import errors
from engram_store.client.client import EngramClient
from engram_store.native import shm
from engram_store.wire import frames as wire

RECONNECT = 1.0  # reconnect_timeout of the tests' clients
SLACK = 8.0  # above the deadline a loaded host may add (never a speed claim: a bound on a hang)
MAX_LOST = 300  # the proxy's crash loop ends (its socket closes) after this many lost lookups


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=51)


def test_timeout_is_each_calls_deadline_over_unix(tables, tmp_path):
    ids = np.arange(0, tables.rows(1), 7)
    with DaemonProcess(tables.directory, tmp_path, extra=["--grpc", ""]) as d, \
            EngramClient.connect(d.unix, timeout=0.5, reconnect_timeout=0) as client:
        np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))
        sigstop(d.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded, match=r"within 0\.5s \(timeout\)"):
                client.lookup(1, ids)
            assert time.monotonic() - t0 < 0.5 + SLACK
        finally:
            os.kill(d.pid, signal.SIGCONT)
        np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))  # reconnected


def test_wait_gives_up_on_a_daemon_that_is_gone(tables, tmp_path):
    ids = np.arange(0, tables.rows(1), 5)
    d = DaemonProcess(tables.directory, tmp_path, extra=["--grpc", ""]).start()
    try:
        with EngramClient.connect(d.unix, connect_timeout=0.2, reconnect_timeout=RECONNECT) as client:
            sigstop(d.pid)  # the lookup stays unanswered until the daemon dies
            handle = client.submit(1, ids)
            d.kill()
            t0 = time.monotonic()
            with pytest.raises(errors.Unavailable, match=rf"within {RECONNECT:g}s \(reconnect_timeout\)"):
                handle.wait()
            assert time.monotonic() - t0 < RECONNECT + SLACK
    finally:
        d.stop()


class _LosesEveryLookup:
    """A proxy in front of a real daemon that passes the handshake (fds included) and then
    drops the connection at the client's first LOOKUP: to the client, a daemon that dies on
    every request and is back at once (a crash loop)."""

    def __init__(self, daemon_socket: str, path: str) -> None:
        self.daemon_socket, self.path = daemon_socket, path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.listener.settimeout(0.2)
        self.lost = 0  # lookups dropped
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping and self.lost < MAX_LOST:
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
                client.settimeout(10)
                upstream.settimeout(10)
                try:
                    upstream.connect(self.daemon_socket)
                    upstream.sendall(shm.recv_exact(client, wire.FRAME.size))  # HELLO
                    data, fds = shm.recv_with_fds(upstream, wire.FRAME.size, 4)
                    data += shm.recv_exact(upstream, wire.FRAME.size - len(data)) if len(data) < wire.FRAME.size else b""
                    welcome = wire.Frame.unpack(data)
                    payload = shm.recv_exact(upstream, welcome.payload_bytes) if welcome.payload_bytes else b""
                    shm.send_with_fds(client, data + payload, fds)
                    for fd in fds:
                        os.close(fd)
                    while wire.Frame.unpack(shm.recv_exact(client, wire.FRAME.size)).op != wire.Op.LOOKUP:
                        pass  # (the client sends nothing else first)
                    self.lost += 1
                except (OSError, ConnectionError):
                    pass
        self.listener.close()  # bounded even for a client that never gives up

    def close(self) -> None:
        self.stopping = True
        self.thread.join(10)


def test_wait_gives_up_while_the_daemon_crash_loops(tables, tmp_path):
    ids = np.arange(0, tables.rows(1), 3)
    with DaemonProcess(tables.directory, tmp_path, extra=["--grpc", ""]) as d:
        proxy = _LosesEveryLookup(d.socket_path, str(tmp_path / "flaky.sock"))
        try:
            with EngramClient.connect(f"unix://{proxy.path}", reconnect_timeout=RECONNECT) as client:
                handle = client.submit(1, ids)
                t0 = time.monotonic()
                with pytest.raises(errors.Unavailable, match=rf"retried for {RECONNECT:g}s \(reconnect_timeout\)"):
                    handle.wait()
                assert time.monotonic() - t0 < RECONNECT + SLACK
                assert proxy.lost >= 2  # it did reconnect and ask again before giving up
        finally:
            proxy.close()
        with EngramClient.connect(d.unix) as client:  # the daemon itself serves all along
            np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_a_bad_timeout_is_refused(tmp_path, bad):
    with pytest.raises(errors.ConfigError, match="timeout must be a positive number"):
        EngramClient(f"unix://{tmp_path / 'none.sock'}", timeout=bad)
