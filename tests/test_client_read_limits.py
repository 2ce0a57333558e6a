"""Every client read has an overall deadline and a size cap: ``status``/``stats`` against an HTTP endpoint
that drips bytes or sends an endless body exit 2 within ``--timeout`` with bounded memory, and the Unix
handshake against a peer that announces 16 MiB then drips ends at ``connect_timeout``; then honest clients
of a real daemon still get exact answers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables

from engram_store import errors
from engram_store.client.client import EngramClient
from engram_store.client.unix_transport import UnixTransport
from engram_store.wire import frames as wire

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 1.5  # --timeout / connect_timeout of the clients under attack
SLACK = 8.0  # what a loaded host may add to a process's start and exit (a bound on a hang, not a speed claim)
MEASURE = """
import resource, sys, time
from engram_store.cli import main
t0 = time.monotonic()
code = main(sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.monotonic() - t0,
                  "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), file=sys.stderr)
sys.exit(code)
"""


class Hostile:
    """A TCP or Unix server whose every connection is served by ``behave(conn, stop)`` on its own thread."""

    def __init__(self, behave, unix_path: str | None = None) -> None:
        family = socket.AF_UNIX if unix_path else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(unix_path or ("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = unix_path or "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.behave, self.stop = behave, threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self.behave(conn, self.stop)
        except OSError:
            pass
        finally:
            conn.close()

    def __enter__(self) -> "Hostile":
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)
        self.sock.close()


def drip(head: bytes, every: float):
    """Send ``head`` a byte at a time, one every ``every`` seconds, then keep dripping."""
    def behave(conn, stop):
        conn.recv(4096)
        data = head + b"x" * 100_000
        for i in range(len(data)):
            if stop.wait(every):
                return
            conn.sendall(data[i:i + 1])
    return behave


def endless(head: bytes, chunk: bytes = b"engram_store_x 1\n" * 4096):
    def behave(conn, stop):
        conn.recv(4096)
        conn.sendall(head)
        while not stop.is_set():
            conn.sendall(chunk)
    return behave


def run_cli(*args: str) -> tuple[dict, str]:
    """``engram-store ARGS`` in its own process: its exit code, seconds in main and peak RSS, and stderr."""
    proc = subprocess.run([sys.executable, "-c", "import json\n" + MEASURE, *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["code"] == proc.returncode
    return report, proc.stderr


OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"


@pytest.mark.parametrize("command", ["status", "stats"])
@pytest.mark.parametrize("every,head", [
    (2.0, b""),  # a byte every 2 s from the first: the endpoint
    (0.05, b""),  # faster than any per-read timeout: only an overall deadline ends it
    (0.05, OK_HEAD + b"Content-Length: 100000\r\n\r\n"),  # headers at once, then the body drips
], ids=["2s-status-line", "fast-drip", "drip-body"])
def test_a_dripping_endpoint_ends_at_the_deadline(command, every, head):
    with Hostile(drip(head, every)) as server:
        report, err = run_cli(command, f"http://{server.address}", "--timeout", str(DEADLINE))
    assert report["code"] == 2 and "within 1.5s" in err, err
    assert report["seconds"] < DEADLINE + SLACK


@pytest.mark.parametrize("head", [
    OK_HEAD + b"\r\n",  # read until the connection closes, which it never does
    OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n",  # then chunks of any size, for ever
    OK_HEAD + b"Content-Length: 10000000000\r\n\r\n",  # 10 GB announced
], ids=["until-close", "chunked", "huge-length"])
def test_an_endless_body_is_refused_at_the_cap_with_bounded_memory(head):
    chunk = b"10000\r\n" + b"y" * 0x10000 + b"\r\n" if b"chunked" in head else b"engram_store_x 1\n" * 4096
    with Hostile(endless(head, chunk)) as server:
        report, err = run_cli("stats", f"http://{server.address}", "--timeout", "30")
    with Hostile(endless(OK_HEAD + b"Content-Length: 17\r\n\r\n", b"engram_store_x 1\n")) as honest:
        baseline, _ = run_cli("stats", f"http://{honest.address}", "--timeout", "30")
    assert baseline["code"] == 0
    assert report["code"] == 2 and ("larger than" in err or "more than" in err), err
    grown_mib = (report["max_rss_kib"] - baseline["max_rss_kib"]) / 1024
    assert grown_mib < 100, f"the CLI grew {grown_mib:.0f} MiB above an honest run reading an endless body"


def welcome_header(payload_bytes: int) -> bytes:
    """A WELCOME header announcing ``payload_bytes`` (Frame.pack would count the payload given)."""
    return wire.FRAME.pack(wire.MAGIC, wire.VERSION, wire.Op.WELCOME, wire.Status.OK, 0, 0, 0, 0, 1 << 20, 0, 0,
                           payload_bytes, 0)


@pytest.mark.parametrize("slow_header", [False, True], ids=["header-at-once", "header-drips"])
def test_the_unix_handshake_ends_at_connect_timeout(tmp_path, slow_header):
    """A peer announcing a 16 MiB WELCOME payload, then sending it a byte at a time."""
    head = welcome_header(wire.MAX_DAEMON_PAYLOAD)

    def behave(conn, stop):
        conn.recv(wire.FRAME.size)
        if not slow_header:
            conn.sendall(head)
        data = (head if slow_header else b"") + b"{" * 1000
        for i in range(len(data)):
            if stop.wait(0.05):
                return
            conn.sendall(data[i:i + 1])

    path = str(tmp_path / "hostile.sock")
    with Hostile(behave, unix_path=path):
        for connect in (lambda: UnixTransport(path, 0, connect_timeout=DEADLINE),
                        lambda: EngramClient.connect(f"unix://{path}", connect_timeout=DEADLINE, reconnect_timeout=0)):
            t0 = time.monotonic()
            with pytest.raises(errors.Unavailable, match=r"did not complete the handshake within 1\.5s"):
                connect()
            assert time.monotonic() - t0 < DEADLINE + SLACK


def test_honest_clients_of_a_real_daemon_still_get_exact_answers(tmp_path):
    tables = make_tables(tmp_path / "tables", seed=30)
    ids = np.arange(0, tables.rows(1), 3)
    honest = "30"  # the same bounds with room for a loaded host: an honest daemon answers in milliseconds
    with DaemonProcess(tables.directory, tmp_path) as d:
        with EngramClient.connect(d.unix, connect_timeout=float(honest)) as client:
            np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))
        for args in (("status", f"http://{d.ready['metrics']}"), ("stats", f"http://{d.ready['metrics']}", "--json"),
                     ("stats", d.unix)):
            report, err = run_cli(*args, "--timeout", honest)
            assert report["code"] == 0, err
            assert report["seconds"] < float(honest)
