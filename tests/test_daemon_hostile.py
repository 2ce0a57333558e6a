"""Hostile local clients: each test plays the attack against a real daemon, then checks
that the daemon is alive and an honest client still gets the right bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables, raw_connect, read_result

from engram_store.client.client import EngramClient
from engram_store.native import syscalls
from engram_store.wire.frames import DType, Frame, Op, Status

SHM = 1 << 20


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=21)


def _honest_lookup(daemon: DaemonProcess, tables) -> None:
    ids = np.random.default_rng(5).integers(0, tables.rows(1), 500)
    for address in (daemon.unix, daemon.grpc):
        with EngramClient.connect(address, reconnect_timeout=0, token_file=daemon.token_file) as client:
            np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))


def test_region_cannot_be_truncated_and_the_daemon_survives_the_attempt(reader_daemon, tables):
    """The SIGBUS attack against every reader of a client region (``reader_daemon``: the native path, the
    Python path, cached mode): ftruncate the region to 0, then ask for rows written at offset 0."""
    sock, welcome, _, fds = raw_connect(reader_daemon.socket_path, SHM)
    try:
        assert welcome.status == Status.OK
        region_fd = fds[0]
        seals = syscalls.seals(region_fd)
        assert seals & syscalls.F_SEAL_SHRINK and seals & syscalls.F_SEAL_GROW and seals & syscalls.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(region_fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(region_fd, welcome.count * 2)
        with pytest.raises(PermissionError):  # nor can the seals be taken off or added to
            syscalls.add_seals(region_fd, syscalls.F_SEAL_WRITE)
        assert os.fstat(region_fd).st_size == welcome.count
        # The lookup of the repro: 8,192 bytes of rows at offset 0 (the ids after them).
        rows = 8192 // tables.row_bytes + 1
        ids_offset = 16384
        ids = np.arange(rows, dtype=np.int64)
        os.pwrite(region_fd, ids.tobytes(), ids_offset)
        sock.sendall(Frame(Op.LOOKUP, 7, dtype=DType.INT64, layer=1, count=rows, ids_offset=ids_offset,
                           out_offset=0).pack())
        frame, payload = read_result(sock)
        assert (frame.request_id, frame.status) == (7, Status.OK), payload
        got = np.frombuffer(os.pread(region_fd, rows * tables.row_bytes, 0), np.uint8).reshape(rows, -1)
        np.testing.assert_array_equal(got, expected(tables, 1, ids))
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)
    assert reader_daemon.proc.poll() is None, reader_daemon.log_text()
    _honest_lookup(reader_daemon, tables)
