"""The same EngramClient object survives a daemon killed with SIGKILL and restarted."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables, make_token_file

from engram_store import errors
from engram_store.client.client import EngramClient


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=5)


def _restart_on_same_addresses(old: DaemonProcess) -> DaemonProcess:
    grpc_port = old.ready["grpc"].rsplit(":", 1)[1]  # the port the first run picked
    new = DaemonProcess(old.tables, old.workdir, extra=["--grpc", f"127.0.0.1:{grpc_port}"])
    return new.start()


@pytest.mark.parametrize("transport", ["unix", "grpc"])
def test_client_survives_sigkill_and_restart(tables, tmp_path, transport):
    first = DaemonProcess(tables.directory, tmp_path).start()
    second = None
    try:
        address = first.unix if transport == "unix" else first.grpc
        client = EngramClient.connect(address, reconnect_timeout=60, token_file=first.token_file)
        ids = np.random.default_rng(0).integers(0, min(tables.rows(1), tables.rows(3)), size=(40, 24))
        np.testing.assert_array_equal(client.lookup(3, ids), expected(tables, 3, ids))
        generation = client.generation
        first.kill()

        results: dict[str, object] = {}

        def lookup_while_down() -> None:  # blocks in the client's reconnect loop until the restart
            try:
                results["rows"] = client.lookup(1, ids)
            except Exception as exc:  # reported below
                results["error"] = exc

        worker = threading.Thread(target=lookup_while_down)
        worker.start()
        second = _restart_on_same_addresses(first)
        worker.join(120)
        assert not worker.is_alive() and "error" not in results, results
        np.testing.assert_array_equal(results["rows"], expected(tables, 1, ids))
        np.testing.assert_array_equal(client.lookup(3, ids), expected(tables, 3, ids))
        assert client.generation > generation
        if transport == "unix":
            assert second.ready["mode"] == "resident" and client.arena is not None
        client.close()
        with pytest.raises(errors.Unavailable):
            client.lookup(1, ids)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_connect_to_nothing_is_unavailable(tmp_path):
    with pytest.raises(errors.Unavailable, match="cannot connect"):
        EngramClient.connect(f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(errors.ConfigError, match="expected unix://"):
        EngramClient.connect("http://localhost:1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_clients_see_unavailable_while_the_daemon_starts(tables, tmp_path):
    """Before the daemon is ready (loading tables, listeners not open yet) a gRPC call gets
    UNAVAILABLE, not a hang or another code; clients made before it started are served
    once it is ready, with the right bytes."""
    import grpc

    from engram_store.wire._proto import engram_store_pb2 as pb
    from engram_store.wire._proto import engram_store_pb2_grpc as pb_grpc

    port = _free_port()
    daemon = DaemonProcess(tables.directory, tmp_path, extra=["--grpc", f"127.0.0.1:{port}"])
    ids = np.arange(0, tables.rows(1), 13)
    make_token_file(Path(daemon.token_file))  # the early gRPC client reads it when it first connects
    early = [EngramClient(daemon.unix, reconnect_timeout=60),
             EngramClient(f"grpc://127.0.0.1:{port}", reconnect_timeout=60, token_file=daemon.token_file)]
    results: dict = {}

    def look(i: int, client: EngramClient) -> None:
        try:
            results[i] = client.lookup(1, ids)
        except Exception as exc:  # reported below
            results[i] = exc

    codes = []
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        starter = threading.Thread(target=daemon.start)
        starter.start()
        threads = [threading.Thread(target=look, args=(i, c)) for i, c in enumerate(early)]
        for t in threads:
            t.start()
        stub = pb_grpc.EngramStoreStub(channel)
        while not daemon.ready_file.exists() and starter.is_alive():
            try:
                stub.Info(pb.InfoRequest(), timeout=5, metadata=daemon.grpc_metadata)
            except grpc.RpcError as exc:
                codes.append(exc.code())
            if daemon.ready_file.exists():
                break  # this call may have raced the start; count only calls made before it
        starter.join(60)
        assert daemon.ready, "daemon did not start"
        assert codes and set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes
        for t in threads:
            t.join(60)
        for i in range(len(early)):
            assert not isinstance(results.get(i), Exception), results.get(i)
            np.testing.assert_array_equal(results[i], expected(tables, 1, ids))
        assert stub.Info(pb.InfoRequest(), timeout=30, wait_for_ready=True,
                         metadata=daemon.grpc_metadata).row_bytes == tables.row_bytes
    finally:
        channel.close()
        for c in early:
            c.close()
        daemon.stop()
