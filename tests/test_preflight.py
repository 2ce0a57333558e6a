"""Preflight, played for real: a second daemon on a live socket, a ``dram_bytes`` the host
cannot hold, warm-up profiles that are not profiles, the clients' own variables in the
daemon's environment; then the memory-limit discovery on made-up /proc and cgroup trees.

Refusals must come before any table byte is read: the big table sets here are sparse files
with no page checksums, so a daemon that got past preflight would stop at "page checksum
file is missing" instead (and never fill 189 GiB)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess, daemon_command, expected, make_tables, make_token_file

from engram_store.client.client import EngramClient
from engram_store.daemon import host
from engram_store.daemon.config import CLIENT_ENV, KEYS, DaemonConfig, read_env
from engram_store.daemon.preflight import preflight
from engram_store.daemon.service import open_store
from engram_store.format.layout import PageLayout
from engram_store.format.manifest import MANIFEST, LayerEntry, Manifest, crc_file_name, layer_file_name
from engram_store.models.spec import get_spec
from engram_store.storage.profile import write_profile

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("preflight") / "tiny", seed=5)


@pytest.fixture(scope="module")
def v41_sparse(tmp_path_factory) -> Path:
    """A full-size V4.1 table set's manifest over sparse data files (no bytes on disk) and no page
    checksum files: 189 GiB that preflight must weigh without reading."""
    d = tmp_path_factory.mktemp("v41") / "tables"
    d.mkdir()
    spec = get_spec("deepseek-v4.1-flash")
    entries = []
    for layer in spec.layers:
        layout = PageLayout(spec.rows(layer), spec.row_bytes)
        with open(d / layer_file_name(layer), "wb") as f:
            f.truncate(layout.file_bytes)
        entries.append(LayerEntry(layer, layout.rows, layout.row_bytes, layer_file_name(layer), layout.file_bytes,
                                  crc_file_name(layer)))
    (d / MANIFEST).write_text(Manifest(spec, tuple(entries)).to_json())
    return d


def _serve(tables: Path, workdir: Path, *flags: str, socket_path: str | None = None,
           preexec=None) -> tuple[int, str, float]:
    args = daemon_command() + ["serve", "--tables", str(tables), "--socket", socket_path or str(workdir / "s.sock"),
                               "--grpc", "", "--metrics", "", "--log-level", "INFO", *flags]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    t0 = time.monotonic()
    p = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=preexec)
    try:
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # got past preflight and serves: the test has failed, stop it
            p.kill()
            p.wait()
    return p.returncode, err, time.monotonic() - t0


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


# --- the socket ---------------------------------------------------------------------------------------
def test_a_second_daemon_on_a_live_socket_is_refused_at_once_without_an_arena(tables, tmp_path):
    (tmp_path / "a").mkdir()
    with DaemonProcess(tables.directory, tmp_path / "a", extra=["--store-mode", "resident"]) as first:
        code, err, seconds = _serve(tables.directory, tmp_path, "--store-mode", "resident",
                                    socket_path=first.socket_path)
        assert code == 2 and seconds < 2, (code, seconds, err)
        assert re.search(rf"'socket': .* is served by process {first.pid} \(it accepts connections\)",
                         _error_line(err)), err
        assert "resident arena" not in err and "opened" not in err  # no table opened, no arena built
        with EngramClient.connect(first.unix) as client:  # the first one's socket is intact
            ids = np.arange(0, tables.rows(1), 97)
            np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))


def test_a_stale_socket_is_replaced_and_the_clients_variables_are_allowed(tables, tmp_path):
    (tmp_path / "run").mkdir()
    d = DaemonProcess(tables.directory, tmp_path / "run")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(d.socket_path)  # a killed daemon's socket file: nobody listens
    stale.close()
    # an engine pod's environment: the plugins' address and the clients' token file
    d.env = {"ENGRAM_STORE_ADDR": "unix:///run/engram-store/engram-store.sock",
             "ENGRAM_STORE_GRPC_TOKEN_FILE": str(make_token_file(tmp_path / "client.token"))}
    with d, EngramClient.connect(d.unix) as client:
        ids = np.arange(100, 200)
        np.testing.assert_array_equal(client.lookup(3, ids), expected(tables, 3, ids))


def test_every_variable_the_clients_read_is_allowed_in_the_daemons_environment():
    names = set()
    for folder in ("engram_store/client", "engram_store/integrations", "gpu_client"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"\bENGRAM_STORE_[A-Z][A-Z0-9_]*\b", path.read_text()))
    assert {"ENGRAM_STORE_ADDR", "ENGRAM_STORE_GRPC_TOKEN_FILE"} <= names
    daemon_keys = {"ENGRAM_STORE_" + k.upper() for k in KEYS}
    assert names <= daemon_keys | CLIENT_ENV, names - daemon_keys - CLIENT_ENV
    values = read_env({name: "unix:///x.sock" if name in CLIENT_ENV else "/etc/engram/grpc.token"
                       for name in names if name not in daemon_keys or name.endswith("_FILE")})
    assert values == {"grpc_token_file": "/etc/engram/grpc.token"}  # a daemon key keeps its meaning
    with pytest.raises(Exception, match="ENGRAM_STORE_ADRR"):
        read_env({"ENGRAM_STORE_ADRR": "x"})  # a typo is still refused


# --- memory ---------------------------------------------------------------------------------------
def test_a_dram_bytes_beyond_memavailable_is_refused_naming_it(v41_sparse, tmp_path):
    code, err, seconds = _serve(v41_sparse, tmp_path, "--dram-bytes", "200GiB", "--store-mode", "resident")
    line = _error_line(err)
    assert code == 2 and seconds < 10, (code, seconds, err)
    m = re.search(r"'dram_bytes': 214748364800 bytes make the placement 1=resident,14=resident allocate (\d+) bytes "
                  r"\(resident arena (\d+),.*MemAvailable leaves (\d+)", line)
    assert m and int(m.group(1)) > int(m.group(2)) > 180 << 30 > int(m.group(3)), line
    assert "checksum file is missing" not in err


def _memory_cgroup_v1() -> Path | None:
    """This process's v1 memory cgroup directory, when one is mounted and writable."""
    for directory, top, version in host._memory_cgroups(Path("/proc")):
        if version == 1 and os.access(directory, os.W_OK):
            return directory
    return None


def test_a_dram_bytes_beyond_the_cgroup_limit_is_refused_naming_it(v41_sparse, tmp_path):
    parent = _memory_cgroup_v1()
    if parent is None:
        pytest.skip("no writable cgroup v1 memory hierarchy here (the parsing is tested on made-up trees below)")
    group = parent / f"engram-preflight-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(512 << 20))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup: {exc}")

    def enter() -> None:  # in the child, before exec: the daemon runs inside the 512 MiB group
        (group / "cgroup.procs").write_text(str(os.getpid()))

    try:
        code, err, _ = _serve(v41_sparse, tmp_path, "--dram-bytes", "4GiB", "--store-mode", "cached", preexec=enter)
    finally:
        group.rmdir()
    line = _error_line(err)
    assert code == 2 and "cgroup memory.limit_in_bytes leaves" in line and "memory.limit_in_bytes 536870912" in line, err
    assert "MemAvailable" not in line  # the host has room; the cgroup does not


def _fake_proc(tmp_path: Path, cgroup: str, mountinfo: list[str], meminfo_kb: int = 8 << 20) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {meminfo_kb * 2} kB\nMemAvailable: {meminfo_kb} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    return proc


def test_memory_limits_of_a_cgroup_v2_tree_take_the_tightest_ancestor(tmp_path):
    root = tmp_path / "cg2"
    (root / "pods" / "engram").mkdir(parents=True)
    (root / "pods" / "memory.max").write_text(f"{1 << 30}\n")
    (root / "pods" / "memory.current").write_text(f"{900 << 20}\n")
    (root / "pods" / "engram" / "memory.max").write_text("max\n")
    (root / "pods" / "engram" / "memory.current").write_text(f"{100 << 20}\n")
    proc = _fake_proc(tmp_path, "0::/pods/engram\n",
                      [f"30 23 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"])
    limits = host.memory_limits(proc)
    assert [(lim.name, lim.available) for lim in limits] == [
        ("MemAvailable", 8 << 30), ("cgroup memory.max", (1 << 30) - (900 << 20))]
    assert limits[1].where == str(root / "pods" / "memory.max")


def test_memory_limits_of_a_cgroup_v1_tree_in_a_container(tmp_path):
    root = tmp_path / "memory"
    (root / "kubepods").mkdir(parents=True)
    (root / "kubepods" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (root / "kubepods" / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    (root / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit, as v1 writes it
    (root / "memory.usage_in_bytes").write_text("5\n")
    # the mount's root is the container's own cgroup path; /proc/self/cgroup shows the full path
    proc = _fake_proc(tmp_path, "12:cpu,cpuacct:/kubepods\n4:memory:/kubepods\n0::/\n",
                      [f"35 31 0:32 /kubepods {root / 'kubepods'} rw,relatime - cgroup cgroup rw,memory",
                       f"33 31 0:30 / {tmp_path / 'cpu'} rw,relatime - cgroup cgroup rw,cpu,cpuacct"])
    limits = host.memory_limits(proc)
    assert [(lim.name, lim.available) for lim in limits] == [
        ("MemAvailable", 8 << 30), ("cgroup memory.limit_in_bytes", 1 << 30)]


def test_the_socket_probe_tells_live_stale_and_foreign_paths_apart(tmp_path):
    path = str(tmp_path / "s.sock")
    assert host.probe_socket(path) is None
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    assert host.probe_socket(path) is None  # bound, not listening: stale
    live.listen(1)
    assert host.probe_socket(path) == os.getpid()
    live.close()
    assert host.probe_socket(path) is None
    (tmp_path / "plain").write_text("x")
    with pytest.raises(OSError, match="not a socket"):
        host.probe_socket(str(tmp_path / "plain"))


# --- warm-up profiles ----------------------------------------------------------------------------------
def _header_only(path: Path, rows: int) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (rows, 2)})
        f.write(np.zeros(8, "<i8").tobytes())


def test_each_bad_profile_stops_serve_at_once(tables, tmp_path):
    np.savez(tmp_path / "hot.npz", pairs=np.array([[1, 5]], dtype=np.int64))
    _header_only(tmp_path / "huge.npy", 4_000_000_000)  # 59.6 GiB claimed, 64 bytes there
    os.mkfifo(tmp_path / "fifo.npy")  # no writer: opening it for reading would wait for ever
    cases = {"hot.npz": r"is a zip archive \(an \.npz\?\)",
             "huge.npy": r"its header says 4000000000 pairs \(64000000000 bytes of data\), the file holds 64",
             "fifo.npy": r"is a FIFO; expected a regular \.npy file"}
    for name, words in cases.items():
        code, err, seconds = _serve(tables.directory, tmp_path, "--store-mode", "cached", "--dram-bytes", "256KiB",
                                    "--warmup-profile", str(tmp_path / name))
        assert code == 2 and seconds < 2, (name, code, seconds, err)
        line = _error_line(err)
        assert re.search(rf"'warmup_profile': access profile {tmp_path / name}.*{words}", line), (name, line)
        assert "Traceback" not in err


def test_the_profile_is_read_once_and_only_as_far_as_the_cache_holds(tables, tmp_path):
    pairs = np.stack([np.full(200_000, 1), np.arange(200_000) % tables.rows(1)], axis=1)
    path = tmp_path / "hot.npy"
    write_profile(path, pairs)
    config = DaemonConfig(tables=str(tables.directory), socket="", metrics="", store_mode="cached",
                          dram_bytes=256 << 10, warmup_profile=str(path))
    checked = preflight(config)
    assert 0 < len(checked.warmup) < 10_000  # the cache's slots, not the file's 200,000 pairs
    np.testing.assert_array_equal(checked.warmup, pairs[: len(checked.warmup)])
    path.unlink()  # the store warms up from what preflight read: the file is not opened again
    store = open_store(config, checked.warmup)
    try:
        assert store.stats()["cache_slots_used"] > 0
    finally:
        store.close()


def test_a_fill_error_surfaces_as_itself(tables):
    from engram_store.storage.resident import ResidentArena
    from engram_store.storage.tiered import TieredStore

    with TieredStore.open(tables.directory, dram_bytes=256 << 10, mode="cached") as store:
        files = [store.parts.files[layer] for layer in store.layers]

        def bulk_read(lf, offset, nbytes, buf):
            raise ValueError("a bug in a bulk reader")  # not a StorageError: nothing to retry

        with pytest.raises(ValueError, match="a bug in a bulk reader"):
            ResidentArena.build(files, store.spec.row_format, bulk_read)
