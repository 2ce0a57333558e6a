"""Hints between clients, through a real daemon (issue 37, items 2 and 5): a flood of one client's hints leaves
another's hot rows cached; bounds, rates and keys belong to a client's identity (its uid over the Unix socket,
its certificate or connection over gRPC), whatever connections it uses. The daemon's own counters say what
happened, never a timing. The cases with two users run as root and act as ``nobody`` in a forked child."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess
from test_grpc_auth import _ca, _signed
from test_hints_daemon import LAYER, SPEC, daemon, store_stats, tables, wait_hints_done  # noqa: F401 (fixture)

from engram_store.client.client import EngramClient
from engram_store.storage.placement import slot_bytes

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user (nobody)")
# a hinted share of a few slots: the reader reads one batch and stops (nothing looks the rows up), so what
# a client queued stays queued while a test looks at it
STALLED = ("--hint-cache-share", "0.0002")


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(SPEC.rows(LAYER), n, replace=False)


def _as_nobody(socket_path: str, calls: list[tuple]) -> list[int]:
    """Fork a child that becomes uid ``nobody``, connects and makes ``calls`` (``("hint", rows, key)`` or
    ``("withdraw", key)``); their results, or the child's error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        out: object
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with EngramClient.connect(f"unix://{socket_path}") as client:
                out = [client.hint(LAYER, c[1], key=c[2]) if c[0] == "hint" else client.withdraw(c[1])
                       for c in calls]
        except BaseException as exc:  # reported to the parent
            out = f"{type(exc).__name__}: {exc}"
        with os.fdopen(write, "w") as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        got = json.loads(f.read() or '"no answer"')
    os.waitpid(pid, 0)
    assert isinstance(got, list), got
    return got


def _shared_daemon(tables, *extra: str) -> DaemonProcess:  # noqa: F811
    """A daemon whose socket another uid can reach."""
    workdir = Path(tempfile.mkdtemp(prefix="engram-hints-uid-"))
    os.chmod(workdir, 0o755)
    return daemon(tables, workdir, "--socket-mode", "0666", *extra)


def test_a_hint_flood_leaves_another_clients_hot_rows_cached(tables, tmp_path):  # noqa: F811
    """A client steps decode-sized lookups over a hot set that nearly fills the cache; another floods hints
    of rows nobody looks up, under new keys. The hinted share takes free slots only: the first client's
    next pass over its hot set reads nothing from NVMe (before, the share took its slots from the hot set
    and the misses lasted until the hinted rows aged, 30 s)."""
    slots = 30_000
    with daemon(tables, tmp_path, slots=slots) as d, EngramClient.connect(d.unix) as looker, \
            EngramClient.connect(d.unix) as flooder:
        n_slots = 4 * int(store_stats(looker)["hint_cache_slots_limit"])
        hot = _rows(n_slots - 3000, 1)  # 3,000 slots free: fewer than the hinted share's quarter

        def one_pass() -> int:
            before = store_stats(looker)["rows_nvme"]
            for lo in range(0, len(hot), 1536):
                looker.lookup(LAYER, hot[lo:lo + 1536])
            return store_stats(looker)["rows_nvme"] - before

        one_pass()  # reads the hot set in
        assert one_pass() == 0 and one_pass() == 0  # all hits, each row read again
        rest = np.setdiff1d(np.arange(SPEC.rows(LAYER)), hot)
        for key in range(4):  # 4 x 10k rows nobody will look up, under new keys
            flooder.hint(LAYER, rest[key * 10_000:(key + 1) * 10_000], key=100 + key)
        st = wait_hints_done(looker)
        assert one_pass() == 0  # every hot row still cached: its miss share where it was
        assert 0 < st["hint_cache_slots_used"] <= 3000 < st["hint_cache_slots_limit"]  # free slots only
        assert st["hint_rows_dropped_no_room"] > 0


_SECOND_CLIENT = r"""
import json, sys
import numpy as np
from engram_store.client.client import EngramClient
target, connect, layer, rows, layer_rows = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:6])
with EngramClient.connect(target, **connect) as client:
    ids = np.random.default_rng(4).choice(layer_rows, rows, replace=False)
    print(json.dumps([client.hint(layer, ids, key=7), client.withdraw(5)]))
"""


def _second_client(target: str, **connect: str) -> tuple[int, int]:
    """In another process (one process's gRPC channels share a connection): hint 10,000 rows under key 7,
    then withdraw key 5; (rows queued, rows withdrawn)."""
    out = subprocess.run([sys.executable, "-c", _SECOND_CLIENT, target, json.dumps(connect), str(LAYER), "10000",
                          str(SPEC.rows(LAYER))], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    queued, withdrawn = json.loads(out.stdout)
    return queued, withdrawn


def test_a_grpc_client_can_neither_withdraw_another_clients_key_nor_drain_its_rate(tables, tmp_path):  # noqa: F811
    """Two gRPC clients on one host with the shared token: each connection is a client of its own (the
    token names none), so neither reaches the other's key or rate (both were the host's before)."""
    rate = 20_000
    with daemon(tables, tmp_path, *STALLED, "--hint-rows-per-second", str(rate)) as d, \
            EngramClient.connect(d.grpc, token_file=d.token_file) as first:
        mine = _rows(15_000, 2)
        assert first.hint(LAYER, mine, key=5) == len(mine)
        assert first.hint(LAYER, _rows(50_000, 3), key=6) < 50_000  # past its second's worth: cut
        assert _second_client(d.grpc, token_file=d.token_file) == (10_000, 0)  # its own rate; not its key
        assert first.withdraw(5) > len(mine) // 2  # still queued (the reader took a batch at most)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_over_mtls_the_client_is_its_certificate(tables, tmp_path):  # noqa: F811
    """With client certificates, a client is its certificate over all its connections: another process
    with the same certificate shares its quarter of the queue and may withdraw its key; one with another
    certificate neither."""
    ca = _ca(tmp_path, "trusted")
    server = _signed(tmp_path, "server", ca, san="DNS:localhost,IP:127.0.0.1")
    certs = {name: _signed(tmp_path, name, ca) for name in ("engine-a", "engine-b")}
    tls = {name: {"tls_ca": str(ca[1]), "tls_cert": str(cert), "tls_key": str(key)}
           for name, (key, cert) in certs.items()}
    queue_rows = 200_000
    (tmp_path / "run").mkdir()
    d = DaemonProcess(tables.directory, tmp_path / "run", grpc_token=False,
                      dram_bytes=str(90_000 * slot_bytes(SPEC.row_bytes, "s3fifo")),
                      extra=["--store-mode", "cached", "--scrub-bytes-per-second", "0", *STALLED,
                             "--hint-max-queued-rows", str(queue_rows), "--grpc-tls-cert", str(server[1]),
                             "--grpc-tls-key", str(server[0]), "--grpc-tls-client-ca", str(ca[1])])
    with d, EngramClient.connect(f"grpcs://{d.ready['grpc']}", **tls["engine-a"]) as first:
        target = f"grpcs://{d.ready['grpc']}"
        mine = _rows(15_000, 2)
        assert first.hint(LAYER, mine, key=5) == len(mine)
        assert first.hint(LAYER, _rows(50_000, 3), key=6) < 50_000  # the rest of its quarter
        assert _second_client(target, **tls["engine-b"]) == (10_000, 0)  # another client: its own quarter, keys
        queued, withdrawn = _second_client(target, **tls["engine-a"])  # the same client, another connection
        assert queued == 0 and withdrawn > len(mine) // 2


@as_root
def test_one_uids_connections_share_its_quarter_and_another_uid_gets_its_own(tables):  # noqa: F811
    """Five connections of one uid fill one quarter of the queue between them (they filled it all before,
    and another client's hint then queued nothing)."""
    queue_rows = 400_000
    d = _shared_daemon(tables, *STALLED, "--hint-max-queued-rows", str(queue_rows))
    with d:
        clients = [EngramClient.connect(d.unix) for _ in range(5)]
        try:
            queued = sum(c.hint(LAYER, _rows(60_000, 10 + i), key=i) for i, c in enumerate(clients))
            assert queued <= queue_rows // 4  # one client's quarter, not five
            theirs = _rows(10_000, 20)
            assert _as_nobody(d.socket_path, [("hint", theirs, 1)]) == [len(theirs)]
        finally:
            for c in clients:
                c.close()


@as_root
def test_a_key_is_its_uids(tables):  # noqa: F811
    """Another uid sending the same rows under the owner's key gets a hint of its own: its withdraw drops
    only that one, and the owner's withdraw drops all the owner sent (before, the other uid's copy attached
    to the owner's hint and kept it queued after the owner withdrew)."""
    d = _shared_daemon(tables, *STALLED)
    with d, EngramClient.connect(d.unix) as owner:
        rows = _rows(20_000, 30)
        assert owner.hint(LAYER, rows, key=9) == len(rows)
        assert _as_nobody(d.socket_path, [("hint", rows, 9), ("withdraw", 9)]) == [len(rows), len(rows)]
        kept = store_stats(owner)["hint_rows_queued"]
        assert kept > len(rows) // 2  # the owner's hint is still queued
        assert owner.withdraw(9) > len(rows) // 2
        assert store_stats(owner)["hint_rows_queued"] == 0
