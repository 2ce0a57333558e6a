"""Bounds and fairness: each test plays a greedy or slow client against a real daemon, then
checks that an honest client is still served (in time, with the right bytes).

Limits are set low by each test so that the attacks stay small and quick."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, expected, make_tables, raw_connect, sigstop

from engram_store import errors
from engram_store.client.client import EngramClient
from engram_store.client.unix_transport import UnixTransport
from engram_store.daemon import limits
from engram_store.wire._proto import engram_store_pb2 as pb
from engram_store.wire._proto import engram_store_pb2_grpc as pb_grpc
from engram_store.wire.frames import DType, Frame, Op, Status

SHM = 1 << 20
NOBODY = 65534


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=33)


def _flood(path: str, frames: int = 3000) -> socket.socket:
    """A client that pipelines ``frames`` one-row lookups and reads none of the replies."""
    sock, welcome, _, fds = raw_connect(path, SHM)
    for fd in fds:
        os.close(fd)
    assert welcome.status == Status.OK
    data = b"".join(Frame(Op.LOOKUP, rid, dtype=DType.INT64, layer=1, count=1, ids_offset=0, out_offset=64).pack()
                    for rid in range(1, frames + 1))
    sock.setblocking(False)
    sent, deadline = 0, time.monotonic() + 5
    while sent < len(data) and time.monotonic() < deadline:
        try:
            sent += sock.send(data[sent:])
        except BlockingIOError:
            time.sleep(0.01)  # the daemon stopped reading us: that is the point
    return sock


def _auth(d: DaemonProcess):
    """Call metadata that authenticates raw stubs, where the daemon asks for a token."""
    return getattr(d, "grpc_metadata", None)


def _grpc_lookup_seconds(stub, ids: np.ndarray, want: np.ndarray, md) -> float:
    t0 = time.perf_counter()
    reply = stub.Lookup(pb.LookupRequest(layer=1, row_ids=ids.astype("<i8").tobytes()), timeout=30, metadata=md)
    took = time.perf_counter() - t0
    assert reply.rows == want.tobytes()
    return took


def _unix_lookup_seconds(client: EngramClient, ids: np.ndarray, want: np.ndarray) -> float:
    t0 = time.perf_counter()
    got = client.lookup(1, ids)
    took = time.perf_counter() - t0
    np.testing.assert_array_equal(got, want)
    return took


@pytest.mark.parametrize("mode", ["cached", "resident-python"])
def test_clients_that_pipeline_and_never_read_do_not_delay_others(tables, tmp_path, mode):
    """4 clients fill their sockets with unread replies; lookups of others stay within 10x
    their latency measured before the attack (old code: workers stuck 10 s in send())."""
    extra = ["--workers", "2"] + (["--no-unix-native"] if mode == "resident-python" else [])
    with DaemonProcess(tables.directory, tmp_path, dram_bytes="256KiB" if mode == "cached" else "1GiB",
                       extra=extra) as d:
        ids = np.random.default_rng(1).integers(0, tables.rows(1), 512)
        want = expected(tables, 1, ids)
        with grpc.insecure_channel(d.ready["grpc"]) as channel, EngramClient.connect(d.unix, reconnect_timeout=0) as c:
            stub = pb_grpc.EngramStoreStub(channel)
            base_grpc = np.median([_grpc_lookup_seconds(stub, ids, want, _auth(d)) for _ in range(7)])
            base_unix = np.median([_unix_lookup_seconds(c, ids, want) for _ in range(7)])
            floods = [_flood(d.socket_path) for _ in range(4)]
            try:
                under_grpc = np.median([_grpc_lookup_seconds(stub, ids, want, _auth(d)) for _ in range(5)])
                under_unix = np.median([_unix_lookup_seconds(c, ids, want) for _ in range(5)])
                with EngramClient.connect(d.unix, reconnect_timeout=0) as fresh:  # a new client too
                    _unix_lookup_seconds(fresh, ids, want)
            finally:
                for s in floods:
                    s.close()
        floor = 0.1  # a shared test host: 10x a sub-millisecond latency is within its noise
        assert under_grpc < max(10 * base_grpc, floor), (base_grpc, under_grpc)
        assert under_unix < max(10 * base_unix, floor), (base_unix, under_unix)
        assert d.proc.poll() is None


def _as_nobody(path: str, ids: np.ndarray, want: np.ndarray) -> int:
    """Fork a child that becomes uid ``NOBODY`` and looks ``ids`` up; its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            t = UnixTransport(path, SHM, connect_timeout=5, timeout=10)
            try:
                out = np.empty(want.shape, np.uint8)
                t.lookup_into(1, ids, out)
                code = 0 if np.array_equal(out, want) else 3
            finally:
                t.close()
        except errors.ResourceExhausted:
            code = 4
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_idle_connections_of_one_uid_do_not_lock_out_another_uid(tables):
    workdir = tempfile.mkdtemp(prefix="engram-uid-")
    os.chmod(workdir, 0o755)  # the other uid must reach the socket
    d = DaemonProcess(tables.directory, __import__("pathlib").Path(workdir),
                      extra=["--max-clients", "24", "--max-clients-per-uid", "16", "--socket-mode", "0666"])
    held = []
    try:
        d.start()
        ids = np.arange(0, tables.rows(1), 97)
        want = expected(tables, 1, ids)
        refused = 0
        for _ in range(30):  # idle connections of this uid, more than max_clients
            try:
                t = UnixTransport(d.socket_path, 1 << 16)
            except errors.ResourceExhausted as exc:
                assert "max_clients_per_uid" in str(exc)
                refused += 1
            else:
                held.append(t)
        assert (len(held), refused) == (16, 14)
        assert _as_nobody(d.socket_path, ids, want) == 0, "4 = refused (locked out), 2 = failed, 3 = wrong bytes"
        with grpc.insecure_channel(d.ready["grpc"]) as channel:  # this uid is full: ask over gRPC
            values = pb_grpc.EngramStoreStub(channel).Stats(pb.StatsRequest(), timeout=30, metadata=_auth(d)).values
        assert values["unix_dropped_clients_refused"] == 14 and values["unix_connected_clients"] == 16
    finally:
        for s in held:
            s.close()
        d.stop()


def test_hello_a_byte_at_a_time_is_dropped_at_the_handshake_deadline(tables, tmp_path):
    with DaemonProcess(tables.directory, tmp_path, extra=["--handshake-timeout-seconds", "1"]) as d:
        hello = Frame(Op.HELLO, count=SHM).pack()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(d.socket_path)
        t0 = time.monotonic()
        closed_after = None
        try:
            for i in range(len(hello) - 1):  # never complete: 0.1 s a byte would take 6.3 s
                try:
                    sock.send(hello[i: i + 1])
                except (BrokenPipeError, ConnectionResetError):
                    closed_after = time.monotonic() - t0
                    break
                sock.settimeout(0.1)  # paces the attack and notices the close
                try:
                    if sock.recv(1) == b"":
                        closed_after = time.monotonic() - t0
                        break
                except TimeoutError:
                    pass
                if time.monotonic() - t0 > 4:
                    break
        finally:
            sock.close()
        assert closed_after is not None and 0.9 <= closed_after < 2.5, closed_after
        with EngramClient.connect(d.unix, reconnect_timeout=0) as c:  # an honest HELLO is served
            ids = np.arange(5)
            np.testing.assert_array_equal(c.lookup(1, ids), expected(tables, 1, ids))
            assert c.stats()["unix_dropped_clients_handshake_timeout"] == 1


def test_all_client_regions_share_one_budget(tables, tmp_path):
    with DaemonProcess(tables.directory, tmp_path, extra=["--max-total-client-shm-bytes", "3MiB",
                                                          "--client-shm-bytes", "1MiB"]) as d:
        clients = [UnixTransport(d.socket_path, SHM) for _ in range(3)]
        try:
            with pytest.raises(errors.ResourceExhausted, match="max_total_client_shm_bytes"):
                UnixTransport(d.socket_path, SHM)
            clients.pop().close()  # its region goes back to the budget
            deadline = time.monotonic() + 10
            while True:
                try:
                    clients.append(UnixTransport(d.socket_path, SHM))
                    break
                except errors.ResourceExhausted:  # the daemon may not have seen the close yet
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
            ids = np.arange(7)
            out = np.empty((7, tables.row_bytes), np.uint8)
            np.testing.assert_array_equal(clients[-1].lookup_into(1, ids, out), expected(tables, 1, ids))
        finally:
            for c in clients:
                c.close()


def test_grpc_reply_bytes_are_capped_and_a_stalled_stream_is_cancelled(tables, tmp_path):
    chunk = 64 << 10
    with DaemonProcess(tables.directory, tmp_path, extra=[
            "--grpc-chunk-bytes", str(chunk), "--grpc-max-inflight-bytes", str(3 * chunk),
            "--client-send-timeout-seconds", "1"]) as d:
        small = np.arange(10)
        request = pb.LookupRequest(layer=1, row_ids=small.astype("<i8").tobytes())
        with grpc.insecure_channel(d.ready["grpc"]) as channel:
            stub = pb_grpc.EngramStoreStub(channel)
            assert stub.Lookup(request, timeout=30, metadata=_auth(d)).rows == expected(tables, 1, small).tobytes()
            big = np.arange(400_000) % tables.rows(1)  # ~29 MB of rows: far more than any window
            stalled = stub.LookupStream(pb.LookupRequest(layer=1, row_ids=big.astype("<i8").tobytes()), timeout=30,
                                       metadata=_auth(d))
            next(stalled)  # started (it holds its 3 chunks), then never read again
            with pytest.raises(grpc.RpcError) as info:
                stub.Lookup(request, timeout=30, metadata=_auth(d))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "grpc_max_inflight_bytes" in info.value.details()
            deadline = time.monotonic() + 15  # the stall timeout (1 s) cancels it, freeing its bytes
            while True:
                try:
                    assert stub.Lookup(request, timeout=30, metadata=_auth(d)).rows == expected(tables, 1, small).tobytes()
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.1)
            stalled.cancel()


def test_a_stopped_daemon_gives_a_deadline_error(tables, tmp_path):
    with DaemonProcess(tables.directory, tmp_path) as d:
        t = UnixTransport(d.socket_path, SHM, timeout=1.0)
        ids = np.arange(20)
        out = np.empty((20, tables.row_bytes), np.uint8)
        try:
            t.lookup_into(1, ids, out)
            sigstop(d.pid)
            try:
                t0 = time.monotonic()
                with pytest.raises(errors.DeadlineExceeded, match="did not answer within 1s"):
                    t.lookup_into(1, ids, out)
                assert 0.9 <= time.monotonic() - t0 < 2.0
                assert t.broken
            finally:
                os.kill(d.pid, signal.SIGCONT)
        finally:
            t.close()
        with EngramClient.connect(d.unix, reconnect_timeout=0) as c:
            np.testing.assert_array_equal(c.lookup(1, ids), expected(tables, 1, ids))


def _stalled_service_manager(path: Path) -> tuple[socket.socket, socket.socket]:
    """A NOTIFY_SOCKET whose reader never reads: (its socket, a sender that fills its queue later)."""
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(path))
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.connect(str(path))
    filler.setblocking(False)
    return manager, filler


def test_sigterm_with_slow_clients_exits_within_drain_seconds(tables, tmp_path):
    """SIGTERM with 12 clients that pipeline lookups and read no reply, and a service manager that
    stopped reading its notifications (STOPPING=1 cannot be delivered): the process is gone within
    drain_seconds of the signal by construction (every step of the stop bounded, a watchdog at the
    deadline). The bound allows one second beyond drain_seconds for the signal to be handled and
    the process reaped on a loaded machine; the old stop, unbounded, blocked on the notification."""
    manager, filler = _stalled_service_manager(tmp_path / "notify.sock")
    d = DaemonProcess(tables.directory, tmp_path, dram_bytes="256KiB", env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")},
                      extra=["--drain-seconds", "2", "--workers", "2", "--log-level", "INFO"])
    floods = []
    try:
        d.start()
        assert d.ready["mode"] == "cached"
        with pytest.raises(BlockingIOError):
            while True:  # the manager's queue full: the next notification blocks its sender
                filler.send(b"X")
        floods = [_flood(d.socket_path, frames=2000) for _ in range(12)]
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        try:
            code = d.proc.wait(2 + 5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running 7 s after SIGTERM with drain_seconds 2: {d.log_text()}") from None
        took = time.monotonic() - t0
        assert code == 0 and took < 2 + 1, (code, took, d.log_text())
        assert "draining in-flight requests" in d.log_text()
    finally:
        for s in floods:
            s.close()
        d.stop()
        manager.close()
        filler.close()


def test_the_stop_watchdog_ends_a_process_whatever_holds_it(tmp_path):
    """The last guard of the stop: armed at the signal, it ends the process at the deadline (less
    its margin) even when the thread that stops is stuck for good, and says what it cut short."""
    script = tmp_path / "stuck.py"
    script.write_text("import logging, threading, time\n"
                      "from engram_store.daemon.stopping import StopClock\n"
                      "logging.basicConfig(level=logging.INFO)\n"
                      "clock = StopClock(1.0)\n"
                      "clock.start()\n"
                      "clock.step = 'a step that never returns'\n"
                      "threading.Event().wait(60)\n")
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30, cwd=REPO)
    took = time.monotonic() - t0
    assert result.returncode == 0 and took < 1.0 + 1, (took, result.stderr)
    assert "drain_seconds (1s) ran out during a step that never returns" in result.stderr, result.stderr


def test_round_robin_serves_lanes_in_turn():
    """A lane with many pieces queued first does not keep a later lane's piece waiting."""
    order: list[str] = []
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        turns = limits.RoundRobin(pool, per_lane=1)
        greedy, honest = limits.Lane(), limits.Lane()
        turns.submit(greedy, [gate.wait] + [lambda i=i: order.append(f"g{i}") for i in range(5)])
        turns.submit(honest, [lambda: order.append("h")])
        gate.set()
        deadline = time.monotonic() + 10
        while len(order) < 6 and time.monotonic() < deadline:  # before shutdown: it would run the rest in line
            time.sleep(0.001)
    assert order.index("h") <= 1, order
    assert sorted(order) == ["g0", "g1", "g2", "g3", "g4", "h"]
