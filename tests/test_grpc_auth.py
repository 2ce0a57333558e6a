"""gRPC: who may read (token, mTLS), and what a refused, broken or cut-short call looks like.

Every attack is played against a real daemon process, then an honest client checks that
it still gets the reference bytes (``TableSet.read_rows``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, expected, make_tables

from engram_store import errors
from engram_store.client.client import EngramClient
from engram_store.client.grpc_transport import GrpcTransport, copy_chunks
from engram_store.wire import grpc_codec as lookup_codec
from engram_store.wire._proto import engram_store_pb2 as pb
from engram_store.wire._proto import engram_store_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=13)


@pytest.fixture(scope="module")
def daemon(tables, tmp_path_factory):
    with DaemonProcess(tables.directory, tmp_path_factory.mktemp("daemon"), extra=["--log-level", "INFO"]) as d:
        yield d


def _ids(tables, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, tables.rows(1), n)


def test_unauthenticated_and_wrong_token_are_refused(daemon, tables):
    ids = _ids(tables, 100, 1)
    request = pb.LookupRequest(layer=1, row_ids=ids.astype("<i8").tobytes())
    with grpc.insecure_channel(daemon.ready["grpc"]) as channel:
        stub = pb_grpc.EngramStoreStub(channel)
        calls = [lambda md: stub.Lookup(request, timeout=30, metadata=md),
                 lambda md: list(stub.LookupStream(request, timeout=30, metadata=md)),
                 lambda md: stub.Info(pb.InfoRequest(), timeout=30, metadata=md),
                 lambda md: stub.Stats(pb.StatsRequest(), timeout=30, metadata=md)]
        for metadata in (None, (("authorization", "Bearer " + "0" * 64),), (("authorization", "0" * 64),)):
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    call(metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
                assert "token" in info.value.details()
        reply = stub.Lookup(request, timeout=30, metadata=daemon.grpc_metadata)  # the same call, with the token
        assert reply.rows == tables.read_rows(1, ids).tobytes()
    with pytest.raises(errors.Unauthenticated, match="no 'authorization'"):
        EngramClient.connect(daemon.grpc, reconnect_timeout=0)
    with pytest.raises(errors.Unauthenticated, match="wrong token"):
        EngramClient.connect(daemon.grpc, reconnect_timeout=0, token="not-the-token-" * 3)
    with EngramClient.connect(daemon.grpc, token_file=daemon.token_file) as client:
        assert client.stats()["grpc_errors_unauthenticated"] >= 14


def test_authenticated_client_is_served_byte_exact(daemon, tables, monkeypatch):
    for layer in tables.layers:
        small, large = _ids(tables, 500, layer), _ids(tables, 60_000, layer + 1)  # one message; a stream
        with EngramClient.connect(daemon.grpc, token_file=daemon.token_file) as client:
            np.testing.assert_array_equal(client.lookup(layer, small), tables.read_rows(layer, small))
            np.testing.assert_array_equal(client.lookup(layer, large), tables.read_rows(layer, large))
    monkeypatch.setenv("ENGRAM_STORE_GRPC_TOKEN_FILE", daemon.token_file)  # the client's environment names the file
    with EngramClient.connect(daemon.grpc) as client:
        np.testing.assert_array_equal(client.lookup(3, small), expected(tables, 3, small))


def test_health_needs_no_token(daemon):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(daemon.ready["grpc"]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_cli_takes_the_token_file(daemon, tables):
    cmd = [sys.executable, "-m", "engram_store"]
    out = subprocess.run(cmd + ["lookup", daemon.grpc, "--layer", "1", "--rows", "2"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 2 and "UNAUTHENTICATED" in out.stderr, out.stderr
    out = subprocess.run(cmd + ["stats", daemon.grpc, "--token-file", daemon.token_file], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and 'engram_store_requests_total{transport="grpc"}' in out.stdout, out.stderr


def test_malformed_requests_and_cancelled_streams_are_one_line_each(daemon, tables):
    with grpc.insecure_channel(daemon.ready["grpc"]) as channel:
        raw = channel.unary_unary("/engram_store.v1.EngramStore/Lookup")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff\xff", timeout=30, metadata=daemon.grpc_metadata)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parse" in info.value.details()
        stream = pb_grpc.EngramStoreStub(channel).LookupStream
        request = pb.LookupRequest(layer=1, row_ids=_ids(tables, 400_000, 3).astype("<i8").tobytes())
        for _ in range(5):  # the client goes away after the first chunk
            call = stream(request, timeout=30, metadata=daemon.grpc_metadata)
            next(call)
            call.cancel()
    with EngramClient.connect(daemon.grpc, token_file=daemon.token_file) as client:  # still serving
        ids = _ids(tables, 1000, 4)
        np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))
    deadline = time.monotonic() + 20  # the daemon notices a cancel when its next send fails: poll its log
    while (log := daemon.log_text()).count("cancelled by the client") + log.count("went away") < 5:
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
    assert "does not parse" in log and "Traceback" not in log and " ERROR " not in log, log


def test_a_truncated_layer_is_not_advertised_and_refused(tables, tmp_path):
    broken = tmp_path / "tables"
    shutil.copytree(tables.directory, broken)
    layer_file = broken / tables.manifest.layer(3).file
    layer_file.write_bytes(layer_file.read_bytes()[:4096])
    (tmp_path / "run").mkdir()
    with DaemonProcess(broken, tmp_path / "run", extra=["--no-verify"]) as d:
        for address in (d.unix, d.grpc):
            with EngramClient.connect(address, token_file=d.token_file, reconnect_timeout=0) as client:
                info = client.info()
                assert info["layers"] == [1] and list(info["rows"]) == [1], info
                with pytest.raises(errors.StorageError, match="layer 3 is unavailable"):
                    client.lookup(3, np.arange(4))
                ids = _ids(tables, 300, 5)
                np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))
        with EngramClient.connect(d.unix) as client:
            assert "3" in client.info()["layers_unavailable"]


# --- mTLS ---------------------------------------------------------------------------
def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=120)


def _ca(directory, name: str):
    key, cert = directory / f"{name}-ca.key", directory / f"{name}-ca.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name} CA",
             "-keyout", str(key), "-out", str(cert))
    return key, cert


def _signed(directory, name: str, ca, san: str | None = None):
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]), "-CAcreateserial",
             "-days", "1", "-extfile", str(ext), "-out", str(cert))
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_mutual_tls(tables, tmp_path):
    ca, other_ca = _ca(tmp_path, "trusted"), _ca(tmp_path, "other")
    server = _signed(tmp_path, "server", ca, san="DNS:localhost,IP:127.0.0.1")
    client_cert, stranger = _signed(tmp_path, "client", ca), _signed(tmp_path, "stranger", other_ca)
    (tmp_path / "run").mkdir()
    with DaemonProcess(tables.directory, tmp_path / "run", grpc_token=False,
                       extra=["--grpc-tls-cert", str(server[1]), "--grpc-tls-key", str(server[0]),
                              "--grpc-tls-client-ca", str(ca[1])]) as d:
        target = f"grpcs://{d.ready['grpc']}"
        with pytest.raises(errors.Unavailable):  # no client certificate: the handshake fails
            EngramClient.connect(target, tls_ca=str(ca[1]), connect_timeout=3, reconnect_timeout=0)
        with pytest.raises(errors.Unavailable):  # a certificate from another CA
            EngramClient.connect(target, tls_ca=str(ca[1]), tls_cert=str(stranger[1]), tls_key=str(stranger[0]),
                                 connect_timeout=3, reconnect_timeout=0)
        with EngramClient.connect(target, tls_ca=str(ca[1]), tls_cert=str(client_cert[1]),
                                  tls_key=str(client_cert[0])) as client:
            ids = _ids(tables, 20_000, 6)
            np.testing.assert_array_equal(client.lookup(1, ids), tables.read_rows(1, ids))


# --- replies that do not cover the request ---------------------------------------
def _chunk(rows: np.ndarray, first: int, total: int, row_bytes: int) -> lookup_codec.LookupChunk:
    data = lookup_codec.encode_reply(rows, first, len(rows), row_bytes, total).data
    return lookup_codec.decode_reply(data)


@pytest.mark.parametrize("plan, words", [
    ([(0, 40), (40, 60)], "cut short"),            # the stream ended at row 60 of 100
    ([(0, 60), (50, 100)], "does not continue"),   # overlap
    ([(0, 40), (60, 100)], "does not continue"),   # gap
    ([(40, 100), (0, 40)], "does not continue"),   # out of order
    ([], "cut short"),                              # nothing at all
])
def test_a_reply_that_does_not_cover_the_request_raises(plan, words):
    row_bytes, total = 8, 100
    rows = np.arange(total * row_bytes, dtype=np.uint64).astype(np.uint8).reshape(total, row_bytes)
    flat = np.zeros(total * row_bytes, np.uint8)
    chunks = [_chunk(rows[a:b], a, total, row_bytes) for a, b in plan]
    with pytest.raises(errors.IncompleteReply, match=words):
        copy_chunks(chunks, flat, total, row_bytes)
    copy_chunks([_chunk(rows[:70], 0, total, row_bytes), _chunk(rows[70:], 70, total, row_bytes)], flat, total,
                row_bytes)
    np.testing.assert_array_equal(flat.reshape(total, row_bytes), rows)
    for bad in (_chunk(rows, 0, total + 1, row_bytes), _chunk(rows[:, :4].copy(), 0, total, 4)):
        with pytest.raises(errors.IncompleteReply):  # another total, another row size
            copy_chunks([bad], flat, total, row_bytes)


class _ShortStreamServer(pb_grpc.EngramStoreServicer):  # the generated base answers the RPCs it leaves out
    """A fake daemon whose streams stop after their first chunk (and whose unary replies lack a row)."""

    row_bytes, chunk_bytes = 8, 64

    def Info(self, request, context):
        return pb.InfoReply(layers=[pb.LayerInfo(layer=1, rows=1000)], row_bytes=self.row_bytes, mode="cached",
                            max_request_rows=1 << 20, chunk_bytes=self.chunk_bytes, protocol_version=1)

    def Stats(self, request, context):
        return pb.StatsReply()

    def _rows(self, request):
        n = len(request.row_ids) // 8
        return np.full((n, self.row_bytes), 7, np.uint8), n

    def Lookup(self, request, context):
        rows, n = self._rows(request)
        return pb.LookupReply(rows=rows[:-1].tobytes(), first_row=0, row_count=n - 1, row_bytes=self.row_bytes,
                              total_rows=n)

    def LookupStream(self, request, context):
        rows, n = self._rows(request)
        step = self.chunk_bytes // self.row_bytes
        yield pb.LookupReply(rows=rows[:step].tobytes(), first_row=0, row_count=step, row_bytes=self.row_bytes,
                             total_rows=n)


def test_the_client_raises_on_a_short_stream_from_a_server():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_EngramStoreServicer_to_server(_ShortStreamServer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        transport = GrpcTransport(f"127.0.0.1:{port}", token="t" * 20)
        out = np.empty((100, 8), np.uint8)
        with pytest.raises(errors.IncompleteReply, match="cut short"):
            transport.lookup_into(1, np.arange(100), out)  # 800 bytes: a stream, cut after 64
        with pytest.raises(errors.IncompleteReply, match="cut short"):
            transport.lookup_into(1, np.arange(5), np.empty((5, 8), np.uint8))  # one message, a row short
        transport.close()
    finally:
        server.stop(0)
