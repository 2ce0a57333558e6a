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
    client  STAGING (payload: :data:`~engram_store.wire.staging.STAGING` geometry; SCM_RIGHTS:
                     the client's sealed staging memfd) -> daemon RESULT; then LOOKUP with
                     :attr:`Flag.SPLIT` writes rows into that staging (see :mod:`.staging`)
    client  HINT    (layer, dtype, count ids at ids_offset of the region, out_offset = the hint's
                     key) -> daemon RESULT (count = rows queued), as soon as the ids are copied:
                     rows the client will look up soon, read ahead behind the lookups
    client  WITHDRAW (out_offset = a key) -> daemon RESULT (count = queued rows dropped)

A LOOKUP with :attr:`Flag.PLAN` asks for a *read plan* (cached layers): the daemon
writes the rows it holds in DRAM into the region as usual and answers RESULT with
``Flag.PLAN`` and a :class:`ReadPlan` payload for the others (which pages of which
layer file, where each missing row sits in its page, each page's crc32c); the
client reads and checks those pages itself. A RESULT without ``Flag.PLAN`` means
every row is in the region (a resident layer, all rows cached, a plan too large
for :data:`MAX_DAEMON_PAYLOAD`, or a daemon that predates plans and ignores the flag).

Frames are a little-endian :data:`FRAME` header followed by ``payload_bytes``
bytes. A frame with a bad magic, another version or an oversized payload is
garbage: the daemon closes that connection and nothing else.
"""

from __future__ import annotations

import enum
import re
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
    ("out_offset", "Q"),  # byte offset where the rows go in the shared region (Flag.SPLIT: first staging row;
    #                      HINT / WITHDRAW: the hint's key, the same from every rank sending it)
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
    STAGING = 7  # the client's staging memfd for Flag.SPLIT lookups (engram_store.wire.staging)
    HINT = 8  # rows the client will look up soon (a prompt's later chunks): read ahead, fire and forget
    WITHDRAW = 9  # the hints of a key are no longer needed (its request finished): their queued rows dropped


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_RANGE = 2
    NOT_FOUND = 3
    RESOURCE_EXHAUSTED = 4
    UNAVAILABLE = 5
    INTERNAL = 6
    VERSION_MISMATCH = 7
    DATA_LOSS = 8  # rows in pages whose crc32c fails or that cannot be read: CorruptRows


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
    PLAN = 2  # LOOKUP: answer misses with a read plan; RESULT: a ReadPlan payload follows, its rows are not written
    SPLIT = 4  # LOOKUP: rows go into the connection's staging, split layout, row i at out_offset + i (wire.staging)


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


def pack_lookup(request_id: int, layer: int, count: int, ids_offset: int, out_offset: int, flags: int = 0) -> bytes:
    """A LOOKUP header of int64 ids (the hot path's shortcut for ``Frame(...).pack()``);
    ``flags=Flag.PLAN`` asks for a read plan of the rows not in DRAM."""
    return FRAME.pack(MAGIC, VERSION, Op.LOOKUP, Status.OK, DType.INT64, flags, layer, request_id, count,
                      ids_offset, out_offset, 0, 0)


def pack_hint(request_id: int, layer: int, count: int, ids_offset: int, key: int) -> bytes:
    """A HINT header of ``count`` int64 ids at ``ids_offset`` of the region, for the hint ``key``."""
    return FRAME.pack(MAGIC, VERSION, Op.HINT, Status.OK, DType.INT64, 0, layer, request_id, count, ids_offset,
                      key, 0, 0)


def pack_result(request_id: int, layer: int, count: int) -> bytes:
    """A successful RESULT header (the hot path's shortcut for ``Frame(...).pack()``)."""
    return FRAME.pack(MAGIC, VERSION, Op.RESULT, Status.OK, DType.NONE, 0, layer, request_id, count, 0, 0, 0, 0)


class ProtocolError(errors.EngramStoreError):
    """The peer sent something that is not this protocol (bad magic, version, size)."""


# --- read plans (the payload of a RESULT with Flag.PLAN) ---------------------------------------------
PLAN_VERSION = 1
PLAN_FIELDS = (  # (name, struct code), in order: the plan payload's header
    ("plan_version", "H"),  # PLAN_VERSION
    ("reserved", "H"),  # 0
    ("path_bytes", "I"),  # UTF-8 bytes of the layer file's absolute path, which follows (padded to 8)
    ("row_bytes", "I"),  # bytes per row
    ("page_bytes", "I"),  # bytes per page (4096); a row sits at slot * row_bytes of its page
    ("n_pages", "I"),  # distinct pages, ascending: PLAN_PAGE records after the path
    ("n_missing", "I"),  # positions of the request not written to the region: PLAN_MISS records after the pages
    ("file_bytes", "Q"),  # size of the layer file the daemon reads
    ("st_dev", "Q"),  # st_dev and st_ino of that file (the daemon's fstat): a client opening the path
    ("st_ino", "Q"),  #   checks it reached the same file, else it falls back
)
PLAN_HEADER = struct.Struct("<" + "".join(code for _, code in PLAN_FIELDS))
PLAN_PAGE = np.dtype([("page", "<u8"), ("crc", "<u4"), ("reserved", "<u4")])  # page number in the file, its crc32c
PLAN_MISS = np.dtype([("position", "<u4"), ("page_index", "<u4"), ("slot", "<u2"), ("reserved", "<u2")])
# position: index in the flattened request; page_index: into the pages; slot: row within its page


@dataclass(frozen=True)
class ReadPlan:
    """The rows of one lookup the daemon did not write: read ``pages`` of ``path`` (their
    expected crc32c in ``crcs``), check each, then row ``positions[i]`` of the request is
    bytes ``slots[i] * row_bytes ..`` of page ``pages[page_index[i]]``. Several positions
    may share a page (and a slot: duplicate ids)."""

    path: str
    file_bytes: int
    st_dev: int
    st_ino: int
    row_bytes: int
    pages: np.ndarray  # int64 [n_pages], ascending, distinct
    crcs: np.ndarray  # uint32 [n_pages]
    positions: np.ndarray  # int64 [n_missing]
    page_index: np.ndarray  # int64 [n_missing]
    slots: np.ndarray  # int64 [n_missing]
    page_bytes: int = 4096

    @staticmethod
    def nbytes(path_bytes: int, n_pages: int, n_missing: int) -> int:
        """Payload bytes of a plan of this size (to check it fits :data:`MAX_DAEMON_PAYLOAD`)."""
        return PLAN_HEADER.size + align8(path_bytes) + n_pages * PLAN_PAGE.itemsize + n_missing * PLAN_MISS.itemsize

    def pack(self) -> bytes:
        path = self.path.encode()
        pages = np.zeros(len(self.pages), PLAN_PAGE)
        pages["page"], pages["crc"] = self.pages, self.crcs
        miss = np.zeros(len(self.positions), PLAN_MISS)
        miss["position"], miss["page_index"], miss["slot"] = self.positions, self.page_index, self.slots
        head = PLAN_HEADER.pack(PLAN_VERSION, 0, len(path), self.row_bytes, self.page_bytes, len(pages), len(miss),
                                self.file_bytes, self.st_dev, self.st_ino)
        return b"".join((head, path.ljust(align8(len(path)), b"\0"), pages.tobytes(), miss.tobytes()))

    @classmethod
    def unpack(cls, payload: bytes, count: int) -> "ReadPlan":
        """Decode and check a plan for a request of ``count`` rows; ProtocolError when it is
        malformed (sizes, indices out of range, pages not ascending)."""
        if len(payload) < PLAN_HEADER.size:
            raise ProtocolError(f"read plan of {len(payload)} bytes, shorter than its {PLAN_HEADER.size}-byte header")
        (version, _, path_bytes, row_bytes, page_bytes, n_pages, n_missing, file_bytes, st_dev,
         st_ino) = PLAN_HEADER.unpack_from(payload)
        if version != PLAN_VERSION:
            raise ProtocolError(f"read plan version {version}, this build reads {PLAN_VERSION}; upgrade the older side")
        if len(payload) != cls.nbytes(path_bytes, n_pages, n_missing):
            raise ProtocolError(f"read plan of {len(payload)} bytes, its header says "
                                f"{cls.nbytes(path_bytes, n_pages, n_missing)}")
        if not 0 < row_bytes <= page_bytes:
            raise ProtocolError(f"read plan: row_bytes {row_bytes}, page_bytes {page_bytes}")
        at = PLAN_HEADER.size
        path = payload[at: at + path_bytes].decode()
        at += align8(path_bytes)
        pages = np.frombuffer(payload, PLAN_PAGE, n_pages, at)
        miss = np.frombuffer(payload, PLAN_MISS, n_missing, at + n_pages * PLAN_PAGE.itemsize)
        plan = cls(path, file_bytes, st_dev, st_ino, row_bytes, pages["page"].astype(np.int64),
                   pages["crc"].copy(), miss["position"].astype(np.int64), miss["page_index"].astype(np.int64),
                   miss["slot"].astype(np.int64), page_bytes)
        if n_missing and (plan.positions.max() >= count or plan.page_index.max() >= n_pages
                          or plan.slots.max() >= page_bytes // row_bytes):
            raise ProtocolError("read plan: a position, page index or slot is out of range")
        if n_pages and (np.any(np.diff(plan.pages) <= 0) or int(plan.pages[-1]) * page_bytes >= file_bytes):
            raise ProtocolError("read plan: pages are not ascending and distinct inside the file")
        return plan


def align8(n: int) -> int:
    return -(-n // 8) * 8


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
    (errors.CorruptRows, Status.DATA_LOSS),
    (errors.UnknownLayer, Status.NOT_FOUND),
    (errors.RowOutOfRange, Status.OUT_OF_RANGE),
    (errors.InvalidRequest, Status.INVALID_ARGUMENT),
    (errors.ResourceExhausted, Status.RESOURCE_EXHAUSTED),
    (errors.Unavailable, Status.UNAVAILABLE),
)
_ERROR_OF: dict[Status, type[errors.EngramStoreError]] = {status: cls for cls, status in _STATUS_OF}
_ERROR_OF[Status.INTERNAL] = errors.StorageError
_ERROR_OF[Status.VERSION_MISMATCH] = ProtocolError
_ERROR_OF[Status.DATA_LOSS] = errors.CorruptRows


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
    if cls is errors.CorruptRows:
        return corrupt_rows(message)
    return cls(message)


def corrupt_rows(message: str) -> errors.CorruptRows:
    """The CorruptRows a daemon's message describes: its layer (``layer N: ...``) and the pages
    it names (``page P at ...``; a long list names the first few, the message says how many)."""
    layer = re.search(r"\blayer (-?\d+):", message)
    pages = tuple(int(p) for p in re.findall(r"\bpage (\d+) at\b", message))
    return errors.CorruptRows(message, int(layer.group(1)) if layer else -1, pages)
