"""Errors first: every late config mistake stops ``serve`` before a table byte is read, and
``synth``/``import`` on a full disk end in one line and leave nothing.

The daemon is pointed at a *decoy* table set: a real manifest whose layer files have the
right sizes but hold zeros, and no page checksum files. Any daemon past its config checks
fails opening it with "page checksum file is missing" (the control case shows it), so a
run that stops naming the config key instead stopped first.
"""

from __future__ import annotations

import grp
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import REPO, daemon_command, make_tables, make_token_file

from engram_store import errors
from engram_store.format import writer
from engram_store.format.manifest import MANIFEST
from engram_store.models.spec import get_spec
from engram_store.tools.importer import output_bytes
from engram_store.tools.synth import write_synthetic


@pytest.fixture(scope="module")
def decoy(tmp_path_factory) -> Path:
    real = make_tables(tmp_path_factory.mktemp("tables") / "tiny")
    decoy = tmp_path_factory.mktemp("decoy") / "tiny"
    decoy.mkdir()
    shutil.copy(real.directory / MANIFEST, decoy / MANIFEST)
    for e in real.manifest.layers:
        with open(decoy / e.file, "wb") as f:
            f.truncate(e.file_bytes)  # sparse zeros: the right size, the wrong bytes
    return decoy


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("files")
    out = {"token": str(make_token_file(d / "grpc.token"))}
    open_token = d / "open.token"
    open_token.write_text("x" * 40)
    open_token.chmod(0o644)
    out["open_token"] = str(open_token)
    (d / "not-a-dir").write_text("a file")
    out["under_a_file"] = str(d / "not-a-dir" / "engram.sock")
    (d / "bad.npy").write_bytes(b"not numpy")
    out["bad_profile"] = str(d / "bad.npy")
    np.save(d / "other.npy", np.array([[7, 0]], dtype=np.int64))  # layer 7 is not in the tiny table set
    out["other_profile"] = str(d / "other.npy")
    (d / "float.toml").write_text("dram_bytes = 8.5\n")
    out["float_toml"] = str(d / "float.toml")
    if shutil.which("openssl"):
        for name in ("a", "b"):
            _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                     "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.pem"))
        out |= {"cert_a": str(d / "a.pem"), "key_b": str(d / "b.key")}
    return out


def _cases(files: dict[str, str], busy: int) -> dict[str, tuple[list[str], str]]:
    """name -> (serve flags, the words the one error line must hold)."""
    grpc = ["--grpc", "127.0.0.1:0", "--grpc-token-file", files["token"]]
    cases = {
        "toml float": (["--config", files["float_toml"]], "dram_bytes.*TOML float"),
        "dram_bytes": (["--dram-bytes", "8"], "'dram_bytes'.*at least"),
        "cache_policy": (["--cache-policy", "fifo"], "'cache_policy'"),
        "nvme_queue_depth": (["--nvme-queue-depth", "257"], "'nvme_queue_depth'.*1..256"),
        "resident does not fit": (["--store-mode", "resident", "--dram-bytes", "1MiB"], "'dram_bytes'.*resident"),
        "grpc port in use": (["--grpc", f"127.0.0.1:{busy}", "--grpc-token-file", files["token"]],
                             "'grpc'.*cannot listen"),
        "metrics port in use": (["--metrics", f"127.0.0.1:{busy}"], "'metrics'.*cannot listen"),
        "socket_group": (["--socket-group", "no-such-group-engram"], "'socket_group'"),
        "socket directory": (["--socket", files["under_a_file"]], "'socket'.*cannot create"),
        "tls files missing": (grpc + ["--grpc-tls-cert", "/nonexistent.pem", "--grpc-tls-key", "/nonexistent.key"],
                              "'grpc_tls_cert'.*does not exist"),
        "warmup_profile missing": (["--warmup-profile", "/nonexistent.npy"], "'warmup_profile'"),
        "warmup_profile garbage": (["--warmup-profile", files["bad_profile"]], "'warmup_profile'"),
        "warmup_profile layers": (["--warmup-profile", files["other_profile"]], "'warmup_profile'.*layers"),
        "max_request_rows": (["--max-request-rows", str(1 << 40)], "'max_request_rows'.*at most"),
        "token file missing": (["--grpc", "127.0.0.1:0", "--grpc-token-file", "/nonexistent.token"],
                               "'grpc_token_file'.*cannot read"),
        "token file open to all": (["--grpc", "127.0.0.1:0", "--grpc-token-file", files["open_token"]],
                                   "'grpc_token_file'.*every user"),
        "grpc without client auth": (["--grpc", "127.0.0.1:0"], "grpc_token_file.*grpc_tls_client_ca"),
        "plaintext remote grpc": (["--grpc", "0.0.0.0:0", "--grpc-allow-remote", "--grpc-token-file", files["token"]],
                                  "plaintext remote"),
        "remote metrics": (["--metrics", "0.0.0.0:0"], "metrics_allow_remote"),
    }
    if "cert_a" in files:
        cases["tls cert and key do not match"] = (grpc + ["--grpc-tls-cert", files["cert_a"], "--grpc-tls-key",
                                                          files["key_b"]], "'grpc_tls_cert'.*private key")
    return cases


def _serve(tables: Path, workdir: Path, flags: list[str]) -> subprocess.Popen:
    args = daemon_command() + ["serve", "--tables", str(tables), "--socket", str(workdir / "s.sock"), "--grpc", "",
                               "--metrics", "", "--log-level", "WARNING", *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_every_late_config_error_stops_before_the_tables_are_read(decoy, files, tmp_path):
    busy = _listening()
    try:
        cases = _cases(files, busy.getsockname()[1])
        t0 = time.monotonic()
        procs = {}
        for i, (name, (flags, _)) in enumerate(cases.items()):
            (tmp_path / str(i)).mkdir()
            procs[name] = _serve(decoy, tmp_path / str(i), flags)
        results = {name: (p.wait(60), p.communicate()[1]) for name, p in procs.items()}
        elapsed = time.monotonic() - t0
    finally:
        busy.close()
    for name, (flags, words) in cases.items():
        code, stderr = results[name]
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2, (name, code, stderr)
        assert "checksum file is missing" not in stderr and "Traceback" not in stderr, (name, stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(words, lines[0]), (name, stderr)
    assert elapsed < 30, elapsed  # all of them at once: each one a process start, no table pass


def test_the_decoy_is_read_when_the_config_is_right(decoy, tmp_path):
    """The control: with nothing wrong in the config the daemon reads the decoy and says so."""
    p = _serve(decoy, tmp_path, [])
    code, stderr = p.wait(60), p.communicate()[1]
    assert code == 2 and "page checksum file is missing" in stderr, stderr


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                            text=True, timeout=30)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small"
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    _mount_tmpfs(mount, "1M")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30)


def test_synth_on_a_full_disk_is_one_line_and_leaves_nothing(small_fs):
    need = writer.space_needed(get_spec("tiny"))  # data, page checksums and manifest
    assert need > output_bytes(get_spec("tiny")) + writer.MANIFEST_ALLOWANCE > 1 << 20  # the tiny table set cannot fit 1 MiB
    out = small_fs / "tables"
    result = subprocess.run([sys.executable, "-m", "engram_store", "synth", "--model", "tiny", "--out", str(out)],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert str(small_fs) in lines[0] and f"needs {need} bytes" in lines[0], lines[0]
    assert os.listdir(small_fs) == []


def test_running_out_of_space_while_writing_removes_the_temp_dir(small_fs, monkeypatch):
    monkeypatch.setattr(writer, "free_bytes", lambda path: 1 << 40)  # the check passes; the disk fills anyway
    with pytest.raises(errors.InsufficientSpace, match="no space left") as info:
        write_synthetic(small_fs / "tables", get_spec("tiny"), seed=1)
    assert "\n" not in str(info.value) and str(small_fs) in str(info.value)
    assert os.listdir(small_fs) == []


def test_a_published_table_set_is_readable_by_its_group(tmp_path):
    group = grp.getgrgid(os.getgid()).gr_name
    old = os.umask(0o077)  # a strict umask must not make the set unreadable to the daemon's group
    try:
        write_synthetic(tmp_path / "tables", get_spec("tiny"), seed=2, group=group)
    finally:
        os.umask(old)
    top = tmp_path / "tables"
    assert stat.S_IMODE(top.stat().st_mode) == writer.DIR_MODE == 0o750
    for path in top.iterdir():
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == writer.FILE_MODE == 0o640 and st.st_gid == os.getgid(), path
    with pytest.raises(errors.TableFormatError, match="no-such-group"):
        write_synthetic(tmp_path / "other", get_spec("tiny"), group="no-such-group-engram")
    assert not (tmp_path / "other").exists()
