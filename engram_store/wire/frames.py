"""The Unix-socket protocol: one fixed frame header, declared once, and the status codes.

A connection goes::

    client  HELLO   (count = shared-region bytes wanted, 0 = daemon default)
    daemon  WELCOME (count = region bytes; payload = JSON info; SCM_RIGHTS fds:
                     [region memfd] or [region memfd, sealed arena memfd])
    client  LOOKUP  (layer, dtype, count ids at ids_offset of the region, rows
                     to out_offset of the region); any number in flight
    daemon  RESULT  (same request_id; status OK, or an error with a UTF-8
                     message as payload); rows are in the region when it arrives
    client  INFO / STATS -> daemon RESULT with a JSON payload

Frames are a little-endian :data:`FRAME` header followed by ``payload_bytes``
bytes. A frame with a bad magic, another version or an oversized payload is
garbage: the daemon closes that connection and nothing else.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

from .. import errors

MAGIC = 0x52474E45  # b"ENGR" read little-endian
VERSION = 1
MAX_CLIENT_PAYLOAD = 4096  # clients send no payload today; anything larger is garbage
MAX_DAEMON_PAYLOAD = 16 << 20  # largest JSON/message payload a client accepts
ALIGN = 64  # ids and rows in the region start on a cache line

FRAME_FIELDS = (  # (name, struct code), in order: the one declaration of the frame header
    ("magic", "I"),  # MAGIC, identifies the protocol
    ("version", "H"),  # VERSION; a mismatch is answered VERSION_MISMATCH then closed
    ("op", "H"),  # Op
    ("status", "H"),  # Status (responses), 0 in requests
    ("dtype", "B"),  # DType of the row ids (LOOKUP), 0 otherwise
    ("flags", "B"),  # Flag bits (WELCOME: an arena fd follows)
    ("layer", "i"),  # Engram layer id (LOOKUP)
    ("request_id", "Q"),  # chosen by the client, echoed in the RESULT
    ("count", "Q"),  # row ids (LOOKUP / RESULT) or region bytes (HELLO / WELCOME)
    ("ids_offset", "Q"),  # byte offset of the row ids in the shared region
    ("out_offset", "Q"),  # byte offset where the rows go in the shared region
    ("payload_bytes", "I"),  # bytes following this header
    ("reserved", "I"),  # 0
)
FRAME = struct.Struct("<" + "".join(code for _, code in FRAME_FIELDS))


def field_layout() -> tuple[tuple[str, int, int], ...]:
    """``(name, byte offset, byte size)`` of every header field, as :data:`FRAME` packs them."""
    out, offset = [], 0
    for name, code in FRAME_FIELDS:
        size = struct.calcsize("<" + code)
        out.append((name, offset, size))
        offset += size
    return tuple(out)


def check_native_layout(native_fields, where: str) -> None:
    """Raise ProtocolError unless ``native_fields`` (a C module's ``FRAME_FIELDS``:
    ``((name, offset, size), ...)``) is exactly :func:`field_layout`."""
    ours = field_layout()
    theirs = tuple(tuple(f) for f in native_fields)
    if theirs != ours:
        diff = [f"{a} (Python) vs {b} (C)" for a, b in zip(ours, theirs) if a != b]
        if len(ours) != len(theirs):
            diff.append(f"{len(ours)} fields (Python) vs {len(theirs)} (C)")
        raise ProtocolError(f"{where} and engram_store/wire/frames.py disagree on the frame header: "
                            f"{'; '.join(diff)}; rebuild the native modules (pip install -e .)")


class Op(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    LOOKUP = 3
    RESULT = 4
    INFO = 5
    STATS = 6


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_RANGE = 2
    NOT_FOUND = 3
    RESOURCE_EXHAUSTED = 4
    UNAVAILABLE = 5
    INTERNAL = 6
    VERSION_MISMATCH = 7


class DType(enum.IntEnum):
    NONE = 0
    INT64 = 1
    INT32 = 2

    @property
    def numpy(self) -> np.dtype:
        return np.dtype("<i8") if self is DType.INT64 else np.dtype("<i4")


class Flag(enum.IntFlag):
    NONE = 0
    ARENA = 1  # WELCOME carries the sealed arena fd as its second fd


@dataclass(frozen=True)
class Frame:
    op: int
    request_id: int = 0
    status: int = Status.OK
    dtype: int = DType.NONE
    flags: int = 0
    layer: int = 0
    count: int = 0
    ids_offset: int = 0
    out_offset: int = 0
    payload_bytes: int = 0
    magic: int = MAGIC
    version: int = VERSION

    def pack(self, payload: bytes = b"") -> bytes:
        return FRAME.pack(self.magic, self.version, self.op, self.status, self.dtype, self.flags, self.layer,
                          self.request_id, self.count, self.ids_offset, self.out_offset, len(payload), 0) + payload

    @classmethod
    def unpack(cls, header: bytes) -> "Frame":
        (magic, version, op, status, dtype, flags, layer, request_id, count, ids_offset, out_offset,
         payload_bytes, _reserved) = FRAME.unpack(header)
        return cls(op, request_id, status, dtype, flags, layer, count, ids_offset, out_offset, payload_bytes,
                   magic, version)


def pack_lookup(request_id: int, layer: int, count: int, ids_offset: int, out_offset: int) -> bytes:
    """A LOOKUP header of int64 ids (the hot path's shortcut for ``Frame(...).pack()``)."""
    return FRAME.pack(MAGIC, VERSION, Op.LOOKUP, Status.OK, DType.INT64, 0, layer, request_id, count,
                      ids_offset, out_offset, 0, 0)


def pack_result(request_id: int, layer: int, count: int) -> bytes:
    """A successful RESULT header (the hot path's shortcut for ``Frame(...).pack()``)."""
    return FRAME.pack(MAGIC, VERSION, Op.RESULT, Status.OK, DType.NONE, 0, layer, request_id, count, 0, 0, 0, 0)


class ProtocolError(errors.EngramStoreError):
    """The peer sent something that is not this protocol (bad magic, version, size)."""


def check_header(frame: Frame, max_payload: int) -> None:
    """Raise ProtocolError unless ``frame`` is a well-formed header of this version."""
    if frame.magic != MAGIC:
        raise ProtocolError(f"bad frame magic {frame.magic:#010x}, expected {MAGIC:#010x}: not an engram-store peer")
    if frame.version != VERSION:
        raise ProtocolError(f"peer speaks protocol version {frame.version}, this build speaks {VERSION}; "
                            "upgrade the older side")
    if frame.payload_bytes > max_payload:
        raise ProtocolError(f"frame payload of {frame.payload_bytes} bytes exceeds {max_payload}")


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# Status <-> exception class, shared by both transports (gRPC maps its codes onto the same classes).
_STATUS_OF: tuple[tuple[type[errors.EngramStoreError], Status], ...] = (
    (errors.UnknownLayer, Status.NOT_FOUND),
    (errors.RowOutOfRange, Status.OUT_OF_RANGE),
    (errors.InvalidRequest, Status.INVALID_ARGUMENT),
    (errors.ResourceExhausted, Status.RESOURCE_EXHAUSTED),
    (errors.Unavailable, Status.UNAVAILABLE),
)
_ERROR_OF: dict[Status, type[errors.EngramStoreError]] = {status: cls for cls, status in _STATUS_OF}
_ERROR_OF[Status.INTERNAL] = errors.StorageError
_ERROR_OF[Status.VERSION_MISMATCH] = ProtocolError


def status_of(exc: BaseException) -> Status:
    for cls, status in _STATUS_OF:
        if isinstance(exc, cls):
            return status
    return Status.INTERNAL


def error_of(status: int, message: str) -> errors.EngramStoreError:
    try:
        cls = _ERROR_OF[Status(status)]
    except ValueError:
        cls = errors.EngramStoreError
    return cls(message)
