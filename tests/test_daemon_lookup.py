"""The daemon as a real process: byte-exact lookups over both transports, resident and cached."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import subprocess
import sys
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, assert_grpc_serving, expected, make_tables

from engram_store import errors
from engram_store.client.client import EngramClient
from engram_store.daemon.unix import fastpath
from engram_store.models.spec import ModelSpec


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=11)


@pytest.fixture(scope="module")
def daemon(reader_daemon):
    """``reader_daemon`` (resident with the native Unix path when built, resident all in Python, cached), its Unix
    path native unless turned off (cached: all-hit lookups)."""
    with EngramClient.connect(reader_daemon.unix) as c:
        native = c.info()["unix_native"]
    python_only = "--no-unix-native" in reader_daemon.extra
    assert native == (not python_only and fastpath.native_module() is not None)
    return reader_daemon


def _ids(tables, layer, shape, seed):
    return np.random.default_rng(seed).integers(0, tables.rows(layer), size=shape)


@pytest.mark.parametrize("transport", ["unix", "unix-spin", "grpc"])
def test_lookup_is_byte_exact(daemon, tables, transport):
    address = daemon.grpc if transport == "grpc" else daemon.unix
    with EngramClient.connect(address, spin_us=1000 if transport == "unix-spin" else 0,
                              token_file=daemon.token_file) as client:
        for layer in tables.layers:
            for shape in [(1,), (5, 24), (3, 4, 12), (3000,)]:
                ids = _ids(tables, layer, shape, seed=layer * 100 + len(shape))
                got = client.lookup(layer, ids)
                assert got.shape == ids.shape + (tables.row_bytes,) and got.dtype == np.uint8
                np.testing.assert_array_equal(got, expected(tables, layer, ids))
        # duplicates, the first and the last row, int32 ids, an empty request
        layer = tables.layers[-1]
        ids = np.array([0, tables.rows(layer) - 1, 0, 7, 7], dtype=np.int32)
        np.testing.assert_array_equal(client.lookup(layer, ids), expected(tables, layer, ids))
        assert client.lookup(layer, np.zeros((0,), np.int64)).shape == (0, tables.row_bytes)


@pytest.mark.parametrize("transport", ["unix", "grpc"])
def test_large_lookup_splits_and_streams(daemon, tables, transport):
    """More rows than one gRPC chunk and than a quarter of the shared region: chunked both ways."""
    address = daemon.unix if transport == "unix" else daemon.grpc
    with EngramClient.connect(address, shm_bytes=1 << 20, token_file=daemon.token_file) as client:
        ids = _ids(tables, 1, (70_000,), seed=5)  # 4.6 MB of rows: several gRPC chunks, > 1 MiB region
        out = np.full(ids.shape + (tables.row_bytes,), 0xAB, dtype=np.uint8)
        assert client.lookup_into(1, ids, out) is out
        np.testing.assert_array_equal(out, expected(tables, 1, ids))


def test_unix_views_region_and_arena(daemon, tables):
    with EngramClient.connect(daemon.unix) as client:
        ids = _ids(tables, 3, (64, 24), seed=9)
        region = client.shared_region
        with client.lookup_view(3, ids) as rows:
            np.testing.assert_array_equal(rows, expected(tables, 3, ids))
            assert not rows.flags.writeable
            assert np.shares_memory(rows, region)  # zero copy: the daemon wrote into our region
        handles = [client.submit(3, ids[i]) for i in range(8)]  # pipelined
        for i, h in enumerate(handles):
            np.testing.assert_array_equal(h.wait(), expected(tables, 3, ids[i]))
            h.release()
        arena = client.arena
        if daemon.ready["mode"] == "resident":
            assert {a.layer for a in arena.layers} == set(tables.layers)
            weights, scales = arena.blocks(3)  # the engines' layout: payloads, then scales
            want = expected(tables, 3, ids[0])
            np.testing.assert_array_equal(weights[ids[0]], want[:, :weights.shape[1]])
            np.testing.assert_array_equal(scales[ids[0]], want[:, weights.shape[1]:])
            assert arena.layout.to_dict() == {k: v for k, v in client.info()["arena"].items()
                                            if k not in ("huge_pages", "huge_page_bytes")}
            out = np.empty((24, tables.row_bytes), np.uint8)
            np.testing.assert_array_equal(arena.gather_into(3, ids[0], out), expected(tables, 3, ids[0]))
            many = np.random.default_rng(5).integers(0, tables.rows(3), 5000)  # large enough to split
            big = np.empty((5000, tables.row_bytes), np.uint8)
            np.testing.assert_array_equal(arena.gather_into(3, many, big, threads=2), expected(tables, 3, many))
            for bad in ([-1], [tables.rows(3)]):  # no wrap-around of negative ids, no reads past the layer
                with pytest.raises(errors.RowOutOfRange):
                    arena.gather_into(3, np.array(bad), out[:1])
            with pytest.raises(ValueError):
                arena.array[0] = 1  # mapped read-only
        else:
            assert arena is None


def test_reserved_buffer_is_filled_in_place(daemon, tables):
    """out inside reserve(): the daemon writes there. The region is too full for the copy path
    (ids + rows in a second extent), so only the in-place path can answer."""
    with EngramClient.connect(daemon.unix, shm_bytes=1 << 20) as client:
        rows = (1 << 20) * 7 // 8 // tables.row_bytes
        buf = client.reserve((rows, tables.row_bytes))
        assert np.shares_memory(buf, client.shared_region) and buf.flags.writeable
        ids = _ids(tables, 1, (rows,), seed=21)
        for _ in range(3):
            assert client.lookup_into(1, ids, buf) is buf
            np.testing.assert_array_equal(buf, expected(tables, 1, ids))
        client.unreserve(buf)
        with pytest.raises(errors.InvalidRequest, match="reserve"):
            client.unreserve(buf)


def test_info_and_stats(daemon, tables):
    for address in (daemon.unix, daemon.grpc):
        with EngramClient.connect(address, token_file=daemon.token_file) as client:
            info = client.info()
            assert info["layers"] == list(tables.layers)
            assert info["rows"] == {layer: tables.rows(layer) for layer in tables.layers}
            assert info["row_bytes"] == tables.row_bytes and info["mode"] == daemon.ready["mode"]
            assert ModelSpec.from_dict(info["spec"]) == tables.spec
            client.lookup(1, np.arange(10))
            stats = client.stats()
            assert stats[f"{info['transport']}_rows"] >= 10 and 0.0 <= stats["hit_ratio"] <= 1.0


def test_native_path_answers_lookups_and_grows_its_id_buffer(daemon, tables):
    """Resident with _unixfast: every well-formed lookup is answered natively except the
    first one larger than the connection's id buffer (Python answers it, the buffer grows)."""
    if daemon.ready["mode"] == "cached":
        pytest.skip("a cached layer's lookups are native only when every row is cached: test_native_cached_hits.py")
    native = "--no-unix-native" not in daemon.extra and daemon.ready["mode"] == "resident" \
        and fastpath.native_module() is not None
    big = fastpath.IDS_START_ROWS + 100
    with EngramClient.connect(daemon.unix) as client:
        before = client.stats()
        for n, seed in ((100, 1), (big, 2), (big, 3), (7, 4)):
            ids = _ids(tables, 3, n, seed)
            np.testing.assert_array_equal(client.lookup(3, ids), expected(tables, 3, ids))
        after = client.stats()
    assert after["unix_requests"] - before["unix_requests"] == 4
    assert after["unix_native_requests"] - before["unix_native_requests"] == (3 if native else 0)
    assert after["unix_rows"] - before["unix_rows"] == 100 + 2 * big + 7


@pytest.mark.parametrize("transport", ["unix", "grpc"])
def test_errors_are_typed_and_carry_the_message(daemon, tables, transport):
    address = daemon.unix if transport == "unix" else daemon.grpc
    with EngramClient.connect(address, token_file=daemon.token_file) as client:
        with pytest.raises(errors.UnknownLayer, match="layer 2"):
            client.lookup(2, np.arange(3))
        with pytest.raises(errors.RowOutOfRange):
            client.lookup(1, np.array([0, tables.rows(1)]))
        with pytest.raises(errors.RowOutOfRange):
            client.lookup(1, np.array([-1]))
        with pytest.raises(errors.InvalidRequest, match="integer"):
            client.lookup(1, np.array([0.5, 1.0]))
        with pytest.raises(errors.InvalidRequest, match="shape"):
            client.lookup_into(1, np.arange(4), np.empty((4, tables.row_bytes + 1), np.uint8))
        np.testing.assert_array_equal(client.lookup(1, np.arange(4)), expected(tables, 1, np.arange(4)))


@pytest.mark.parametrize("transport", ["unix", "grpc"])
def test_one_client_shared_by_threads(daemon, tables, transport):
    address = daemon.unix if transport == "unix" else daemon.grpc
    failures: list[str] = []
    with EngramClient.connect(address, shm_bytes=1 << 20, token_file=daemon.token_file) as client:
        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for i in range(25):
                layer = tables.layers[(seed + i) % 2]
                ids = rng.integers(0, tables.rows(layer), size=int(rng.integers(1, 6000)))
                if i % 2:
                    with client.lookup_view(layer, ids) as rows:
                        ok = np.array_equal(rows, expected(tables, layer, ids))
                else:
                    ok = np.array_equal(client.lookup(layer, ids), expected(tables, layer, ids))
                if not ok:
                    failures.append(f"thread {seed} lookup {i}")

        threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not failures and not any(t.is_alive() for t in threads)


def _client_process(address: str, token_file: str, tables_dir: str, seed: int, queue) -> None:
    from engram_store.format.tableset import TableSet

    tables = TableSet.open(tables_dir)
    try:
        with EngramClient.connect(address, token_file=token_file) as client:
            rng = np.random.default_rng(seed)
            for i in range(30):
                layer = tables.layers[i % 2]
                ids = rng.integers(0, tables.rows(layer), size=(int(rng.integers(1, 4000)),))
                got = client.lookup(layer, ids)
                if not np.array_equal(got, tables.read_rows(layer, ids)):
                    queue.put(f"mismatch in process {seed} lookup {i}")
                    return
        queue.put("ok")
    except Exception as exc:  # reported to the parent, which fails the test
        queue.put(repr(exc))


@pytest.mark.parametrize("transport", ["unix", "grpc"])
def test_four_client_processes_at_once(daemon, tables, transport):
    address = daemon.unix if transport == "unix" else daemon.grpc
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(address, daemon.token_file, str(tables.directory), s, queue)) for s in range(4)]
    try:
        for p in procs:
            p.start()
        results = [queue.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert results == ["ok"] * 4


def test_metrics_endpoint_and_cli(daemon, tables):
    with EngramClient.connect(daemon.unix) as client:
        client.lookup(1, np.arange(100))
    text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics", timeout=30).read().decode()
    for name in ("engram_store_requests_total", "engram_store_rows_total", "engram_store_bytes_total",
                 "engram_store_request_latency_seconds_bucket", "engram_store_hit_ratio",
                 "engram_store_connected_clients", "engram_store_tier_rows_total"):
        assert name in text, name
    assert 'engram_store_rows_total{transport="unix"}' in text
    if daemon.ready["mode"] == "cached":  # the first reads of a cold cache come from NVMe
        nvme = re.search(r"^engram_store_nvme_read_bytes_total (\S+)$", text, re.M)
        assert nvme and float(nvme.group(1)) > 0 and "engram_store_cache_occupancy_ratio" in text
    else:
        assert re.search(r"^engram_store_arena_bytes (\S+)$", text, re.M)
    cmd = [sys.executable, "-m", "engram_store"]  # stats and lookup are client commands of the main CLI
    out = subprocess.run(cmd + ["stats", daemon.unix], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and 'engram_store_rows_total{transport="unix"}' in out.stdout, out.stderr  # Prometheus names
    out = subprocess.run(cmd + ["stats", f"http://{daemon.ready['metrics']}"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0 and "engram_store_hit_ratio" in out.stdout, out.stderr
    out = subprocess.run(cmd + ["lookup", daemon.grpc, "--token-file", daemon.token_file, "--layer", "3", "--rows",
                                "0,5"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    want = expected(tables, 3, np.array([0, 5]))
    assert out.stdout.split() == ["layer", "3", "row", "0:", want[0].tobytes().hex(),
                                  "layer", "3", "row", "5:", want[1].tobytes().hex()]
    out = subprocess.run(cmd + ["lookup", daemon.unix, "--layer", "9", "--rows", "0"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2 and "layer 9" in out.stderr


def test_sigterm_drains_and_exits_zero(tables, tmp_path):
    d = DaemonProcess(tables.directory, tmp_path)
    try:
        d.start()
        client = EngramClient.connect(d.unix, reconnect_timeout=0)
        handles = [client.submit(1, np.arange(2000)) for _ in range(4)]
        assert d.terminate() == 0
        for h in handles:  # accepted before SIGTERM: answered, not dropped
            np.testing.assert_array_equal(h.wait(), expected(tables, 1, np.arange(2000)))
        assert not d.ready_file.exists()
        with pytest.raises(errors.Unavailable):
            client.lookup(1, np.arange(3))
        client.close()
    finally:
        d.stop()


def test_grpc_health_is_serving(daemon):
    """The health service answers without the token (probes have none)."""
    with grpc.insecure_channel(daemon.ready["grpc"]) as channel:
        assert_grpc_serving(channel)


def test_ready_file_names_real_addresses(daemon):
    ready = json.loads(daemon.ready_file.read_text())
    assert ready["socket"] == daemon.socket_path and ready["pid"] == daemon.pid
    host, port = ready["grpc"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert int(ready["metrics"].rsplit(":", 1)[1]) > 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
