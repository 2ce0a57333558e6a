"""gRPC before authentication: calls that never send a body, large unauthenticated bodies, and
authenticated callers past their share. Each attack runs against a real daemon process from a
client process of its own (grpc.aio, many calls at once); then an honest client checks that it
still gets the reference bytes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, assert_grpc_serving, make_tables

from engram_store.client.client import EngramClient
from engram_store.wire._proto import engram_store_pb2 as pb

ATTACKER = textwrap.dedent('''
    import asyncio, sys, json
    import grpc
    from engram_store.wire._proto import engram_store_pb2 as pb

    async def main(address, kind, calls, token, body_mb):
        metadata = (("authorization", "Bearer " + token),) if token else None
        codes = {}
        async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            if kind == "headers":  # headers, then nothing: a request that never comes
                stall = asyncio.Event()
                async def never():
                    await stall.wait()
                    yield b""
                call = ch.stream_unary("/engram_store.v1.EngramStore/Lookup", request_serializer=None,
                                       response_deserializer=None)
                pending = [call(never(), metadata=metadata, timeout=60) for _ in range(calls)]
            else:  # a whole unary call carrying body_mb MiB of row ids
                body = pb.LookupRequest(layer=1, row_ids=bytes(body_mb << 20)).SerializeToString()
                call = ch.unary_unary("/engram_store.v1.EngramStore/Lookup", request_serializer=None,
                                      response_deserializer=None)
                pending = [call(body, metadata=metadata, timeout=60) for _ in range(calls)]
            for result in await asyncio.gather(*pending, return_exceptions=True):
                code = result.code().name if isinstance(result, grpc.RpcError) else "OK"
                codes[code] = codes.get(code, 0) + 1
        print(json.dumps(codes), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])))
''')


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=17)


@pytest.fixture(scope="module")
def daemon(tables, tmp_path_factory):
    with DaemonProcess(tables.directory, tmp_path_factory.mktemp("daemon"),
                       extra=["--grpc-max-calls-per-peer", "200", "--handshake-timeout-seconds", "2"]) as d:
        yield d


def attack(daemon, kind: str, calls: int, *, token: str = "", body_mb: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", ATTACKER, daemon.ready["grpc"], kind, str(calls), token or "",
                             str(body_mb)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def codes(proc: subprocess.Popen) -> dict:
    import json

    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


def honest_lookup(daemon, tables, seed: int) -> None:
    ids = np.random.default_rng(seed).integers(0, tables.rows(1), 3000)
    with EngramClient.connect(daemon.grpc, token_file=daemon.token_file) as client:
        np.testing.assert_array_equal(client.lookup(1, ids), tables.read_rows(1, ids))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_header_only_unauthenticated_calls_are_refused_and_hold_nothing(daemon, tables):
    honest_lookup(daemon, tables, 1)
    proc = attack(daemon, "headers", 1100)
    try:
        honest_lookup(daemon, tables, 2)  # while the calls come in
    finally:
        result = codes(proc)
    # Refused at their headers, not left waiting for bodies (a few see the reset of their still-open
    # request stream before the status: CANCELLED, refused all the same).
    assert set(result) <= {"UNAUTHENTICATED", "CANCELLED"} and result["UNAUTHENTICATED"] >= 1000, result
    honest_lookup(daemon, tables, 3)


def test_large_unauthenticated_bodies_are_not_read(daemon, tables):
    honest_lookup(daemon, tables, 4)
    before = rss_bytes(daemon.pid)
    peak = before
    proc = attack(daemon, "body", 120, body_mb=8)
    while proc.poll() is None:
        peak = max(peak, rss_bytes(daemon.pid))
        time.sleep(0.005)
    result = codes(proc)
    assert result == {"UNAUTHENTICATED": 120}, result
    after = rss_bytes(daemon.pid)
    assert max(peak, after) - before < 50 << 20, (before, peak, after)
    honest_lookup(daemon, tables, 5)


def test_authenticated_calls_past_the_peer_cap_are_refused_and_stalled_ones_dropped(daemon, tables):
    token = open(daemon.token_file).read().strip()
    t0 = time.monotonic()
    result = codes(attack(daemon, "headers", 260, token=token))
    # 200 slots of this host taken by calls that never send their request: the rest refused at once,
    # the 200 dropped after handshake_timeout_seconds (2 s), freeing their slots.
    assert result == {"RESOURCE_EXHAUSTED": 60, "DEADLINE_EXCEEDED": 200}, result
    assert time.monotonic() - t0 < 30
    honest_lookup(daemon, tables, 6)


def test_health_is_open_and_reads_no_request(daemon):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(daemon.ready["grpc"]) as channel:
        assert_grpc_serving(channel, timeout=10)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        info = pb.InfoRequest()  # an EngramStore call without a token is still refused
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/engram_store.v1.EngramStore/Info", request_serializer=pb.InfoRequest.SerializeToString,
                                response_deserializer=pb.InfoReply.FromString)(info, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
