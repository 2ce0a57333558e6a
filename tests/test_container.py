"""The daemon's container image, run as an operator runs it: tables and the socket directory
mounted, a lookup through the mounted socket, the probes, a clean stop.

Run by ``make image-test`` (which builds the image with podman and names it in
ENGRAM_STORE_TEST_IMAGE); skipped otherwise. Needs root here: the table files and the socket
directory are handed to the image's user (uid/gid 10001), as the deploy docs ask of an operator.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import urllib.request

import numpy as np
import pytest

from support.daemon_helpers import make_tables, wait_ready_file
from engram_store.client import EngramClient
from engram_store.version import __version__

IMAGE = os.environ.get("ENGRAM_STORE_TEST_IMAGE", "")
PODMAN = shlex.split(os.environ.get("ENGRAM_STORE_TEST_PODMAN", "podman --runtime runc"))
# This sandbox's hard limits are below podman's defaults: run with explicit ones.
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
UID = GID = 10001

pytestmark = [
    pytest.mark.skipif(not IMAGE, reason="no image to test: `make image-test` builds one and runs this"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand the tables and socket directory to uid 10001"),
]


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)


def _in_image(*cmd: str) -> str:
    result = _podman("run", "--rm", *LIMITS, "--network", "none", "--entrypoint", cmd[0], IMAGE, *cmd[1:])
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_image_is_non_root_without_a_compiler_and_knows_its_version():
    config = json.loads(_podman("image", "inspect", IMAGE).stdout)[0]["Config"]
    assert config["User"] == f"{UID}:{GID}"
    assert config["Entrypoint"] == ["/opt/engram-store/bin/engram-store"]
    assert {"/var/lib/engram-store", "/run/engram-store"} <= set(config.get("Volumes") or {})
    assert _in_image("/opt/engram-store/bin/engram-store", "--version").strip() == f"engram-store {__version__}"
    found = _in_image("/bin/sh", "-c", "for c in gcc cc; do command -v $c; done; id -u; id -g; "
                      "test -f /etc/engram-store/engram-store.toml && echo config").split()
    assert found == [str(UID), str(GID), "config"], found  # no compiler; the daemon's ids; the shipped config


def test_container_serves_a_lookup_through_the_mounted_socket(tmp_path):
    tables = make_tables(tmp_path / "tables", seed=9)
    for path in (tmp_path / "tables", *(tmp_path / "tables").iterdir()):
        os.chown(path, 0, GID)  # published for the daemon's group, as `--group engram-store` does
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    os.chown(run, UID, GID)  # what tmpfiles.d / the Kubernetes init container do
    name = f"engram-store-test-{os.getpid()}"
    proc = subprocess.Popen(
        # the DaemonSet's securityContext: read-only root, no capabilities, no privilege escalation
        [*PODMAN, "run", "--rm", "--name", name, *LIMITS, "--network", "host", "--read-only", "--cap-drop", "ALL",
         "--security-opt", "no-new-privileges",
         "-v", f"{tmp_path / 'tables'}:/var/lib/engram-store/tables:ro", "-v", f"{run}:/run/engram-store",
         "-e", "ENGRAM_STORE_DRAM_BYTES=256MiB", "-e", "ENGRAM_STORE_METRICS=127.0.0.1:0",
         "-e", "ENGRAM_STORE_READY_FILE=/run/engram-store/ready.json", "-e", "ENGRAM_STORE_HUGE_PAGES=false",
         IMAGE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready = run / "ready.json"
        info = wait_ready_file(proc, ready, lambda: proc.stdout.read())
        assert info["socket"] == "/run/engram-store/engram-store.sock" and info["mode"] == "resident"
        sock = run / "engram-store.sock"
        st = sock.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (UID, GID, 0o660)
        for path, status in (("/livez", 200), ("/readyz", 200)):
            with urllib.request.urlopen(f"http://{info['metrics']}{path}", timeout=30) as r:
                assert r.status == status
        rng = np.random.default_rng(1)
        with EngramClient.connect(f"unix://{sock}") as client:
            for layer in tables.layers:
                ids = rng.integers(0, tables.rows(layer), size=(4, 6))
                got = client.lookup(layer, ids)
                assert np.array_equal(got, tables.read_rows(layer, ids.reshape(-1)).reshape(got.shape))
        stop = _podman("stop", "--time", "30", name)
        assert stop.returncode == 0, stop.stderr
        assert proc.wait(60) == 0, proc.stdout.read()
        assert not ready.exists()  # removed at stop
    finally:
        if proc.poll() is None:
            _podman("rm", "--force", name)
            proc.kill()
            proc.wait()
        tables.close()
