"""The table files a fetch job reads itself, and the identity they are checked against.

:class:`TableIdentity` is what a daemon's Info says its tables are: the spec, the rows of each
layer and, per layer, the files it reads (path, ``st_dev``, ``st_ino``, size: the data file or each
stripe) with the zlib crc32 of the page checksums it checks against. An engine captures it once,
when it connects (:class:`~engram_store.integrations.tables.EngramStoreTables`), and every fetch
job it makes is built from it: the job opens those very files and refuses a daemon that answers
later with another identity (a restart on another table set), naming both.

:class:`TableFiles` opens one layer's files as an identity describes them, checked: the data files
O_DIRECT, each the file described (device, inode, size); the page checksums read into private memory
(a :class:`Checksums` shared by the jobs of one checksum file in a process: 4 bytes per 4 KiB page,
about 98 MiB for a DeepSeek-V4.1 layer), never mapped, so a checksum file truncated under a running
engine cannot raise SIGBUS. Each file's ``fstat`` at open goes to the native job, which re-checks the
files before and after every direct step: a file written, truncated, replaced or removed since is a
clear error naming layer and file, never wrong rows.
"""

from __future__ import annotations

import os
import threading
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import errors
from ..format.manifest import PageCrcHeader
from ..native import syscalls


@dataclass(frozen=True)
class TableIdentity:
    """A daemon's tables as its Info described them at one moment (see the module docstring)."""

    address: str
    spec: dict[str, Any]
    rows: dict[str, int]
    layer_files: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_info(cls, info: dict[str, Any], address: str) -> "TableIdentity":
        return cls(address, dict(info["spec"]), {str(k): int(v) for k, v in (info.get("rows") or {}).items()},
                   {str(k): v for k, v in (info.get("layer_files") or {}).items()})

    def described(self, layer: int) -> dict[str, Any]:
        """Layer ``layer``'s files, or ``UnknownLayer`` / ``StorageError`` saying why there are none."""
        if str(layer) not in self.rows:
            raise errors.UnknownLayer(f"layer {layer}: the daemon at {self.address} serves layers "
                                      f"{sorted(int(k) for k in self.rows)}")
        described = self.layer_files.get(str(layer))
        if not described:
            raise errors.StorageError(f"the daemon at {self.address} does not describe layer {layer}'s table files "
                                      "(a daemon of another version, or the layer is unavailable): a fetch job "
                                      "needs them to read pages itself while the daemon is gone")
        return described

    def mismatch(self, info: dict[str, Any], layer: int) -> str | None:
        """None when ``info`` (a daemon's Info now) describes the same tables for ``layer``; else both."""
        mine = self.layer_files.get(str(layer)) or {}
        theirs = (info.get("layer_files") or {}).get(str(layer)) or {}
        if info.get("spec") == self.spec and _same_files(mine, theirs):
            return None
        return (f"connected to {_describe(self.spec, layer, mine)}; it now serves "
                f"{_describe(info.get('spec') or {}, layer, theirs)}")


def _same_files(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (bool(a) and a.get("crc32") == b.get("crc32")
            and [tuple(f[1:]) for f in a.get("files", ())] == [tuple(f[1:]) for f in b.get("files", ())])


def _describe(spec: dict[str, Any], layer: int, files: dict[str, Any]) -> str:
    name = f"spec {spec.get('name')!r}"
    if not files:
        return f"{name} with no table files described for layer {layer}"
    parts = ", ".join(f"{path} (device {dev}, inode {ino}, {size} bytes)" for path, dev, ino, size in files["files"])
    return f"{name}, layer {layer} files {parts}, page checksums crc32 {int(files['crc32']):#010x}"


class TableFiles:
    """One layer's data files (O_DIRECT) and page checksums (in private memory), opened as ``described``
    (an identity's entry) and checked to be the very files described."""

    def __init__(self, layer: int, described: dict[str, Any], native: Any) -> None:
        self.layer = layer
        self.watched: list[tuple[int, str, int, int, int, int, int]] = []  # (fd, path, fstat...) for the job
        try:
            for path, dev, ino, size in described["files"]:
                fd = _open(path, direct=True)
                st = self._watch(fd, path)
                if (st.st_dev, st.st_ino, st.st_size) != (dev, ino, size):
                    raise errors.StorageError(
                        f"layer {layer}: {path} is not the file this engine connected to (now device {st.st_dev}, "
                        f"inode {st.st_ino}, {st.st_size} bytes; at connect device {dev}, inode {ino}, {size} bytes): "
                        "the table set was replaced since; restart the daemon and the engine on one table set")
            crc_file = described["crc_file"]
            fd = _open(crc_file, direct=False)
            st = self._watch(fd, crc_file)
            data = _read_all(fd, st.st_size, crc_file)
            header = PageCrcHeader.unpack(data[:PageCrcHeader.STRUCT.size], crc_file)
            pages = int(described["pages"])
            if header.layer != layer or header.pages != pages or len(data) < header.file_bytes:
                raise errors.StorageError(f"layer {layer}: {crc_file} holds {header.pages} page checksums of layer "
                                          f"{header.layer} ({len(data)} bytes), the daemon read {pages} of layer "
                                          f"{layer}")
            crcs = np.frombuffer(data, dtype="<u4", count=pages, offset=PageCrcHeader.STRUCT.size)
            crc32 = zlib.crc32(crcs)
            if crc32 != int(described["crc32"]):
                raise errors.StorageError(f"layer {layer}: {crc_file} is not the checksum file this engine connected "
                                          f"to (its checksums' crc32 is {crc32:#010x}, at connect "
                                          f"{int(described['crc32']):#010x}): the table set was replaced since; "
                                          "restart the daemon and the engine on one table set")
            self.checksums = _checksums(native, (crc_file, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                 st.st_ctime_ns, crc32), crcs)
            self.rows_per_page = int(described["rows_per_page"])
        except BaseException:
            self.close()
            raise

    def _watch(self, fd: int, path: str) -> os.stat_result:
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self.watched.append((fd, path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return st

    def take(self) -> tuple[tuple[int, str, int, int, int, int, int], ...]:
        """The files with their descriptors, now the native job's to close."""
        watched, self.watched = tuple(self.watched), []
        return watched

    def close(self) -> None:
        for fd, *_ in self.watched:
            os.close(fd)
        self.watched = []


_CHECKSUMS: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()
_CHECKSUMS_LOCK = threading.Lock()


def _checksums(native: Any, key: tuple, crcs: np.ndarray) -> Any:
    """One private copy per checksum file (its identity and content) in this process."""
    with _CHECKSUMS_LOCK:
        got = _CHECKSUMS.get(key)
        if got is None:
            got = _CHECKSUMS[key] = native.Checksums(crcs)
        return got


def _read_all(fd: int, size: int, path: str) -> bytearray:
    buf = bytearray(size)
    view, done = memoryview(buf), 0
    while done < size:
        got = os.preadv(fd, [view[done:]], done)
        if not got:
            raise errors.StorageError(f"{path}: {done} bytes read of {size} (the file shrank while it was opened)")
        done += got
    return buf


def _open(path: str, *, direct: bool) -> int:
    flags = os.O_RDONLY | os.O_CLOEXEC
    try:
        return os.open(path, flags | (syscalls.O_DIRECT if direct else 0))
    except OSError as exc:
        if not direct or not syscalls.O_DIRECT or exc.errno != 22:  # EINVAL: a filesystem without O_DIRECT (tmpfs)
            raise errors.StorageError(f"cannot open the table file {path}: {exc.strerror}") from None
        return os.open(path, flags)
