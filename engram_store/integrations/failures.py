"""One engine's failure board: a cached layer's fetch failure on any rank stops the rank that returns tokens.

In vLLM and SGLang every TP rank (and, for DP-sharded tables, every rank of the Engram DP group) fetches
its own heads of a cached layer, but the sampled tokens reach clients from one rank only (vLLM's output
rank; SGLang's first TP rank). A page that fails its checksum on another rank zeroes rows that reach the
output rank through the model's collectives, while that rank's own fetch jobs saw nothing wrong. So the
first failure of any fetch job is written to a board all ranks of the server share, and every failure
check (the engines' host-visible points) reads it.

The board is one 4 KiB page of shared memory: a file under ``/dev/shm`` made by the first process of the
server that loads an engine plugin (vLLM's API server or ``LLM``; SGLang's launcher), whose path goes to
the processes it starts in ``ENGRAM_STORE_FAILURE_BOARD``; they map it when their plugin loads. The
maker removes the file when it exits (the mappings stay valid). Processes started some other way (Ray
workers, ``external_launcher``, other nodes) each have a board of their own: there, a failure stops the
rank that saw it only.

Layout (:data:`BOARD`): the first failure of all ranks wins. The native run function of a fetch job writes
its failure before the step's rows are used (``native/fetch_board.h``: it takes ``claim`` 0 -> 1 with a
compare-and-swap, writes the fields, then sets ``failed`` to 1), so no check can run between a failed
step and its record; Python writes a failure it found another way the same order (:func:`record`).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import struct
import tempfile
import threading
from dataclasses import dataclass

from ..errors import CorruptRows, StorageError

log = logging.getLogger(__name__)

ENV = "ENGRAM_STORE_FAILURE_BOARD"
MAGIC = 0x42464745  # "EGFB"
VERSION = 1
BOARD_BYTES = 4096
SHOWN_PAGES = 6
MESSAGE_BYTES = BOARD_BYTES - 64 - 8 * SHOWN_PAGES
# magic u32, version u32, failed u32 (0, then 1 once the rest is whole), kind u32 (1 corrupt pages, 2 a read
# failed), pid i32 (the process that failed), layer i32, npages u32 (of pages below), claim u32 (0, then 1
# for the one writer), reserved u32 * 8, pages i64[SHOWN_PAGES] (the first bad pages), message (UTF-8, NUL-ended)
BOARD = struct.Struct(f"<IIIIiiII8I{SHOWN_PAGES}q{MESSAGE_BYTES}s")
OFFSETS = {"bytes": BOARD_BYTES, "failed": 8, "kind": 12, "pid": 16, "layer": 20, "npages": 24, "claim": 28,
           "pages": 64, "message": 64 + 8 * SHOWN_PAGES}  # what native/fetch_board.h writes at
KIND_CORRUPT, KIND_IO = 1, 2
assert BOARD.size == BOARD_BYTES and struct.calcsize("<IIIIiiII8I") == OFFSETS["pages"]


@dataclass(frozen=True)
class Failure:
    """The board's first failure."""

    pid: int
    layer: int
    kind: int
    pages: tuple[int, ...]
    message: str

    def error(self) -> StorageError:
        where = f"engram-store: a fetch job of process {self.pid} failed: {self.message}"
        if self.kind == KIND_CORRUPT:
            return CorruptRows(where, self.layer, self.pages)
        return StorageError(where)


class Board:
    """A mapped failure board (see the module docstring)."""

    def __init__(self, path: str, mapping: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.map = mapping  # writable, shared: the fetch jobs' native code writes here too
        self.owner = owner
        self._lock = threading.Lock()

    @classmethod
    def create(cls) -> "Board":
        directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix=f"engram-store-board-{os.getpid()}-", dir=directory)
        try:
            os.ftruncate(fd, BOARD_BYTES)
            mapping = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        mapping[:8] = struct.pack("<II", MAGIC, VERSION)
        board = cls(path, mapping, owner=True)
        atexit.register(board.remove)
        return board

    @classmethod
    def attach(cls, path: str) -> "Board":
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != BOARD_BYTES:
                raise StorageError(f"{ENV}={path} is not an engram-store failure board ({BOARD_BYTES} bytes)")
            mapping = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version = struct.unpack_from("<II", mapping)
        if (magic, version) != (MAGIC, VERSION):
            raise StorageError(f"{ENV}={path}: not an engram-store failure board of version {VERSION}")
        return cls(path, mapping, owner=False)

    def remove(self) -> None:
        if self.owner:
            self.owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def failure(self) -> Failure | None:
        """The first failure written here, or None."""
        fields = BOARD.unpack_from(self.map)
        if not fields[2]:
            return None
        kind, pid, layer, npages = fields[3], fields[4], fields[5], fields[6]
        pages = tuple(fields[16: 16 + min(npages, SHOWN_PAGES)])
        message = fields[16 + SHOWN_PAGES].split(b"\0", 1)[0].decode("utf-8", "replace")
        return Failure(pid, layer, kind, pages, message)

    def attach_job(self, native_job) -> None:
        """Let a fetch job's run function write its failures here (``_fetch.Job.set_board``), after checking
        that the native module writes this layout."""
        from ..native import load

        native = load("_fetch", "cached Engram layers cannot be served to engines")
        if native is not None and getattr(native, "BOARD_OFFSETS", None) != OFFSETS:
            raise StorageError(f"engram_store.native._fetch writes a failure board at {native.BOARD_OFFSETS}, "
                               f"this Python reads {OFFSETS}: reinstall engram-store (native modules out of date)")
        native_job.set_board(self.map)

    def record(self, error: StorageError) -> None:
        """Write ``error`` as the board's failure unless one is there already."""
        with self._lock:
            claim = OFFSETS["claim"]
            if self.failure() is not None or struct.unpack_from("<I", self.map, claim)[0]:
                return  # a native writer may have claimed it and be writing: its record stands
            self.map[claim: claim + 4] = struct.pack("<I", 1)
            pages = tuple(int(p) for p in getattr(error, "pages", ())[:SHOWN_PAGES])
            kind = KIND_CORRUPT if isinstance(error, CorruptRows) else KIND_IO
            message = str(error).encode("utf-8")[: MESSAGE_BYTES - 1]
            body = BOARD.pack(MAGIC, VERSION, 0, kind, os.getpid(), int(getattr(error, "layer", -1)), len(pages), 1,
                              *([0] * 8), *(pages + (0,) * (SHOWN_PAGES - len(pages))), message)
            self.map[12:] = body[12:]  # everything but the flag, then the flag: readers see a whole record
            self.map[8:12] = struct.pack("<I", 1)


_board_lock = threading.Lock()
_board: Board | None = None


def board() -> Board:
    """This process's board: the one ``ENGRAM_STORE_FAILURE_BOARD`` names, else a new one (then named
    there for the processes this one starts)."""
    global _board
    with _board_lock:
        if _board is None:
            path = os.environ.get(ENV, "")
            if path and os.path.exists(path):
                _board = Board.attach(path)
            else:
                if path:
                    log.warning("engram-store: %s=%s does not exist; this process keeps a failure board of its own",
                                ENV, path)
                _board = Board.create()
                os.environ[ENV] = _board.path
        return _board


def check() -> None:
    """Raise the board's failure, if any (another rank's failure stops this one too)."""
    failure = board().failure()
    if failure is not None:
        raise failure.error()


def record(error: StorageError) -> None:
    board().record(error)
