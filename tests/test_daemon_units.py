"""Pieces of the daemon on their own: frame layout, status mapping, region allocator, sd_notify, gRPC states."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, make_tables

from engram_store import errors
from engram_store.client.region import Extents
from engram_store.daemon.config import load_config
from engram_store.daemon.service import sd_notify
from engram_store.daemon.stats import TransportStats
from engram_store.wire import frames as wire
from engram_store.wire.frames import Frame, Op, Status


def test_frame_layout_round_trips():
    assert wire.FRAME.size == 56
    f = Frame(Op.LOOKUP, request_id=2**64 - 1, status=Status.OUT_OF_RANGE, dtype=wire.DType.INT32, layer=-3,
              count=5, ids_offset=64, out_offset=2**63)
    data = f.pack(b"hello")
    back = Frame.unpack(data[: wire.FRAME.size])
    assert back == Frame(**{**f.__dict__, "payload_bytes": 5}) and data[wire.FRAME.size:] == b"hello"


@pytest.mark.parametrize("frame, words", [
    (Frame(Op.HELLO, magic=0xDEADBEEF), "magic"),
    (Frame(Op.HELLO, version=wire.VERSION + 1), "version"),
    (Frame(Op.HELLO, payload_bytes=10), "exceeds"),
])
def test_bad_headers_are_protocol_errors(frame, words):
    with pytest.raises(wire.ProtocolError, match=words):
        wire.check_header(frame, max_payload=0)


@pytest.mark.parametrize("cls", [errors.UnknownLayer, errors.RowOutOfRange, errors.InvalidRequest,
                                 errors.ResourceExhausted, errors.Unavailable, errors.StorageError])
def test_status_mapping_gives_back_the_same_class(cls):
    back = wire.error_of(wire.status_of(cls("why")), "why")
    assert type(back) is cls and str(back) == "why"


def test_region_allocator_reuses_and_merges():
    ext = Extents(1024)
    a, b, c = ext.alloc(256), ext.alloc(256), ext.alloc(512)
    assert (a, b, c) == (0, 256, 512) and ext.try_alloc(64) is None
    ext.release(b, 256)
    ext.release(a, 256)
    assert ext.free == [(0, 512)] and ext.alloc(512) == 0
    with pytest.raises(errors.ResourceExhausted, match="region has 1024"):
        ext.alloc(2048)
    with pytest.raises(errors.ResourceExhausted, match="no 64 bytes"):
        ext.alloc(64, timeout=0.0)


def test_sd_notify_writes_a_datagram(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": path})
        assert s.recv(100) == b"READY=1"
    assert not sd_notify("READY=1", {})
    name = f"engram-test-{id(path)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)  # abstract namespace, as systemd uses
        assert sd_notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(100) == b"STOPPING=1"


def test_daemon_sends_ready_to_systemd(tmp_path):
    tables = make_tables(tmp_path / "tables")
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        s.settimeout(60)
        with DaemonProcess(tables.directory, tmp_path, env={"NOTIFY_SOCKET": path}) as d:
            message = s.recv(4096).decode()
            assert "READY=1" in message and f"MAINPID={d.pid}" in message
            assert d.terminate() == 0
            assert "STOPPING=1" in s.recv(4096).decode()


def test_latency_histogram_buckets():
    t = TransportStats("unix")
    t.record(10, 264, 0.00004)
    t.record(10, 264, 0.0015)
    t.record(0, 264, 9.0, "NOT_FOUND")
    counts, total = t.histogram()
    assert counts[0] == 1 and counts[5] == 1 and counts[-1] == 1 and total == pytest.approx(9.00154)
    assert t.snapshot()["unix_rows"] == 10 + 10 and t.snapshot()["unix_errors_not_found"] == 1


def test_grpc_is_unavailable_until_the_store_is_attached(tmp_path):
    from engram_store.daemon.grpc.server import GrpcServer
    from engram_store.daemon.grpc.service import EngramStoreService
    from engram_store.wire._proto import engram_store_pb2 as pb
    from engram_store.wire._proto import engram_store_pb2_grpc as pb_grpc

    token = tmp_path / "grpc.token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    metadata = (("authorization", "Bearer " + "t" * 32),)

    async def scenario() -> list[grpc.StatusCode]:
        config = load_config({"grpc": "127.0.0.1:0", "grpc_token_file": str(token), "metrics": ""}, environ={})
        with ThreadPoolExecutor(1) as pool:
            service = EngramStoreService(config, TransportStats("grpc"), pool, dict, dict)
            server = GrpcServer(service, config)
            address = await server.start()
            codes = []
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = pb_grpc.EngramStoreStub(channel)
                    for call in (stub.Lookup(pb.LookupRequest(layer=1, row_ids=np.zeros(2, "<i8").tobytes()),
                                             metadata=metadata),
                                 stub.Info(pb.InfoRequest(), metadata=metadata)):
                        try:
                            await call
                        except grpc.aio.AioRpcError as exc:
                            codes.append(exc.code())
                            assert "starting" in exc.details()
            finally:
                await server.stop(0)
            return codes

    assert asyncio.run(scenario()) == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
