"""A client's staging (one host copy) from a hostile client's side, over the raw protocol, against a real
daemon on its native and Python paths: every memfd or geometry the daemon cannot write safely is
refused with a typed error naming what is wrong (the connection and the daemon go on serving), a
sealed staging cannot be shrunk under the daemon, Flag.SPLIT lookups are checked (rows, ids, dtype,
the gate) and write nothing when refused, and other clients keep getting exact rows throughout."""

from __future__ import annotations

import mmap
import os
import socket

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, raw_connect, read_result

from engram_store.client.client import EngramClient
from engram_store.native import shm, syscalls
from engram_store.models.spec import get_spec
from engram_store.storage.resident import resident_layout
from engram_store.wire import frames as wire
from engram_store.wire import staging as wst

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
FIRST, CACHED = SPEC.layers
DIM, SB = SPEC.row_format.dim, SPEC.row_bytes - SPEC.row_format.dim
ROWS = 512
GEOMETRY = wst.StagingGeometry(DIM, SB, ROWS, 0, ROWS * DIM, ROWS * SPEC.row_bytes)
SIZE = GEOMETRY.gate_offset + 4096
SEALED = syscalls.F_SEAL_SHRINK | syscalls.F_SEAL_GROW | syscalls.F_SEAL_SEAL


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=41)


@pytest.fixture(scope="module", params=["native", "python"])
def daemon(request, tables, tmp_path_factory):
    dram = resident_layout([(FIRST, SPEC.rows(FIRST))], SPEC.row_format).size + (2 << 20)
    d = DaemonProcess(tables.directory, tmp_path_factory.mktemp("d"), dram_bytes=str(dram),
                      extra=["--placement", f"{FIRST}=resident,{CACHED}=cached",
                             *(["--no-unix-native"] if request.param == "python" else [])]).start()
    try:
        yield d
    finally:
        d.stop()


class Raw:
    """A hand-made client connection: its socket and its shared region."""

    def __init__(self, d: DaemonProcess) -> None:
        self.sock, frame, _, fds = raw_connect(d.socket_path)
        try:
            self.region = np.frombuffer(mmap.mmap(fds[0], frame.count, mmap.MAP_SHARED,
                                                  mmap.PROT_READ | mmap.PROT_WRITE), np.uint8)
        finally:
            for fd in fds:
                os.close(fd)
        self.rid = 0

    def staging(self, fds: list[int], payload: bytes = GEOMETRY.pack()) -> tuple[wire.Frame, str]:
        self.rid += 1
        self.sock.sendall(wire.Frame(wire.Op.STAGING, self.rid).pack(payload)[: wire.FRAME.size])
        if fds:
            shm.send_with_fds(self.sock, payload, fds)
        else:
            self.sock.sendall(payload)
        frame, message = read_result(self.sock)
        return frame, message.decode()

    def split_lookup(self, layer: int, ids: np.ndarray, first_row: int = 0, dtype=wire.DType.INT64,
                     gate: np.ndarray | None = None) -> tuple[wire.Frame, str]:
        self.rid += 1
        raw = np.ascontiguousarray(ids, dtype=wire.DType(dtype).numpy).view(np.uint8)
        self.region[: raw.size] = raw
        if gate is not None:  # what a fetch job does first
            gate[0] = (self.rid & 0x3FFFFFFF) << 2 | wst.GATE_OPEN
        self.sock.sendall(wire.Frame(wire.Op.LOOKUP, self.rid, dtype=dtype, flags=wire.Flag.SPLIT, layer=layer,
                                     count=len(ids), ids_offset=0, out_offset=first_row).pack())
        frame, message = read_result(self.sock)
        return frame, message.decode()

    def info_works(self) -> bool:
        self.rid += 1
        self.sock.sendall(wire.Frame(wire.Op.INFO, self.rid).pack())
        frame, payload = read_result(self.sock)
        return frame.status == wire.Status.OK and b"layers" in payload

    def close(self) -> None:
        self.sock.close()


def memfd(size: int = SIZE, seals: int = SEALED) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        syscalls.add_seals(fd, seals)
    return fd


def others_get_exact_rows(d: DaemonProcess, tables) -> None:
    ids = np.random.default_rng(5).integers(0, SPEC.rows(CACHED), 300)
    with EngramClient.connect(d.unix) as client:
        np.testing.assert_array_equal(client.lookup(CACHED, ids), tables.read_rows(CACHED, ids))
    assert d.proc.poll() is None


def with_geometry(**change) -> bytes:
    fields = dict(GEOMETRY.__dict__) | change
    return wst.StagingGeometry(**fields).pack()


def huge_memfd() -> int:
    try:
        fd = os.memfd_create("hostile-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
        os.ftruncate(fd, 2 << 20)
        syscalls.add_seals(fd, SEALED)
    except OSError as exc:
        pytest.skip(f"no huge-page memfd on this host ({exc})")
    return fd


def tmp_file_fd(tmp_path) -> int:
    path = tmp_path / "not-a-memfd"
    path.write_bytes(b"\0" * SIZE)
    return os.open(path, os.O_RDWR)


REFUSED = [  # (name, fds maker, payload, message)
    ("unsealed", lambda t: [memfd(seals=0)], GEOMETRY.pack(), "sealed against shrinking and growing"),
    ("grow only", lambda t: [memfd(seals=syscalls.F_SEAL_GROW)], GEOMETRY.pack(), "sealed against shrinking"),
    ("write sealed", lambda t: [memfd(seals=SEALED | syscalls.F_SEAL_WRITE)], GEOMETRY.pack(),
     "sealed against writes"),
    ("future write sealed", lambda t: [memfd(seals=syscalls.F_SEAL_SHRINK | syscalls.F_SEAL_GROW |
                                             syscalls.F_SEAL_FUTURE_WRITE)], GEOMETRY.pack(), "sealed against writes"),
    ("too small", lambda t: [memfd(size=GEOMETRY.gate_offset)], GEOMETRY.pack(), "its geometry needs"),
    ("a pipe", lambda t: [os.pipe()[0]], GEOMETRY.pack(), "not a sealable memfd"),
    ("huge pages", lambda t: [huge_memfd()], GEOMETRY.pack(), "only ordinary pages"),
    ("a regular file", lambda t: [tmp_file_fd(t)], GEOMETRY.pack(), "memfd"),
    ("no fd", lambda t: [], GEOMETRY.pack(), "one memfd, got 0"),
    ("two fds", lambda t: [memfd(), memfd()], GEOMETRY.pack(), "one memfd, got 2"),
    ("another row format", lambda t: [memfd()], with_geometry(weight_bytes=128), "this daemon's rows are 256 + 8"),
    ("overlapping blocks", lambda t: [memfd()], with_geometry(scale_offset=64), "overlap"),
    ("no rows", lambda t: [memfd()], with_geometry(rows=0), "0 rows"),
    ("a misaligned gate", lambda t: [memfd()], with_geometry(gate_offset=ROWS * SPEC.row_bytes + 4), "aligned"),
    ("a short payload", lambda t: [memfd()], GEOMETRY.pack()[:-8], "STAGING payload is"),
    ("another version", lambda t: [memfd()], b"\x09\x00" + GEOMETRY.pack()[2:], "staging version 9"),
]


@pytest.mark.parametrize("name, make, payload, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_staging_the_daemon_cannot_write_safely_is_refused(daemon, tables, tmp_path, name, make, payload, message):
    raw = Raw(daemon)
    fds = make(tmp_path)
    try:
        frame, text = raw.staging(fds, payload)
        assert frame.status == wire.Status.INVALID_ARGUMENT and message in text, (frame, text)
        assert raw.info_works()  # the connection goes on
        frame, text = raw.split_lookup(CACHED, np.arange(4))
        assert frame.status == wire.Status.INVALID_ARGUMENT and "send STAGING first" in text, text
    finally:
        raw.close()
        for fd in fds:
            os.close(fd)
    others_get_exact_rows(daemon, tables)


def test_more_fds_than_one_end_that_connection_only(daemon, tables):
    raw = Raw(daemon)
    fds = [memfd() for _ in range(3)]
    try:
        raw.rid += 1
        raw.sock.sendall(wire.Frame(wire.Op.STAGING, raw.rid).pack(GEOMETRY.pack())[: wire.FRAME.size])
        shm.send_with_fds(raw.sock, GEOMETRY.pack(), fds)
        raw.sock.settimeout(10)
        assert raw.sock.recv(1) == b""  # closed
    finally:
        raw.close()
        for fd in fds:
            os.close(fd)
    others_get_exact_rows(daemon, tables)


@pytest.mark.parametrize("layer", [CACHED, FIRST], ids=["cached", "resident"])
def test_split_lookups_are_checked_and_write_nothing_when_refused(daemon, tables, layer):
    raw = Raw(daemon)
    fd = memfd()
    staging = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    whole = np.frombuffer(staging, np.uint8)
    weights = whole[: ROWS * DIM].reshape(ROWS, DIM)
    scales = whole[ROWS * DIM: ROWS * SPEC.row_bytes].reshape(ROWS, SB)
    gate = whole[GEOMETRY.gate_offset: GEOMETRY.gate_offset + 4].view(np.uint32)
    try:
        frame, text = raw.staging([fd])
        assert frame.status == wire.Status.OK, text
        with pytest.raises(OSError):  # sealed: the client cannot shrink it under the daemon
            os.ftruncate(fd, 4096)
        frame, text = raw.staging([fd])
        assert frame.status == wire.Status.INVALID_ARGUMENT and "has a staging already" in text
        rows = SPEC.rows(layer)
        whole[: GEOMETRY.gate_offset] = 0x5A
        untouched = whole[: GEOMETRY.gate_offset].copy()
        refused = [
            (np.arange(8), dict(first_row=ROWS - 4), wire.Status.INVALID_ARGUMENT, "fall outside its 512 rows"),
            (np.array([3, rows, 5]), {}, wire.Status.OUT_OF_RANGE, f"row id {rows}"),
            (np.array([3, -2, 5]), {}, wire.Status.OUT_OF_RANGE, "row id -2"),
            (np.arange(8), dict(dtype=wire.DType.INT32), wire.Status.INVALID_ARGUMENT, "int64"),
            (np.arange(8), dict(gate=None), wire.Status.UNAVAILABLE, "gave up on it"),  # the gate never opened
        ]
        for ids, kw, status, message in refused:
            frame, text = raw.split_lookup(layer, ids, **({"gate": gate} | kw))
            assert frame.status == status and message in text, (ids, kw, frame, text)
            np.testing.assert_array_equal(whole[: GEOMETRY.gate_offset], untouched)  # nothing written
        ids = np.random.default_rng(9).integers(0, rows, 300)
        ids[[0, 7, 299]] = wst.PAD_ID
        frame, text = raw.split_lookup(layer, ids, first_row=100, gate=gate)
        assert frame.status == wire.Status.OK, text
        assert gate[0] == (raw.rid & 0x3FFFFFFF) << 2 | wst.GATE_DONE
        taken = ids != wst.PAD_ID
        want = tables.read_rows(layer, ids[taken])
        at = 100 + np.flatnonzero(taken)
        np.testing.assert_array_equal(weights[at], want[:, :DIM])
        np.testing.assert_array_equal(scales[at], want[:, DIM:])
        left = np.ones(ROWS, bool)
        left[at] = False
        assert (weights[left] == 0x5A).all() and (scales[left] == 0x5A).all()  # padding and other rows alone
        assert raw.info_works()
    finally:
        raw.close()
        del weights, scales, gate, whole
        staging.close()
        os.close(fd)
    others_get_exact_rows(daemon, tables)


def test_a_client_that_goes_away_mid_request_costs_nothing_else(daemon, tables):
    raw = Raw(daemon)
    fd = memfd()
    try:
        frame, _ = raw.staging([fd])
        assert frame.status == wire.Status.OK
        raw.region[:8000].view("<i8")[:] = np.arange(1000)
        raw.sock.sendall(wire.Frame(wire.Op.LOOKUP, 99, dtype=wire.DType.INT64, flags=wire.Flag.SPLIT, layer=CACHED,
                                    count=1000, ids_offset=0, out_offset=0).pack())
        raw.sock.shutdown(socket.SHUT_RDWR)
    finally:
        raw.close()
        os.close(fd)  # the daemon's mapping keeps the pages until its connection ends
    others_get_exact_rows(daemon, tables)


def vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_a_sparse_staging_with_far_blocks_maps_only_its_blocks(daemon, tables):
    """A 64 TiB sparse memfd with its blocks and gate at the end (the daemon once mapped everything from
    byte 0, 64 TiB a staging): accepted, its rows exact, and the daemon's address space grows by the
    blocks' pages only."""
    far = 64 << 40
    geometry = wst.StagingGeometry(DIM, SB, ROWS, far, far + ROWS * DIM, far + ROWS * SPEC.row_bytes)
    raws, fds = [Raw(daemon) for _ in range(4)], []
    try:
        before = vm_size(daemon.proc.pid)
        for raw in raws:
            fds.append(memfd(size=geometry.gate_offset + 4096))
            frame, text = raw.staging([fds[-1]], geometry.pack())
            assert frame.status == wire.Status.OK, text
        grown = vm_size(daemon.proc.pid) - before
        assert grown < 64 << 20, f"the daemon mapped {grown} bytes for four stagings of {ROWS} rows"
        view = mmap.mmap(fds[0], 4 * mmap.PAGESIZE + ROWS * SPEC.row_bytes, mmap.MAP_SHARED,
                         mmap.PROT_READ | mmap.PROT_WRITE, offset=far - 4 * mmap.PAGESIZE)
        whole = np.frombuffer(view, np.uint8)[4 * mmap.PAGESIZE:]
        ids = np.random.default_rng(3).integers(0, SPEC.rows(CACHED), 64)
        gate_map = mmap.mmap(fds[0], mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                             offset=geometry.gate_offset)
        frame, text = raws[0].split_lookup(CACHED, ids, gate=np.frombuffer(gate_map, np.uint32)[:1])
        assert frame.status == wire.Status.OK, text
        expect = tables.read_rows(CACHED, ids)
        np.testing.assert_array_equal(whole[: ROWS * DIM].reshape(ROWS, DIM)[:64], expect[:, :DIM])
        np.testing.assert_array_equal(whole[ROWS * DIM: ROWS * SPEC.row_bytes].reshape(ROWS, SB)[:64], expect[:, DIM:])
        del whole
        view.close()
        gate_map.close()
    finally:
        for raw in raws:
            raw.close()
        for fd in fds:
            os.close(fd)
    others_get_exact_rows(daemon, tables)
