"""The native Unix path's fair share (``_unixfast.c``): a lookup of more than
FAIR_PIECE_ROWS rows is gathered in pieces (byte-exact, and all-or-nothing on a bad
id), and its pieces wait for small lookups of other connections that are gathering.

Socketpairs and the native module only: no timing is asserted, only what happened
(``fair_stats()`` counts pieces and the pieces that waited)."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from engram_store.wire import frames as wire
from engram_store.wire.frames import DType, Frame, Op

try:
    from engram_store.daemon import _unixfast
except ImportError:  # optional build; the Python reader serves the same requests
    _unixfast = None

pytestmark = pytest.mark.skipif(_unixfast is None, reason="_unixfast not built")

ROW_BYTES, WEIGHT_BYTES, ROWS, LAYER = 24, 16, 1000, 3
REGION_BYTES = 16 << 20
SMALL = 8192  # a decode-sized lookup: at most FAIR_PIECE_ROWS


@pytest.fixture(scope="module")
def table():
    return np.random.default_rng(1).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)


class _Side:
    """One connection: the daemon's Conn on one end of a socketpair, the client on the other."""

    def __init__(self, table: np.ndarray, max_rows: int) -> None:
        self.daemon, self.client = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.client.settimeout(30)
        self.region = np.zeros(REGION_BYTES, np.uint8)
        self.ids = np.empty(max_rows, np.int64)
        views = {LAYER: (np.ascontiguousarray(table[:, :WEIGHT_BYTES]), np.ascontiguousarray(table[:, WEIGHT_BYTES:]))}
        self.conn = _unixfast.Conn(self.daemon.fileno(), self.region, self.ids, views, ROW_BYTES, WEIGHT_BYTES, 2,
                                   max_rows, 0)

    def lookup(self, ids: np.ndarray, rid: int = 1) -> tuple:
        """Send one LOOKUP of ``ids`` (rows after them), serve it, read the RESULT if any."""
        n = len(ids)
        out = wire.align(n * 8)
        self.region[: n * 8].view(np.int64)[:] = ids
        self.client.sendall(Frame(Op.LOOKUP, rid, dtype=DType.INT64, layer=LAYER, count=n, ids_offset=0,
                                  out_offset=out).pack())
        got = self.conn.next()
        if got[0] == _unixfast.SERVED:
            assert wire.Frame.unpack(self.client.recv(wire.FRAME.size, socket.MSG_WAITALL)).count == n
        return got, self.region[out: out + n * ROW_BYTES].reshape(n, ROW_BYTES)

    def close(self) -> None:
        self.conn.close()
        self.daemon.close()
        self.client.close()


def test_a_large_lookup_is_gathered_in_pieces_byte_exact(table):
    piece = _unixfast.FAIR_PIECE_ROWS
    n = 2 * piece + piece // 2 + 7  # three pieces, the last one short
    side = _Side(table, n)
    try:
        ids = np.random.default_rng(2).integers(0, ROWS, n)
        before = _unixfast.fair_stats()["pieces"]
        got, rows = side.lookup(ids)
        assert got[0] == _unixfast.SERVED and got[2] == n
        np.testing.assert_array_equal(rows, table[ids])
        assert _unixfast.fair_stats()["pieces"] - before == 3
    finally:
        side.close()


def test_a_bad_id_in_the_last_piece_copies_nothing(table):
    n = 2 * _unixfast.FAIR_PIECE_ROWS + 1
    side = _Side(table, n)
    try:
        ids = np.zeros(n, np.int64)
        ids[-1] = ROWS  # out of range, in the last piece
        before = _unixfast.fair_stats()["pieces"]
        got, rows = side.lookup(ids)
        assert got[0] == _unixfast.FRAME  # left to the Python reader, which answers the error
        assert not rows.any() and _unixfast.fair_stats()["pieces"] == before
    finally:
        side.close()


def test_large_pieces_wait_for_small_lookups_of_others(table):
    """One connection loops small lookups while another's large lookups are gathered: some
    pieces find a small one gathering and wait for it (without the fair share: none)."""
    piece = _unixfast.FAIR_PIECE_ROWS
    large, small = _Side(table, 8 * piece), _Side(table, SMALL)
    stop, errors = threading.Event(), []
    ids_small = np.random.default_rng(3).integers(0, ROWS, SMALL)

    def loop_small() -> None:
        try:
            for rid in range(1, 1_000_000):
                if stop.is_set():
                    return
                got, rows = small.lookup(ids_small, rid)
                assert got[0] == _unixfast.SERVED
            np.testing.assert_array_equal(rows, table[ids_small])
        except Exception as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=loop_small)
    try:
        before = _unixfast.fair_stats()["yielded"]
        thread.start()
        ids = np.random.default_rng(4).integers(0, ROWS, 8 * piece)
        for rid in range(1, 41):  # bounded: stop at the first lookup where a piece waited
            got, rows = large.lookup(ids, rid)
            assert got[0] == _unixfast.SERVED
            if _unixfast.fair_stats()["yielded"] > before:
                break
        np.testing.assert_array_equal(rows, table[ids])
        assert _unixfast.fair_stats()["yielded"] > before
    finally:
        stop.set()
        thread.join(30)
        large.close()
        small.close()
    assert not errors, errors
