"""Security and start-up refusals: socket mode and group, TLS, corrupt or incomplete tables, size caps."""

from __future__ import annotations

import grp
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, expected, make_tables

from engram_store import errors
from engram_store.client.client import EngramClient


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=9)


def test_socket_mode_group_and_size_caps(tables, tmp_path):
    group = grp.getgrgid(os.getgid()).gr_name
    with DaemonProcess(tables.directory, tmp_path, extra=["--socket-mode", "0640", "--socket-group", group,
                                                          "--max-request-rows", "1000"]) as d:
        st = os.stat(d.socket_path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getgid()
        for address in (d.unix, d.grpc):
            with EngramClient.connect(address, reconnect_timeout=0, token_file=d.token_file) as client:
                with pytest.raises(errors.ResourceExhausted, match="1000"):
                    client.lookup(1, np.zeros(1001, np.int64))
                np.testing.assert_array_equal(client.lookup(1, np.arange(1000)), expected(tables, 1, np.arange(1000)))
        with pytest.raises(errors.ResourceExhausted, match="max_client_shm_bytes"):
            EngramClient.connect(d.unix, shm_bytes=4 << 30)


def test_default_socket_mode_is_0660(tables, tmp_path):
    with DaemonProcess(tables.directory, tmp_path) as d:
        assert stat.S_IMODE(os.stat(d.socket_path).st_mode) == 0o660


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_grpc_over_tls(tables, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=120)
    with DaemonProcess(tables.directory, tmp_path, extra=["--grpc-tls-cert", str(cert), "--grpc-tls-key", str(key)]) as d:
        target = d.ready["grpc"]
        with EngramClient.connect(f"grpcs://{target}", tls_ca=str(cert), token_file=d.token_file) as client:
            ids = np.arange(50)
            np.testing.assert_array_equal(client.lookup(3, ids), expected(tables, 3, ids))
        with pytest.raises(errors.Unavailable):  # plaintext against a TLS port never gets an answer
            EngramClient.connect(f"grpc://{target}", connect_timeout=3, token_file=d.token_file)


def test_a_corrupt_page_at_start_is_refused_alone_and_a_missing_checksum_file_stops_the_daemon(tables, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tables.directory, bad)
    layer_file = bad / "layer_001.bin"
    data = bytearray(layer_file.read_bytes())
    data[100] ^= 0xFF  # page 0 of layer 1
    layer_file.write_bytes(bytes(data))
    (tmp_path / "run").mkdir()
    with DaemonProcess(bad, tmp_path / "run") as d, EngramClient.connect(d.unix) as client:
        assert client.info()["bad_pages"] == {"1": [[0, 1]]}
        with pytest.raises(errors.StorageError, match="corrupt page"):
            client.lookup(1, np.arange(3))
        ids = np.arange(200, 300)
        np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))
    (bad / "layer_003.crc").unlink()
    result = subprocess.run([sys.executable, "-m", "engram_store.daemon", "serve", "--tables", str(bad), "--socket",
                             str(tmp_path / "s.sock"), "--grpc", "", "--metrics", ""],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "layer_003.crc: layer 3 page checksum file is missing" in result.stderr, \
        result.stderr
    assert not (tmp_path / "s.sock").exists()


def test_remote_grpc_needs_opt_in_on_the_command_line(tables, tmp_path):
    result = subprocess.run([sys.executable, "-m", "engram_store", "serve", "--tables", str(tables.directory),
                             "--grpc", "0.0.0.0:0"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "grpc_allow_remote" in result.stderr, result.stderr


def test_entry_points_list_the_daemon_commands():
    out = subprocess.run([sys.executable, "-m", "engram_store", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0 and all(c in out.stdout for c in ("serve", "stats", "lookup")), out.stderr
    out = subprocess.run([sys.executable, "-m", "engram_store.daemon", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)  # the daemon's own entry point: serve only (it imports no client code)
    assert out.returncode == 0 and "serve" in out.stdout and "lookup" not in out.stdout, out.stderr
