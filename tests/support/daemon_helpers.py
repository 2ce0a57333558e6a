"""Test helpers for the daemon: table sets, a daemon subprocess, raw protocol frames.

The daemon runs as a real process (``python -m engram_store.daemon serve``) on
a temp socket and ``127.0.0.1:0``; ``DaemonProcess.start`` waits for the ready
file it writes (never sleeps and hopes) and ``stop`` always runs in finally.
gRPC needs client authentication: the daemon gets the token file
``DaemonProcess.token_file`` (made in its workdir, kept across restarts there);
pass ``token_file=d.token_file`` to ``EngramClient.connect`` and
``metadata=d.grpc_metadata`` to raw stubs.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic
from engram_store.wire import frames as wire

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0  # generous: a loaded CI box; a healthy start takes about a second


def make_tables(directory: Path, seed: int = 7) -> TableSet:
    """A small synthetic table set (tiny spec: 2 layers, 72-byte rows)."""
    write_synthetic(directory, get_spec("tiny"), seed=seed)
    return TableSet.open(directory)


def make_token_file(path: Path) -> Path:
    """A gRPC token file (mode 0600) at ``path`` unless one is there already."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def daemon_command() -> list[str]:
    return [sys.executable, "-m", "engram_store.daemon"]


@dataclass
class DaemonProcess:
    """One daemon subprocess and the addresses from its ready file."""

    tables: Path
    workdir: Path
    dram_bytes: str = "1GiB"
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    grpc_token: bool = True  # False: no --grpc-token-file (e.g. mTLS only, via extra)
    proc: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)

    @property
    def socket_path(self) -> str:
        return str(self.workdir / "engram.sock")

    @property
    def ready_file(self) -> Path:
        return self.workdir / "ready.json"

    @property
    def unix(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def grpc(self) -> str:
        return f"grpc://{self.ready['grpc']}"

    @property
    def token_file(self) -> str:
        return str(self.workdir / "grpc.token")

    @property
    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that authenticates a raw gRPC stub."""
        return (("authorization", f"Bearer {Path(self.token_file).read_text().strip()}"),)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "DaemonProcess":
        self.ready_file.unlink(missing_ok=True)
        auth = ["--grpc-token-file", str(make_token_file(Path(self.token_file)))] if self.grpc_token else []
        args = daemon_command() + [
            "serve", "--tables", str(self.tables), "--dram-bytes", self.dram_bytes, "--socket", self.socket_path,
            "--grpc", "127.0.0.1:0", *auth, "--metrics", "127.0.0.1:0", "--ready-file", str(self.ready_file),
            "--log-level", "WARNING", *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")} | self.env
        self.log = open(self.workdir / "daemon.log", "ab")
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not ready after {START_TIMEOUT}s: {self.log_text()}")
            time.sleep(0.02)  # polling the ready file, not waiting blindly
        self.ready = json.loads(self.ready_file.read_text())
        return self

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.workdir / "daemon.log").read_text(errors="replace")[-4000:]

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def __enter__(self) -> "DaemonProcess":
        try:
            return self.start()
        except BaseException:
            self.stop()  # a daemon that never got ready is not left running
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def mixed_daemon(tables: Path, workdir: Path, cache_bytes: int = 2 << 20, extra: tuple = ()) -> DaemonProcess:
    """A daemon (not started) holding the table set's first layer resident and its second cached behind a
    cache of ``cache_bytes`` (2 MiB: a few thousand rows at the tests' scales, so steps read NVMe)."""
    from engram_store.format.tableset import TableSet
    from engram_store.storage.resident import resident_layout

    spec = TableSet.open(tables).spec
    first, cached = spec.layers[0], spec.layers[1]
    dram = resident_layout([(first, spec.rows(first))], spec.row_format).size + cache_bytes
    return DaemonProcess(Path(tables), Path(workdir), dram_bytes=str(dram),
                         extra=["--placement", f"{first}=resident,{cached}=cached", *extra])


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``predicate`` (a daemon's counters or Info; never a blind sleep) until it holds; fail after
    ``timeout`` seconds saying ``what`` did not happen."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.01)  # polling, not waiting blindly


@contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc``, killed and waited for on the way out if it still runs (a test that failed before stopping it)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_ready_file(proc: subprocess.Popen, path: Path, why: Callable[[], str] = lambda: "it exited") -> dict:
    """Poll for the ready file ``proc`` writes at ``path`` (never a blind sleep) and return what it says;
    fails if ``proc`` exits first (``why()`` says what it left) or START_TIMEOUT passes."""
    deadline = time.monotonic() + START_TIMEOUT
    while not path.exists():
        assert proc.poll() is None, why()
        assert time.monotonic() < deadline, f"no ready file {path} after {START_TIMEOUT}s"
        time.sleep(0.02)  # polling the file the daemon writes, not waiting blindly
    return json.loads(path.read_text())


def assert_grpc_serving(channel, timeout: float = 30) -> None:
    """The gRPC health service on ``channel`` (no token: probes have none) says SERVING, for the server and
    for the EngramStore service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "engram_store.v1.EngramStore"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def raw_connect(path: str, shm_bytes: int = 1 << 20) -> tuple[socket.socket, wire.Frame, bytes, list[int]]:
    """Handshake by hand: returns the socket, the WELCOME frame, its payload and the fds (caller closes)."""
    from engram_store.native import shm

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    sock.sendall(wire.Frame(wire.Op.HELLO, count=shm_bytes).pack())
    data, fds = shm.recv_with_fds(sock, wire.FRAME.size, 4)
    if len(data) < wire.FRAME.size:
        data += shm.recv_exact(sock, wire.FRAME.size - len(data))
    frame = wire.Frame.unpack(data)
    payload = shm.recv_exact(sock, frame.payload_bytes) if frame.payload_bytes else b""
    return sock, frame, payload, fds


def read_result(sock: socket.socket) -> tuple[wire.Frame, bytes]:
    from engram_store.native import shm

    frame = wire.Frame.unpack(shm.recv_exact(sock, wire.FRAME.size))
    payload = shm.recv_exact(sock, frame.payload_bytes) if frame.payload_bytes else b""
    return frame, payload


def expected(tables: TableSet, layer: int, ids: np.ndarray) -> np.ndarray:
    """The reference bytes, shaped like a client's answer."""
    ids = np.asarray(ids)
    return tables.read_rows(layer, ids.reshape(-1)).reshape(ids.shape + (tables.row_bytes,))


@contextmanager
def stoppable(d: DaemonProcess) -> Iterator[DaemonProcess]:
    """``d`` started, for a test that may stop it (``sigstop``): on the way out it is resumed, then stopped."""
    with d:
        try:
            yield d
        finally:
            if d.proc.poll() is None:
                os.kill(d.pid, signal.SIGCONT)


def sigstop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait (bounded) until every thread of it is stopped: kill() returns
    before the signal takes hold on running threads, and one could still answer a lookup."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    states: list[str] = []
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.001)  # polling the process state, not waiting blindly
    raise AssertionError(f"process {pid} not stopped 10 s after SIGSTOP: thread states {states}")
