"""lookup_codec: the hand-written LookupReply encoding agrees with protobuf both ways."""

from __future__ import annotations

import numpy as np
import pytest

from engram_store.wire import grpc_codec as lookup_codec
from engram_store.wire._proto import engram_store_pb2 as pb

CASES = [(0, 0, 0, 0, 0), (1, 0, 1, 1, 1), (300, 7, 5, 60, 12), (1 << 20, 123456789, 3000, 264, 1 << 40)]


@pytest.mark.parametrize("nbytes, first, count, row_bytes, total", CASES)
def test_encoded_reply_parses_as_the_protobuf_message(nbytes, first, count, row_bytes, total):
    rows = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    data = lookup_codec.serialize_reply(lookup_codec.encode_reply(rows, first, count, row_bytes, total))
    msg = pb.LookupReply.FromString(data)
    assert (msg.rows, msg.first_row, msg.row_count, msg.row_bytes, msg.total_rows) == \
        (rows.tobytes(), first, count, row_bytes, total)


@pytest.mark.parametrize("nbytes, first, count, row_bytes, total", CASES)
def test_decoder_reads_protobufs_own_encoding(nbytes, first, count, row_bytes, total):
    rows = np.random.default_rng(nbytes + 1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    data = pb.LookupReply(rows=rows, first_row=first, row_count=count, row_bytes=row_bytes,
                          total_rows=total).SerializeToString()
    chunk = lookup_codec.decode_reply(data)
    assert (bytes(chunk.rows), chunk.first_row, chunk.row_count, chunk.row_bytes, chunk.total_rows) == \
        (rows, first, count, row_bytes, total)
    assert chunk.rows.readonly and (not nbytes or np.shares_memory(np.frombuffer(chunk.rows, np.uint8),
                                                                    np.frombuffer(data, np.uint8)))  # no copy


def test_encoder_takes_row_shaped_and_empty_arrays():
    rows = np.arange(24, dtype=np.uint8).reshape(4, 6)
    for a in (rows, rows[:0], np.zeros((0, 264), np.uint8)):
        data = lookup_codec.serialize_reply(lookup_codec.encode_reply(a, 0, len(a), a.shape[1], len(a)))
        assert pb.LookupReply.FromString(data).rows == a.tobytes()


def test_decoder_skips_unknown_fields_and_takes_the_last_value():
    known = pb.LookupReply(rows=b"abc", first_row=4, row_count=1, row_bytes=3, total_rows=9).SerializeToString()
    unknown = (b"\x30\x96\x01"  # field 6, varint 150
               b"\x3a\x02hi"  # field 7, bytes
               b"\x41" + b"\x00" * 8  # field 8, fixed64
               + b"\x4d" + b"\x00" * 4)  # field 9, fixed32
    later = pb.LookupReply(first_row=5).SerializeToString()
    chunk = lookup_codec.decode_reply(unknown + known + later)
    assert (bytes(chunk.rows), chunk.first_row, chunk.row_count, chunk.total_rows) == (b"abc", 5, 1, 9)


@pytest.mark.parametrize("bad", [
    b"\x0a\x05abc",  # rows longer than the message
    b"\x10",  # varint cut off
    b"\x10" + b"\xff" * 11,  # varint too long
    b"\x0b",  # group start: not in this message
    b"\x41\x00\x00",  # fixed64 cut off
])
def test_decoder_rejects_malformed_messages(bad):
    with pytest.raises(ValueError, match="LookupReply"):
        lookup_codec.decode_reply(bad)
