"""Hardening: malformed frames, garbage bytes, killed clients, fuzzing, connect churn; no fd leaks."""

from __future__ import annotations

import dataclasses
import mmap
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables, raw_connect, read_result

from engram_store.client.client import EngramClient
from engram_store.wire import frames as wire
from engram_store.wire.frames import DType, Frame, Op, Status

SHM = 1 << 20


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=3)


@pytest.fixture(scope="module")
def daemon(tables, tmp_path_factory):
    with DaemonProcess(tables.directory, tmp_path_factory.mktemp("daemon"),
                       extra=["--max-request-rows", "50000", "--client-shm-bytes", "4MiB",
                              "--max-client-shm-bytes", "8MiB"]) as d:
        yield d


def _settled_fd_count(daemon: DaemonProcess, want: int) -> int:
    """The daemon's fd count once closing connections have been reaped (bounded poll, not a timing check)."""
    deadline = time.monotonic() + 30
    while (n := daemon.fd_count()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def _check_serving(daemon: DaemonProcess, tables) -> None:
    ids = np.arange(0, tables.rows(1), 97)
    for address in (daemon.unix, daemon.grpc):
        with EngramClient.connect(address, reconnect_timeout=0, token_file=daemon.token_file) as client:
            np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))


def _client_regions(daemon: DaemonProcess) -> int:
    fd_dir = f"/proc/{daemon.pid}/fd"
    count = 0
    for name in os.listdir(fd_dir):
        try:
            count += "engram-store-client" in os.readlink(f"{fd_dir}/{name}")
        except FileNotFoundError:
            pass
    return count


@pytest.fixture()
def baseline(daemon, tables):
    """The daemon's fd count with no client connected (after a warm-up opened everything lazy)."""
    _check_serving(daemon, tables)
    deadline = time.monotonic() + 30
    readings = [-1]
    while time.monotonic() < deadline:  # no client region left and the count steady over 3 reads
        readings.append(daemon.fd_count() if _client_regions(daemon) == 0 else -1)
        if len(set(readings[-3:])) == 1 and readings[-1] >= 0 and len(readings) > 3:
            return readings[-1]
        time.sleep(0.05)
    raise AssertionError(f"daemon fd count never settled: {readings[-5:]}")


def _lookup(layer=1, count=4, ids_offset=0, out_offset=4096, dtype=DType.INT64, rid=1) -> Frame:
    return Frame(Op.LOOKUP, rid, dtype=dtype, layer=layer, count=count, ids_offset=ids_offset, out_offset=out_offset)


def test_bad_requests_get_clear_errors_on_a_live_connection(daemon, tables, baseline):
    sock, welcome, _, fds = raw_connect(daemon.socket_path, SHM)
    try:
        assert welcome.op == Op.WELCOME and welcome.status == Status.OK and welcome.count == SHM
        mm = mmap.mmap(fds[0], SHM)
        region = np.frombuffer(mm, np.uint8)
        region[:32].view("<i8")[:] = [0, 1, 2, tables.rows(1)]
        cases = [
            (_lookup(layer=2), Status.NOT_FOUND, "layer 2"),
            (_lookup(), Status.OUT_OF_RANGE, ""),
            (_lookup(dtype=DType.NONE), Status.INVALID_ARGUMENT, "dtype"),
            (_lookup(dtype=9), Status.INVALID_ARGUMENT, "dtype"),
            (_lookup(count=60000), Status.RESOURCE_EXHAUSTED, "max_request_rows"),
            (_lookup(ids_offset=SHM - 8), Status.INVALID_ARGUMENT, "outside"),
            (_lookup(out_offset=SHM - 10), Status.INVALID_ARGUMENT, "outside"),
            (_lookup(out_offset=2**63), Status.INVALID_ARGUMENT, "outside"),
            (_lookup(ids_offset=3), Status.INVALID_ARGUMENT, "multiples of 8"),
            (_lookup(out_offset=16), Status.INVALID_ARGUMENT, "overlap"),
            (Frame(99, 1), Status.INVALID_ARGUMENT, "unknown op"),
        ]
        for i, (frame, status, words) in enumerate(cases):
            sock.sendall(dataclasses.replace(frame, request_id=100 + i).pack())
            reply, message = read_result(sock)
            assert (reply.request_id, reply.status) == (100 + i, status), (frame, message)
            assert words.encode() in message
        region[:32].view("<i8")[3] = 5  # now valid: the same connection still serves
        sock.sendall(_lookup(rid=7).pack())
        reply, _ = read_result(sock)
        assert reply.status == Status.OK and reply.count == 4
        np.testing.assert_array_equal(region[4096: 4096 + 4 * tables.row_bytes].reshape(4, -1),
                                      expected(tables, 1, np.array([0, 1, 2, 5])))
        del region
        mm.close()
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)
    assert _settled_fd_count(daemon, baseline) == baseline


def _garbage_connections(path: str, rng: np.random.Generator, n: int) -> None:
    """Each connection gets one kind of garbage; the daemon must close it."""
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        kind = i % 5
        if kind == 0:  # random bytes instead of a HELLO
            s.sendall(rng.integers(0, 256, size=int(rng.integers(1, 400)), dtype=np.uint8).tobytes())
        elif kind == 1:  # a truncated HELLO, then hang up
            s.sendall(Frame(Op.HELLO).pack()[: int(rng.integers(1, wire.FRAME.size))])
        elif kind == 2:  # a HELLO of another protocol version
            s.sendall(Frame(Op.HELLO, version=wire.VERSION + 1).pack())
        elif kind == 3:  # a huge payload length
            s.sendall(Frame(Op.HELLO, payload_bytes=0).pack()[:-8] + (2**31).to_bytes(4, "little") + b"\0" * 4)
        else:  # a good HELLO then garbage, or a truncated frame, mid-connection
            s.sendall(Frame(Op.HELLO, count=1 << 16).pack())
            _, fds, _, _ = socket.recv_fds(s, 4096, 4)
            for fd in fds:
                os.close(fd)
            s.sendall(rng.integers(0, 256, size=int(rng.integers(1, 200)), dtype=np.uint8).tobytes())
        if kind in (0, 2, 3, 4):
            s.shutdown(socket.SHUT_WR)
            _read_until_closed(s)  # the daemon closes on us
        s.close()


def _read_until_closed(s: socket.socket) -> None:
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:  # closed with our garbage unread: a close all the same
        pass


def _pick(rng: np.random.Generator, values: list[int]) -> int:
    return values[int(rng.integers(0, len(values)))]


def _fuzz_lookups(path: str, rng: np.random.Generator, n: int) -> int:
    """n well-framed LOOKUPs with random fields on one connection: every one is answered."""
    sock, _, _, fds = raw_connect(path, SHM)
    answered = 0
    try:
        for fd in fds:
            os.close(fd)
        for start in range(0, n, 50):
            batch = [Frame(Op.LOOKUP, start + j, dtype=int(rng.integers(0, 4)), layer=_pick(rng, [-1, 1, 2, 3, 2**31 - 1]),
                           count=_pick(rng, [0, 1, 100, 2**20, 2**63]), ids_offset=int(rng.integers(0, 2 * SHM)) & ~7,
                           out_offset=_pick(rng, [0, 8, SHM // 2, 2**64 - 8]))
                     for j in range(min(50, n - start))]
            sock.sendall(b"".join(f.pack() for f in batch))
            for _ in batch:
                read_result(sock)
                answered += 1
    finally:
        sock.close()
    return answered


def _fuzz_grpc(target: str, rng: np.random.Generator, n: int, metadata) -> None:
    from engram_store.wire._proto import engram_store_pb2 as pb

    with grpc.insecure_channel(target) as channel:
        raw = channel.unary_unary("/engram_store.v1.EngramStore/Lookup")  # bytes in, bytes out
        good = channel.unary_unary("/engram_store.v1.EngramStore/Lookup", request_serializer=pb.LookupRequest.SerializeToString,
                                   response_deserializer=pb.LookupReply.FromString)
        for i in range(n):
            try:
                if i % 2:
                    raw(rng.integers(0, 256, size=int(rng.integers(0, 64)), dtype=np.uint8).tobytes(), timeout=30,
                        metadata=metadata)
                else:
                    ids = rng.integers(-5, 20000, size=int(rng.integers(0, 9))).astype("<i8").tobytes()
                    ids = ids[: int(rng.integers(0, 80))]  # often not a whole number of ids
                    request = pb.LookupRequest(layer=_pick(rng, [1, 2, 3]), row_ids=ids, dtype=int(rng.integers(0, 3)))
                    good(request, timeout=30, metadata=metadata)
            except grpc.RpcError as exc:
                assert exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED), exc
    host, port = target.rsplit(":", 1)
    for _ in range(20):  # not HTTP/2 at all
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(rng.integers(0, 256, size=300, dtype=np.uint8).tobytes())
            s.shutdown(socket.SHUT_WR)
            _read_until_closed(s)


def test_fuzz_then_correct_lookups_and_no_fd_leak(daemon, tables, baseline):
    rng = np.random.default_rng(1234)
    _garbage_connections(daemon.socket_path, rng, 300)
    assert _fuzz_lookups(daemon.socket_path, rng, 3000) == 3000
    _fuzz_grpc(daemon.ready["grpc"], rng, 1000, daemon.grpc_metadata)
    _check_serving(daemon, tables)
    assert daemon.proc.poll() is None
    assert _settled_fd_count(daemon, baseline) == baseline


def test_connect_disconnect_cycles_leak_nothing(daemon, tables, baseline):
    rss_before = _rss(daemon.pid)
    for i in range(1000):
        with EngramClient.connect(daemon.unix, shm_bytes=1 << 20, reconnect_timeout=0) as client:
            if i % 100 == 0:
                client.lookup(3, np.arange(10))
    assert _settled_fd_count(daemon, baseline) == baseline
    stats = EngramClient.connect(daemon.grpc, token_file=daemon.token_file).stats()
    assert stats["unix_connected_clients"] == 0
    assert _rss(daemon.pid) - rss_before < 64 << 20  # 1000 x 1 MiB regions would be 1 GB


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


KILLED_CLIENT = """
import sys, numpy as np
from engram_store.client.client import EngramClient
c = EngramClient.connect(sys.argv[1], shm_bytes=8 << 20)
handles = [c.submit(1, np.random.default_rng(i).integers(0, int(sys.argv[2]), 20000)) for i in range(5)]
print("submitted", flush=True)
sys.stdin.read()
"""


def test_client_killed_mid_request(daemon, tables, baseline):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, daemon.unix, str(tables.rows(1))],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"submitted"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _check_serving(daemon, tables)
    assert _settled_fd_count(daemon, baseline) == baseline


def test_grpc_status_codes_mean_something(daemon, tables):
    from engram_store.wire._proto import engram_store_pb2 as pb
    from engram_store.wire._proto import engram_store_pb2_grpc as pb_grpc

    def ids(*values, dtype="<i8"):
        return np.array(values, dtype=dtype).tobytes()

    cases = [
        (pb.LookupRequest(layer=2, row_ids=ids(0)), grpc.StatusCode.NOT_FOUND, "layer 2"),
        (pb.LookupRequest(layer=1, row_ids=ids(tables.rows(1))), grpc.StatusCode.OUT_OF_RANGE, "outside"),
        (pb.LookupRequest(layer=1, row_ids=ids(-1)), grpc.StatusCode.OUT_OF_RANGE, "outside"),
        (pb.LookupRequest(layer=1, row_ids=b"\0" * 12), grpc.StatusCode.INVALID_ARGUMENT, "multiple of 8"),
        (pb.LookupRequest(layer=1, row_ids=ids(0), dtype=7), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
        (pb.LookupRequest(layer=1, row_ids=np.zeros(50001, "<i8").tobytes()), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "max_request_rows"),
        (pb.LookupRequest(layer=1, row_ids=np.zeros(40000, "<i8").tobytes()), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "LookupStream"),  # more than one chunk for the unary call
    ]
    with grpc.insecure_channel(daemon.ready["grpc"]) as channel:
        stub = pb_grpc.EngramStoreStub(channel)
        for request, code, words in cases:
            with pytest.raises(grpc.RpcError) as info:
                stub.Lookup(request, timeout=30, metadata=daemon.grpc_metadata)
            assert info.value.code() == code and words in info.value.details(), (code, info.value.details())
        with pytest.raises(grpc.RpcError) as info:
            list(stub.LookupStream(pb.LookupRequest(layer=1, row_ids=ids(0, tables.rows(1))), timeout=30,
                                   metadata=daemon.grpc_metadata))
        assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        reply = stub.Lookup(pb.LookupRequest(layer=1, row_ids=ids(3, 1, dtype="<i4"), dtype=pb.INT32), timeout=30,
                            metadata=daemon.grpc_metadata)
        assert reply.rows == expected(tables, 1, np.array([3, 1])).tobytes()


def test_client_that_stops_reading_is_dropped(tables, tmp_path):
    """A client that floods requests and reads no reply fills the socket; after
    client_send_timeout_seconds the daemon drops it, and other clients are served meanwhile."""
    with DaemonProcess(tables.directory, tmp_path, env={"ENGRAM_STORE_CLIENT_SEND_TIMEOUT_SECONDS": "1"}) as d:
        ids = np.arange(0, tables.rows(1), 31)
        with EngramClient.connect(d.unix, reconnect_timeout=0) as good:
            stuck, welcome, _, fds = raw_connect(d.socket_path)
            for fd in fds:
                os.close(fd)
            assert welcome.status == Status.OK
            stuck.setblocking(False)
            flood = b"".join(Frame(Op.INFO, rid).pack() for rid in range(1, 4001))  # ~4 MB of replies
            sent = 0
            deadline = time.monotonic() + 30
            while sent < len(flood) and time.monotonic() < deadline:
                try:
                    sent += stuck.send(flood[sent:])
                except BlockingIOError:
                    time.sleep(0.01)  # the daemon stopped reading: it is blocked sending to us
                except OSError:
                    break  # already dropped
            np.testing.assert_array_equal(good.lookup(1, ids), expected(tables, 1, ids))  # served meanwhile
            deadline = time.monotonic() + 30
            while good.stats()["unix_connected_clients"] != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert good.stats()["unix_connected_clients"] == 1  # the stuck client was dropped
            np.testing.assert_array_equal(good.lookup(1, ids), expected(tables, 1, ids))
            stuck.setblocking(True)
            stuck.settimeout(30)
            try:  # the replies that were queued, then the end of the connection (not a hang)
                while stuck.recv(1 << 20):
                    pass
            except ConnectionResetError:
                pass
            stuck.close()
