"""One engine's failure board: a cached layer's fetch failure on any rank stops the rank that returns tokens.

In vLLM and SGLang every TP rank (and, for DP-sharded tables, every rank of the Engram DP group) fetches
its own heads of a cached layer, but the sampled tokens reach clients from one rank only (vLLM's output
rank; SGLang's first TP rank). A page that fails its checksum on another rank zeroes rows that reach the
output rank through the model's collectives, while that rank's own fetch jobs saw nothing wrong. So the
first failure of any fetch job is written to a board all ranks of the server share, and every failure
check (the engines' host-visible points) reads it.

The board is one 4 KiB page of shared memory made by the first process of the server that loads an
engine plugin (vLLM's API server or ``LLM``; SGLang's launcher): a sealed memfd (it cannot be shrunk
or grown, so a mapping never faults; its page is allocated when it is made, so a full ``/dev/shm``
or memory cgroup is an error then, never a SIGBUS later), reached by the processes it starts through
``/proc/<maker>/fd/<fd>``: ``ENGRAM_STORE_FAILURE_BOARD`` holds that path and the board's random id,
which its page holds too. A process attaches only to a board whose maker is its own ancestor (the
processes a server starts), which is a sealed memfd of its own user with the id the variable names;
else (another server's board inherited through the environment, a maker that died and whose pid was
reused, a file put there by someone else) it makes its own, with one WARNING saying why. Opening
another process's ``/proc/<pid>/fd`` takes the access ptrace checks for reading it, so no process
without that (other users; same-user processes that Yama or a non-dumpable engine keep out) can
reach the board at all: none can forge, clear or truncate a failure. Processes started some other
way (Ray workers, ``external_launcher``, other nodes, other pods) each have a board of their own and
agree per step instead (:mod:`.agreement`). Nothing is left on disk; files of the earlier layout
(``/dev/shm/engram-store-board-<pid>-*``) whose maker is gone are removed when a board is made.

Layout (:data:`BOARD`): the first failure of all ranks wins. The native run function of a fetch job writes
its failure before the step's rows are used (``fetch/board.h``: it takes ``claim`` 0 -> 1 with a
compare-and-swap, writes the fields, then sets ``failed`` to 1), so no check can run between a failed
step and its record; Python writes a failure it found another way the same order (:func:`record`).
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import threading
from dataclasses import dataclass

from ..errors import CorruptRows, StorageError

log = logging.getLogger(__name__)

ENV = "ENGRAM_STORE_FAILURE_BOARD"
MAGIC = 0x42464745  # "EGFB"
VERSION = 2  # 2: a sealed memfd with its id in the page
BOARD_BYTES = 4096
SHOWN_PAGES = 6
MESSAGE_BYTES = BOARD_BYTES - 64 - 8 * SHOWN_PAGES
# magic u32, version u32, failed u32 (0, then 1 once the rest is whole), kind u32 (1 corrupt pages, 2 a read
# failed), pid i32 (the process that failed), layer i32, npages u32 (of pages below), claim u32 (0, then 1
# for the one writer), reserved u32 * 8 (the first 4: the board's id), pages i64[SHOWN_PAGES] (the first bad pages), message (UTF-8, NUL-ended)
BOARD = struct.Struct(f"<IIIIiiII8I{SHOWN_PAGES}q{MESSAGE_BYTES}s")
OFFSETS = {"bytes": BOARD_BYTES, "failed": 8, "kind": 12, "pid": 16, "layer": 20, "npages": 24, "claim": 28,
           "pages": 64, "message": 64 + 8 * SHOWN_PAGES}  # what fetch/board.h writes at
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


SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL")  # a board's size is fixed for good
ID_AT = 32  # the board's id: 16 bytes of the reserved words
LEGACY_GLOB = "/dev/shm/engram-store-board-*"


class Board:
    """A mapped failure board (see the module docstring)."""

    def __init__(self, path: str, board_id: bytes, mapping: mmap.mmap, fd: int | None) -> None:
        self.path = path  # /proc/<maker>/fd/<fd>
        self.id = board_id
        self.map = mapping  # writable, shared: the fetch jobs' native code writes here too
        self._fd = fd  # the maker keeps the memfd open: the path stays valid while it lives
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        """What ``ENGRAM_STORE_FAILURE_BOARD`` holds for the processes this one starts."""
        return f"{self.path}#{self.id.hex()}"

    @property
    def owner(self) -> bool:
        return self._fd is not None

    @classmethod
    def create(cls) -> "Board":
        import fcntl

        _remove_legacy_files()
        fd = os.memfd_create("engram-store-board", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, BOARD_BYTES)
            try:
                os.posix_fallocate(fd, 0, BOARD_BYTES)  # the page now, or an error now (never a SIGBUS later)
            except OSError as exc:
                raise StorageError(f"engram-store: no memory for the 4 KiB failure board ({exc.strerror}); "
                                   "the engine cannot start") from exc
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _seal_bits())
            mapping = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        board_id = secrets.token_bytes(16)
        mapping[:8] = struct.pack("<II", MAGIC, VERSION)
        mapping[ID_AT: ID_AT + 16] = board_id
        return cls(f"/proc/{os.getpid()}/fd/{fd}", board_id, mapping, fd)

    @classmethod
    def attach(cls, name: str) -> "Board":
        """The board ``name`` (an ``ENGRAM_STORE_FAILURE_BOARD`` value) names, after every check; raises
        ``StorageError`` saying which failed."""
        import fcntl

        match = re.fullmatch(r"(/proc/(\d+)/fd/\d+)#([0-9a-f]{32})", name)
        if match is None:
            raise StorageError(f"{ENV}={name!r} is not a failure board made by this version of engram-store")
        path, maker, board_id = match.group(1), int(match.group(2)), bytes.fromhex(match.group(3))
        if maker not in _ancestors():
            raise StorageError(f"{ENV} names the board of process {maker}, which did not start this process "
                               "(another server's board, inherited through the environment)")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageError(f"{ENV}: {path}: {exc.strerror} (its maker is gone?)") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != BOARD_BYTES:
                raise StorageError(f"{ENV}: {path} is not a {BOARD_BYTES}-byte file of user {os.geteuid()}")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & _seal_bits() != _seal_bits():
                raise StorageError(f"{ENV}: {path} is not a sealed failure board")
            mapping = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version = struct.unpack_from("<II", mapping)
        if (magic, version) != (MAGIC, VERSION) or bytes(mapping[ID_AT: ID_AT + 16]) != board_id:
            mapping.close()
            raise StorageError(f"{ENV}: {path} is not the failure board {board_id.hex()} (a reused pid or fd?)")
        return cls(path, board_id, mapping, None)

    def remove(self) -> None:
        """Close the maker's memfd (the mappings stay valid; no new process can attach)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

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

        native = load("_fetch", "cached Engram layers cannot be served to engines", package="engram_store.fetch")
        if native is not None and getattr(native, "BOARD_OFFSETS", None) != OFFSETS:
            raise StorageError(f"engram_store.fetch._fetch writes a failure board at {native.BOARD_OFFSETS}, "
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
            reserved = list(struct.unpack_from("<8I", self.map, 32))  # the board's id among them
            body = BOARD.pack(MAGIC, VERSION, 0, kind, os.getpid(), int(getattr(error, "layer", -1)), len(pages), 1,
                              *reserved, *(pages + (0,) * (SHOWN_PAGES - len(pages))), message)
            self.map[12:] = body[12:]  # everything but the flag, then the flag: readers see a whole record
            self.map[8:12] = struct.pack("<I", 1)


def _seal_bits() -> int:
    import fcntl

    bits = 0
    for name in SEALS:
        bits |= getattr(fcntl, name)
    return bits


def _ancestors() -> set[int]:
    """This process and its ancestors' pids (from /proc: the parent of each, up to pid 1)."""
    pid, seen = os.getpid(), set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat_line = f.read()
        except OSError:
            break
        pid = int(stat_line[stat_line.rindex(b")") + 2:].split()[1])  # the field after the state: ppid
    return seen


def _remove_legacy_files() -> None:
    """Boards of the earlier layout (files in /dev/shm) whose maker is gone: removed."""
    for path in glob.glob(LEGACY_GLOB):
        match = re.match(r".*/engram-store-board-(\d+)-", path)
        try:
            if match and os.stat(path).st_uid == os.geteuid() and not os.path.exists(f"/proc/{match.group(1)}"):
                os.unlink(path)
        except OSError:
            pass


_board_lock = threading.Lock()
_board: Board | None = None


def board() -> Board:
    """This process's board: the one ``ENGRAM_STORE_FAILURE_BOARD`` names when it may attach to it, else a
    new one (then named there for the processes this one starts)."""
    global _board
    with _board_lock:
        if _board is None:
            name = os.environ.get(ENV, "")
            if name:
                try:
                    _board = Board.attach(name)
                except StorageError as exc:
                    log.warning("engram-store: %s; this process makes a failure board of its own (its ranks then "
                                "agree on failures at each step)", exc)
            if _board is None:
                _board = Board.create()
                os.environ[ENV] = _board.name
        return _board


def renew() -> None:
    """A new engine in this process after a failed one: its own board (the failed engine's failure
    must not stop it), when this process made the board; else the board as it is."""
    global _board
    with _board_lock:
        if _board is not None and _board.owner and _board.failure() is not None:
            _board.remove()
            _board = Board.create()
            os.environ[ENV] = _board.name


def check() -> None:
    """Raise the board's failure, if any (another rank's failure stops this one too)."""
    failure = board().failure()
    if failure is not None:
        raise failure.error()


def record(error: StorageError) -> None:
    board().record(error)
