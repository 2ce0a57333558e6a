"""A process that is not the daemon but listens at its socket path gets nothing from a client or a fetch
job, and gives them nothing (``client.unix_socket.check_peer``: the ``SO_PEERCRED`` uid of the listener).

The impostor is user ``nobody``, listening in a socket directory anyone can write (root's, mode 0777: the
careless operator's), where a real daemon ran or would run. A client refuses it with
``UntrustedDaemon`` naming its pid and uid, having sent nothing; a fetch job whose daemon died and whose
path the impostor took keeps serving exact rows from the table files and never connects to it. Naming
the impostor's user in ``ENGRAM_STORE_DAEMON_UID`` makes the client trust it (the check is the uid, no
more). Root is needed to run a process as ``nobody``.
"""

from __future__ import annotations

import json
import os
import pwd
import select
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import mixed_daemon

from engram_store import errors
from engram_store.client.client import EngramClient
from engram_store.fetch.job import FetchJob
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the impostor as user nobody")
SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
FIRST, CACHED = SPEC.layers
IMPOSTOR = r"""
import json, socket, sys, threading
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(path)
s.listen(64)
print("listening", flush=True)
seen = {"connections": 0, "bytes": 0}
def serve():
    while True:
        conn, _ = s.accept()
        seen["connections"] += 1
        print("accepted", flush=True)
        conn.settimeout(1.0)
        try:
            while data := conn.recv(65536):
                seen["bytes"] += len(data)
        except OSError:
            pass
        conn.close()
threading.Thread(target=serve, daemon=True).start()
sys.stdin.read()
print(json.dumps(seen), flush=True)
"""


@pytest.fixture
def shared_dir():
    directory = tempfile.mkdtemp(prefix="engram-store-loose-")
    os.chmod(directory, 0o777)  # root's, writable by anyone
    try:
        yield directory
    finally:
        subprocess.run(["rm", "-rf", directory], check=False)


class Impostor:
    def __init__(self, path: str) -> None:
        nobody = pwd.getpwnam("nobody")
        self.uid = nobody.pw_uid
        self.proc = subprocess.Popen(["/usr/bin/python3", "-c", IMPOSTOR, path], user=nobody.pw_uid,
                                     group=nobody.pw_gid, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "listening"

    def wait_accepted(self, timeout: float) -> bool:
        """Whether a connection came within ``timeout`` seconds."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return bool(ready) and self.proc.stdout.readline().strip() == "accepted"

    def stop(self) -> dict:
        self.proc.stdin.close()
        lines = self.proc.stdout.read().splitlines()
        self.proc.wait(timeout=30)
        return json.loads(lines[-1])


def test_a_client_refuses_a_listener_of_another_user_and_sends_it_nothing(shared_dir, monkeypatch):
    path = os.path.join(shared_dir, "engram-store.sock")
    impostor = Impostor(path)
    try:
        with pytest.raises(errors.UntrustedDaemon) as refused:
            EngramClient.connect(f"unix://{path}", connect_timeout=2.0)
        assert f"pid {impostor.proc.pid}" in str(refused.value) and f"uid {impostor.uid}" in str(refused.value)
        monkeypatch.setenv("ENGRAM_STORE_DAEMON_UID", "nobody")  # trusted by name: the handshake is tried
        with pytest.raises(errors.Unavailable) as tried:
            EngramClient.connect(f"unix://{path}", connect_timeout=2.0)
        assert not isinstance(tried.value, errors.UntrustedDaemon), tried.value
    finally:
        seen = impostor.stop()
    assert seen["connections"] == 2 and seen["bytes"] > 0, seen  # only the trusted attempt sent a HELLO


def test_a_fetch_job_never_takes_rows_from_an_impostor_at_its_daemons_path(shared_dir, tmp_path):
    directory = tmp_path / "tables"
    write_synthetic(directory, SPEC, seed=5)
    tables = TableSet.open(directory)
    d = mixed_daemon(directory, Path(shared_dir)).start()
    job = FetchJob(d.unix, CACHED, 512, deadline=0.5, hedge=0.2)
    impostor = None
    try:
        d.kill()
        os.unlink(d.socket_path)
        impostor = Impostor(d.socket_path)
        met = False  # a reconnect round met the impostor (the job reconnects in the background)
        step = 0
        deadline = time.monotonic() + 60
        while not met or step < 5:
            assert time.monotonic() < deadline, "the job never tried the impostor's socket"
            ids = np.random.default_rng(step).integers(0, SPEC.rows(CACHED), 512)
            job.ids[: ids.size] = ids
            job.run(ids.size)
            job.raise_if_failed()
            want = tables.read_rows(CACHED, ids)
            np.testing.assert_array_equal(job.weight[:512], want[:, : SPEC.row_format.dim])
            np.testing.assert_array_equal(job.scales[:512], want[:, SPEC.row_format.dim:])
            assert not job.connected
            step += 1
            met = met or impostor.wait_accepted(0.1)
    finally:
        job.close()
        seen = impostor.stop() if impostor is not None else None
        d.stop()
    assert seen["connections"] >= 1 and seen["bytes"] == 0, seen
