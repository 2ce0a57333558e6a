"""Every syscall trick of the storage engine, each probed once with a fallback.

- :func:`open_direct`: ``O_DIRECT`` open, verified by one aligned read; when the
  file system refuses it (tmpfs, some overlays) the file is opened buffered with
  ``POSIX_FADV_RANDOM`` and a warning says the page cache now plays a part.
- :func:`create_memfd` / :func:`seal_read_only`: the shared-memory arena, an
  anonymous ``memfd`` that can be sealed so receivers can only map it read-only.
  ``MFD_HUGETLB`` is used only when enough huge pages are reserved; otherwise
  :func:`map_fd` asks for transparent huge pages with ``MADV_HUGEPAGE`` (silently
  ignored where the host does not allow it).
- :func:`aligned_buffer`: anonymous ``mmap`` memory, page (4 KiB) aligned, as
  ``O_DIRECT`` needs.

Nothing here runs at import time.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

PAGE = 4096
HUGE_PAGE = 2 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)

# fcntl sealing constants (linux/fcntl.h); Python exposes all but FUTURE_WRITE.
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL = 1
F_SEAL_SHRINK = 2
F_SEAL_GROW = 4
F_SEAL_WRITE = 8
F_SEAL_FUTURE_WRITE = 16
READ_ONLY_SEALS = F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE


@dataclass
class OpenedFile:
    """A file descriptor and whether reads through it bypass the page cache."""

    fd: int
    direct: bool
    size: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_direct(path: str | os.PathLike) -> OpenedFile:
    """Open ``path`` read-only with ``O_DIRECT``, or buffered when refused (logged)."""
    path = os.fspath(path)
    size = os.stat(path).st_size
    if O_DIRECT:
        try:
            fd = os.open(path, os.O_RDONLY | O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        else:
            if _direct_read_works(fd, size):
                return OpenedFile(fd, True, size)
            os.close(fd)
    log.warning("%s: O_DIRECT refused by the file system; reading through the page cache", path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return OpenedFile(fd, False, size)


def _direct_read_works(fd: int, size: int) -> bool:
    """Some file systems accept the O_DIRECT flag and fail the first read instead."""
    if size < PAGE:
        return True
    buf = aligned_buffer(PAGE)
    try:
        os.preadv(fd, [buf], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        buf.close()


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous private memory of ``nbytes`` (rounded up to a page), page aligned."""
    return mmap.mmap(-1, max(PAGE, round_up(nbytes, PAGE)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def zeroed_array(n: int, dtype, *, huge: bool = True) -> np.ndarray:
    """``n`` zeros of ``dtype`` in anonymous private memory (pages are given only when written), on
    transparent huge pages where the host allows (``madvise``): large tables read at random positions
    (the cache's row-to-slot maps) then take a TLB miss per 2 MiB instead of per 4 KiB."""
    dtype = np.dtype(dtype)
    mm = aligned_buffer(max(1, n) * dtype.itemsize)
    if huge and hasattr(mmap, "MADV_HUGEPAGE") and len(mm) >= HUGE_PAGE:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off on this host: 4 KiB pages, same zeros
    return np.frombuffer(mm, dtype=dtype, count=n)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@functools.cache
def hugetlb_pages_free() -> int:
    """Free reserved 2 MiB huge pages (``/proc/meminfo``), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@functools.cache
def shmem_thp() -> bool:
    """Whether ``MADV_HUGEPAGE`` on a memfd mapping can give transparent huge pages:
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is advise, always, within_size
    or force (probed once; False when unknown)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            chosen = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return False
    return chosen in ("always", "within_size", "advise", "force")


@dataclass
class Memfd:
    """An anonymous shared-memory file and how it was made."""

    fd: int
    size: int
    hugetlb: bool

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create_memfd(name: str, size: int, *, huge: bool = True) -> Memfd:
    """A sealable memfd of ``size`` bytes; backed by reserved huge pages when ``huge``
    and the host has enough of them, else by ordinary shared memory."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    if huge and size and size % HUGE_PAGE == 0 and hugetlb_pages_free() >= size // HUGE_PAGE:
        try:
            fd = os.memfd_create(name, flags | os.MFD_HUGETLB)
            os.ftruncate(fd, size)
            log.info("memfd %s: %d bytes on reserved huge pages", name, size)
            return Memfd(fd, size, True)
        except OSError as exc:
            log.debug("memfd %s: MFD_HUGETLB refused (%s); using ordinary pages", name, exc)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return Memfd(fd, size, False)


def map_fd(fd: int, size: int, *, writable: bool, huge: bool = True, populate: bool = False) -> mmap.mmap:
    """``MAP_SHARED`` mapping of ``fd``; asks for transparent huge pages when ``huge``;
    ``populate`` builds the page tables now (no minor faults on first reads later)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    mm = mmap.mmap(fd, size, flags=flags, prot=prot)
    if huge and hasattr(mmap, "MADV_HUGEPAGE") and size >= HUGE_PAGE:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled for shmem on this host: ordinary pages, same bytes
    return mm


def seal_read_only(fd: int) -> None:
    """Seal ``fd`` against writes, shrink and grow (and further seals). Every writable
    shared mapping of it must be unmapped first (the kernel answers EBUSY otherwise)."""
    add_seals(fd, READ_ONLY_SEALS)


def add_seals(fd: int, flags: int) -> None:
    """``F_ADD_SEALS``; OSError (EPERM) when the memfd was not created sealable."""
    fcntl.fcntl(fd, F_ADD_SEALS, flags)


def seals(fd: int) -> int:
    return fcntl.fcntl(fd, F_GET_SEALS)


def as_array(buf, nbytes: int | None = None, *, writable: bool = True) -> np.ndarray:
    """uint8 view of a buffer (mmap or bytearray), no copy; read-only when not ``writable``."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr = arr if nbytes is None else arr[:nbytes]
    if not writable:
        arr = arr.view()
        arr.setflags(write=False)
    return arr
