"""The daemon's native Unix path (``_unixfast.c``) on a socketpair: what it serves is
byte-exact against numpy; every request it does not take comes back as the header
that was sent, with no reply sent and nothing written to the region."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from engram_store.daemon.unix import fastpath
from engram_store.wire import frames as wire
from engram_store.wire.frames import DType, Frame, Op

try:
    from engram_store.daemon import _unixfast
except ImportError:  # optional build; the Python reader serves the same requests
    _unixfast = None

pytestmark = pytest.mark.skipif(_unixfast is None, reason="_unixfast not built (the Python reader covers the same requests)")

ROW_BYTES = 24
WEIGHT_BYTES = 16  # the engines' layout: 16 payload bytes, then 8 scale bytes per row
LAYER_ROWS = {3: 1000, 7: 50}
REGION_BYTES = 1 << 18
MAX_ROWS = 4096
IDS_ROWS = 3000
OUT = 1 << 16  # where the tests put rows in the region


@pytest.fixture
def pair():
    daemon_side, client_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield daemon_side, client_side
    daemon_side.close()
    client_side.close()


@pytest.fixture
def tables():
    rng = np.random.default_rng(0)
    return {layer: rng.integers(0, 256, (rows, ROW_BYTES), dtype=np.uint8) for layer, rows in LAYER_ROWS.items()}


def _split(tables):
    """The arena's blocks of each reference table: (weights, scales)."""
    return {layer: (np.ascontiguousarray(t[:, :WEIGHT_BYTES]), np.ascontiguousarray(t[:, WEIGHT_BYTES:]))
            for layer, t in tables.items()}


def _conn(pair, tables, region, busy_poll_ns=0, ids_rows=IDS_ROWS):
    ids = np.empty(ids_rows, np.int64)
    return _unixfast.Conn(pair[0].fileno(), region, ids, _split(tables), ROW_BYTES, WEIGHT_BYTES, 2, MAX_ROWS,
                          busy_poll_ns), ids


def _lookup(rid, layer, count, ids_offset=0, out_offset=OUT, **fields) -> Frame:
    return Frame(Op.LOOKUP, rid, dtype=fields.pop("dtype", DType.INT64), layer=layer, count=count,
                 ids_offset=ids_offset, out_offset=out_offset, **fields)


def _nothing_to_read(sock) -> bool:
    try:
        sock.recv(1, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    return False


def test_constants_agree_with_wire():
    assert fastpath.native_module() is _unixfast
    assert (_unixfast.FRAME_SIZE, _unixfast.MAGIC, _unixfast.VERSION) == (wire.FRAME.size, wire.MAGIC, wire.VERSION)


def test_the_c_frame_layout_is_checked_field_by_field():
    """The C module exports each header field's offset and size; frames.py checks them
    against its own struct declaration, and a difference in any one field is refused."""
    assert tuple(tuple(f) for f in _unixfast.FRAME_FIELDS) == wire.field_layout()
    assert [name for name, _, _ in wire.field_layout()] == [name for name, _ in wire.FRAME_FIELDS]
    assert wire.field_layout()[-1][1] + wire.field_layout()[-1][2] == wire.FRAME.size == _unixfast.FRAME_SIZE
    swapped = list(_unixfast.FRAME_FIELDS)
    swapped[7], swapped[8] = ("request_id", 24, 8), ("count", 16, 8)  # same size, two fields' offsets exchanged
    with pytest.raises(wire.ProtocolError, match=r"request_id.*\(Python\) vs .*request_id', 24"):
        wire.check_native_layout(swapped, "a test")
    with pytest.raises(wire.ProtocolError, match="13 fields"):
        wire.check_native_layout(_unixfast.FRAME_FIELDS[:-1], "a test")


def test_one_busy_poll_token_for_native_and_python_connections():
    token = fastpath.PollToken()
    assert token.acquire()
    try:
        assert not _unixfast.poll_token_try()  # a native connection finds it taken
        assert not token.acquire()
    finally:
        token.release()
    assert _unixfast.poll_token_try()  # and free again
    _unixfast.poll_token_release()


@pytest.mark.parametrize("busy_poll_ns", [0, 200_000])
@pytest.mark.parametrize("count", [1, 300, 2500])  # 2,500 rows: split across the gather pool
def test_served_lookups_are_byte_exact(pair, tables, busy_poll_ns, count):
    region = np.zeros(REGION_BYTES, np.uint8)
    conn, ids_buf = _conn(pair, tables, region, busy_poll_ns)
    ids = np.random.default_rng(count).integers(0, LAYER_ROWS[3], count)
    region[: count * 8].view(np.int64)[:] = ids
    pair[1].sendall(_lookup(41, 3, count).pack())
    kind, layer, n, seconds = conn.next()
    assert (kind, layer, n) == (fastpath.SERVED, 3, count) and seconds > 0
    reply = Frame.unpack(pair[1].recv(wire.FRAME.size))
    assert (reply.op, reply.status, reply.request_id, reply.layer, reply.count) == (Op.RESULT, 0, 41, 3, count)
    wire.check_header(reply, 0)
    rows = region[OUT: OUT + count * ROW_BYTES].reshape(count, ROW_BYTES)
    np.testing.assert_array_equal(rows, tables[3][ids])
    np.testing.assert_array_equal(ids_buf[:count], ids)  # what the daemon records and samples
    conn.close()


def test_pipelined_frames_are_answered_in_order(pair, tables):
    region = np.zeros(REGION_BYTES, np.uint8)
    conn, _ = _conn(pair, tables, region)
    rng = np.random.default_rng(5)
    plan = [(3, rng.integers(0, LAYER_ROWS[3], 100)), (7, rng.integers(0, LAYER_ROWS[7], 40)),
            (3, rng.integers(0, LAYER_ROWS[3], 7))]
    frames = []
    for i, (layer, ids) in enumerate(plan):
        ids_off, out_off = i * 1024, OUT + i * 4096
        region[ids_off: ids_off + ids.size * 8].view(np.int64)[:] = ids
        frames.append(_lookup(i + 1, layer, ids.size, ids_off, out_off).pack())
    pair[1].sendall(b"".join(frames))
    for i, (layer, ids) in enumerate(plan):
        assert conn.next()[:3] == (fastpath.SERVED, layer, ids.size)
        assert Frame.unpack(pair[1].recv(wire.FRAME.size)).request_id == i + 1
        out = region[OUT + i * 4096: OUT + i * 4096 + ids.size * ROW_BYTES].reshape(-1, ROW_BYTES)
        np.testing.assert_array_equal(out, tables[layer][ids])
    conn.close()


REFUSED = {
    "info op": Frame(Op.INFO, 9),
    "payload": _lookup(9, 3, 10, payload_bytes=4),
    "int32 ids": _lookup(9, 3, 10, dtype=DType.INT32),
    "unknown layer": _lookup(9, 5, 10),
    "no rows": _lookup(9, 3, 0),
    "over max_request_rows": _lookup(9, 3, MAX_ROWS + 1),
    "over the id buffer": _lookup(9, 3, IDS_ROWS + 1),
    "unaligned ids": _lookup(9, 3, 10, ids_offset=4),
    "unaligned rows": _lookup(9, 3, 10, out_offset=OUT + 4),
    "ids past the region": _lookup(9, 3, 10, ids_offset=REGION_BYTES - 40),
    "rows past the region": _lookup(9, 3, 10, out_offset=REGION_BYTES - 8),
    "offset past the region": _lookup(9, 3, 10, out_offset=1 << 62),
    "ids and rows overlap": _lookup(9, 3, 10, ids_offset=OUT + 64),
    "bad magic": _lookup(9, 3, 10, magic=0x12345678),
    "other version": _lookup(9, 3, 10, version=wire.VERSION + 1),
    "id past the rows": _lookup(9, 3, 10, ids_offset=8),  # ids[1:11] holds LAYER_ROWS[3]
    "negative id": _lookup(9, 3, 10, ids_offset=16),  # ids[2:12] holds -1
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_frames_come_back_untouched(pair, tables, name):
    region = np.zeros(REGION_BYTES, np.uint8)
    ids = np.arange(20, dtype=np.int64)
    ids[1], ids[2] = LAYER_ROWS[3], -1
    region[: ids.nbytes].view(np.int64)[:] = ids
    conn, _ = _conn(pair, tables, region)
    header = REFUSED[name].pack()
    pair[1].sendall(header)
    assert conn.next() == (fastpath.FRAME, header)
    assert not region[OUT:].any() and _nothing_to_read(pair[1])
    conn.close()


@pytest.mark.parametrize("sent", [0, 10])
@pytest.mark.parametrize("busy_poll_ns", [0, 200_000])
def test_a_closed_peer_is_eof_with_what_arrived(pair, tables, sent, busy_poll_ns):
    conn, _ = _conn(pair, tables, np.zeros(REGION_BYTES, np.uint8), busy_poll_ns)
    header = _lookup(1, 3, 10).pack()
    pair[1].sendall(header[:sent])
    pair[1].close()
    assert conn.next() == (fastpath.EOF, header[:sent])
    conn.close()


def test_a_reply_nobody_reads_ends_the_connection(pair, tables):
    conn, _ = _conn(pair, tables, np.zeros(REGION_BYTES, np.uint8))
    pair[1].sendall(_lookup(1, 3, 10).pack())
    pair[1].close()  # gone before the reply: the send fails, the socket is shut down
    assert conn.next()[0] == fastpath.SERVED
    assert conn.next() == (fastpath.EOF, b"")
    conn.close()


def test_close_releases_the_buffers(pair, tables):
    region = bytearray(REGION_BYTES)  # resizing fails while any buffer of it is exported
    conn, _ = _conn(pair, tables, region)
    with pytest.raises(BufferError):
        region.extend(b"x")
    conn.close()
    conn.close()  # idempotent
    region.extend(b"x")
    with pytest.raises(ValueError, match="closed"):
        conn.next()


def test_bad_arguments_are_refused(pair, tables):
    region = np.zeros(REGION_BYTES, np.uint8)
    with pytest.raises(ValueError, match="row_bytes"):
        _unixfast.Conn(pair[0].fileno(), region, np.empty(8, np.int64), _split(tables), 0, 0, 2, MAX_ROWS, 0)
    with pytest.raises(TypeError):
        _unixfast.Conn(pair[0].fileno(), region, np.empty(8, np.int64), [], ROW_BYTES, WEIGHT_BYTES, 2, MAX_ROWS, 0)
    read_only = region.view()
    read_only.setflags(write=False)
    with pytest.raises((BufferError, ValueError)):
        _unixfast.Conn(pair[0].fileno(), read_only, np.empty(8, np.int64), _split(tables), ROW_BYTES, WEIGHT_BYTES, 2,
                       MAX_ROWS, 0)
    with pytest.raises(TypeError, match="weights, scales"):  # a layer must come as its two blocks
        _unixfast.Conn(pair[0].fileno(), region, np.empty(8, np.int64), tables, ROW_BYTES, WEIGHT_BYTES, 2, MAX_ROWS, 0)
    short = {layer: (w, s[:-1]) for layer, (w, s) in _split(tables).items()}
    with pytest.raises(ValueError, match="scales hold fewer rows"):
        _unixfast.Conn(pair[0].fileno(), region, np.empty(8, np.int64), short, ROW_BYTES, WEIGHT_BYTES, 2, MAX_ROWS, 0)
