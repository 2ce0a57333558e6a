"""The node's budget of direct page reads in flight, shared by every fetch job reading one device.

A fetch job reads a step's pages directly when its daemon is slow (a hedged read) or not there (a
fallback read), at its queue depth (64 pages in flight). A slow daemon usually means a busy disk: 16
jobs of a vLLM TP=8 server (32 under SGLang) each adding 64 reads to that disk make it slower still,
so steps miss their deadline where waiting for the daemon would have served them. So the direct reads
of all jobs on a node that read the same device share one budget of pages in flight
(``fetch/direct_budget.h``): a read takes what it may use of it, at least one granule of
:data:`GRANULE_PAGES` pages, and reads at the depth it got; with none free the step waits for its daemon
(or, without one, for the budget) up to its deadline instead of reading.

The budget is a file, ``engram-store-direct-v2-<major>-<minor>`` (the table files' device) in
:data:`DIR_ENV` (default ``/dev/shm``; a directory every engine container on the node mounts, such as
the daemon socket's ``hostPath``, makes it node-wide across pods too). Its size, in pages:
:data:`PAGES_ENV` if set (0: no budget, direct reads unbounded), else the device's queue depth
(``/sys/dev/block/<major>:<minor>/queue/nr_requests``, a partition's disk's), else
:data:`DEFAULT_PAGES`. The last job to open it sets it (all engines of a node normally run with one
setting). Granules are OFD locks on bytes of the file, so a process that dies gives its share back.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import errors

log = logging.getLogger(__name__)

PAGES_ENV = "ENGRAM_STORE_DIRECT_BUDGET_PAGES"  # pages in flight of all jobs' direct reads of a device; 0: none
DIR_ENV = "ENGRAM_STORE_DIRECT_BUDGET_DIR"  # where the budget files are (shared by the node's engines)
DEFAULT_DIR = "/dev/shm"
DEFAULT_PAGES = 1024  # a device whose queue depth sysfs does not give (tmpfs, overlay, network filesystems)
GRANULE_PAGES = 16  # the budget is taken in granules of this many pages (a job at depth 64 holds 4)
MAX_GRANULES = 4096  # fetch/direct_budget.h BUDGET_MAX_GRANULES: a budget of 65536 pages at most
HEADER_BYTES = 4096  # the header page; then a byte a granule: its holder's mark (fetch/direct_budget.h)
FILE_BYTES = 8192


@dataclass(frozen=True)
class Header:
    """The budget file's first page (``fetch/direct_budget.h`` reads and updates it in place)."""

    magic: int  # MAGIC
    version: int  # VERSION
    granules: int  # granules in the budget now (the last sizing wins)
    granule_pages: int  # pages a granule
    reserved: int  # pages reserved now by all jobs' direct reads (a metric: the locks are the budget; a granule
    # whose holder died holding it stays counted until another job takes it over)
    reserved_max: int  # the most pages reserved at once since the file was made
    refused: int  # direct reads refused for want of budget

    LAYOUT = struct.Struct("<IIIIqqq")
    MAGIC = 0x54474442  # "BDGT"
    VERSION = 2
    OFFSETS = {"magic": 0, "version": 4, "granules": 8, "granule_pages": 12, "reserved": 16, "reserved_max": 24,
               "refused": 32}

    @classmethod
    def unpack(cls, data: bytes) -> "Header":
        h = cls(*cls.LAYOUT.unpack_from(data))
        if h.magic != cls.MAGIC or h.version != cls.VERSION:
            raise errors.ConfigError(f"not a direct-read budget file of this version (magic {h.magic:#x}, version "
                                     f"{h.version}; expected {cls.MAGIC:#x}, {cls.VERSION}): remove it")
        return h

    @property
    def pages(self) -> int:
        return self.granules * self.granule_pages


def check_native_layout(native: Any) -> None:
    """The native module's offsets are this layout's (a stale build is refused)."""
    got = dict(native.BUDGET_OFFSETS)
    want = Header.OFFSETS | {"locks": HEADER_BYTES, "magic_value": Header.MAGIC, "version_value": Header.VERSION,
                             "held": HEADER_BYTES, "file_bytes": FILE_BYTES}
    if got != want:
        raise errors.ConfigError(f"engram_store/fetch/_fetch.c and fetch/budget.py disagree on the budget "
                                 f"file (C {got}, Python {want}); rebuild the native modules (pip install -e .)")


def device_queue_depth(dev: int, sysfs: Path = Path("/sys")) -> int | None:
    """The block device ``dev``'s queue depth (a partition's: its disk's), or None when sysfs has none."""
    block = (sysfs / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").resolve()
    for queue in (block / "queue", block.parent / "queue"):
        try:
            return int((queue / "nr_requests").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None


def budget_pages(dev: int, sysfs: Path = Path("/sys")) -> int:
    """The budget for device ``dev``, in pages: the env, else the device's queue depth, else the default."""
    text = os.environ.get(PAGES_ENV, "")
    if text:
        try:
            pages = int(text)
        except ValueError:
            raise errors.ConfigError(f"{PAGES_ENV}={text!r}: expected pages in flight, e.g. 256 (0: no budget)") from None
        if pages < 0:
            raise errors.ConfigError(f"{PAGES_ENV}={text!r}: expected pages >= 0 (0: no budget)")
        return pages
    return device_queue_depth(dev, sysfs) or DEFAULT_PAGES


def budget_path(dev: int) -> Path:
    name = f"engram-store-direct-v{Header.VERSION}-{os.major(dev)}-{os.minor(dev)}"  # (another layout: another file)
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR) / name


def open_budget(dev: int) -> int:
    """An fd of the budget file of device ``dev`` (an open file description of its own: the caller's
    granules are its locks), made or resized to :func:`budget_pages`; -1 when there is no budget."""
    pages = budget_pages(dev)
    if pages == 0:
        return -1
    granules = min(max(1, pages // GRANULE_PAGES), MAX_GRANULES)
    path = budget_path(dev)
    try:
        if not path.exists():
            _make(path)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.ConfigError(f"the node's direct-read budget {path} cannot be opened ({exc}): give the engines a "
                                 f"directory they share ({DIR_ENV}), or {PAGES_ENV}=0 for no budget") from None
    try:
        before = Header.unpack(os.pread(fd, Header.LAYOUT.size, 0))
        _check_locks(fd, path)
        if before.granules not in (1, granules) and before.reserved_max:  # (1: as made)
            log.info("engram-store: the direct-read budget %s was %d pages, now %d (the last job opened sizes it)",
                     path, before.pages, granules * GRANULE_PAGES)
        os.pwrite(fd, struct.pack("<I", granules), Header.OFFSETS["granules"])  # the last sizing wins
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_locks(fd: int, path: Path) -> None:
    """The filesystem takes OFD locks (asked of the first granule: F_OFD_GETLK takes nothing)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, HEADER_BYTES, 1, 0))
    except OSError as exc:
        raise errors.ConfigError(f"the node's direct-read budget {path} cannot be locked ({exc}): put it on a local "
                                 f"filesystem ({DIR_ENV}), or {PAGES_ENV}=0 for no budget") from None


def _make(path: Path) -> None:
    """The file, made whole then linked into place (a job opening it meanwhile never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".engram-store-direct-")
    try:
        header = Header(Header.MAGIC, Header.VERSION, 1, GRANULE_PAGES, 0, 0, 0)
        os.write(fd, Header.LAYOUT.pack(*[getattr(header, f) for f in Header.OFFSETS]).ljust(FILE_BYTES, b"\0"))
        os.fchmod(fd, 0o660)  # the engines of one user or group take part (others get ConfigError)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another job made it first
    finally:
        os.close(fd)
        os.unlink(tmp)


def read(dev: int) -> Header | None:
    """The budget file's header now (metrics, the benchmark), or None without one."""
    try:
        return Header.unpack(budget_path(dev).read_bytes()[: Header.LAYOUT.size])
    except FileNotFoundError:
        return None
