"""``LookupReply`` on the wire without protobuf's copies of the row bytes.

The generated code would copy a reply's rows three times on the daemon (numpy
to ``bytes``, ``bytes`` into the message, the message into its serialized
form) and twice on the client (parsing, then reading the field). Rows are
nearly all of what gRPC carries, so the daemon writes the protobuf encoding by
hand (the small fields through protobuf, then field 1 with its length and the
rows: one copy) and the client reads the message with a small decoder that
returns the rows as a ``memoryview`` of the received bytes (no copy).

Both produce and accept standard protobuf encoding of ``LookupReply``: any
field order, unknown fields skipped, so a client built from the .proto alone
talks to the daemon, and this decoder reads any conforming server's replies.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._proto import engram_store_pb2 as pb

_ROWS_TAG = b"\x0a"  # field 1 (rows), wire type 2 (length-delimited)
_UINT64_MAX = (1 << 64) - 1


class LookupChunk(NamedTuple):
    """A decoded ``LookupReply``; ``rows`` is a read-only view of the received message."""

    rows: memoryview
    first_row: int
    row_count: int
    row_bytes: int
    total_rows: int


class EncodedReply:
    """A ``LookupReply`` already in wire form (``data``; see :func:`encode_reply`)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_reply(rows: np.ndarray, first_row: int, row_count: int, row_bytes: int, total_rows: int) -> EncodedReply:
    """The serialized ``LookupReply`` for ``rows`` (any C-contiguous array), copying them once."""
    meta = pb.LookupReply(first_row=first_row, row_count=row_count, row_bytes=row_bytes,
                          total_rows=total_rows).SerializeToString()
    payload = memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8))
    return EncodedReply(b"".join((meta, _ROWS_TAG, _varint(payload.nbytes), payload)))


def serialize_reply(message: EncodedReply | pb.LookupReply) -> bytes:
    """Response serializer for the Lookup RPCs: encoded replies pass through as they are."""
    return message.data if isinstance(message, EncodedReply) else message.SerializeToString()


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("LookupReply: truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if value > _UINT64_MAX:
                raise ValueError("LookupReply: varint too long")
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("LookupReply: varint too long")


def decode_reply(data: bytes) -> LookupChunk:
    """Response deserializer for the Lookup RPCs: a :class:`LookupChunk` whose rows alias ``data``."""
    buf = memoryview(data)
    fields = {2: 0, 3: 0, 4: 0, 5: 0}
    rows = buf[0:0]
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
            if number in fields:
                fields[number] = value
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("LookupReply: a field runs past the end of the message")
            if number == 1:
                rows = buf[pos: pos + length]
            pos += length
        elif wire_type in (1, 5):  # fixed64 / fixed32: an unknown field, skipped
            pos += 8 if wire_type == 1 else 4
            if pos > len(buf):
                raise ValueError("LookupReply: truncated fixed-width field")
        else:
            raise ValueError(f"LookupReply: unsupported wire type {wire_type} (field {number})")
    return LookupChunk(rows.toreadonly(), fields[2], fields[3], fields[4], fields[5])
