"""Every syscall trick of the storage engine, each probed once with a fallback.

- :func:`open_direct`: ``O_DIRECT`` open, verified by one aligned read; when the
  file system refuses it (tmpfs, some overlays) the file is opened buffered with
  ``POSIX_FADV_RANDOM`` and a warning says the page cache now plays a part.
- :func:`create_memfd` / :func:`seal_read_only`: the shared-memory arena, an
  anonymous ``memfd`` that can be sealed so receivers can only map it read-only.
  It takes the first of :func:`.pagesizes.backings` the kernel grants: reserved
  huge pages of the largest size whose pool holds it (``MFD_HUGETLB`` with that
  size's ``MFD_HUGE_*`` flag, never the kernel's default size by accident), else
  ordinary shared memory, where :func:`map_fd` asks for transparent huge pages with
  ``MADV_HUGEPAGE`` (silently ignored where the host does not allow it).
- :func:`aligned_buffer`: anonymous ``mmap`` memory, page aligned (at least the
  table format's 4 KiB), as ``O_DIRECT`` needs.

Page sizes come from the kernel (:mod:`.pagesizes`): 4 KiB, 16 KiB and 64 KiB kernels
alike. ``PAGE`` is the table format's 4 KiB page (checksums, O_DIRECT reads), not the
memory page.

Nothing here runs at import time.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np

from . import pagesizes
from .pagesizes import Backing, PageSizes

log = logging.getLogger(__name__)

PAGE = 4096  # the table format's page: O_DIRECT reads and page checksums
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
    (the cache's row-to-slot maps) then take a TLB miss per huge page (2 MiB on 4 KiB kernels, 512 MiB
    on 64 KiB ones) instead of per page."""
    dtype = np.dtype(dtype)
    mm = aligned_buffer(max(1, n) * dtype.itemsize)
    if huge and hasattr(mmap, "MADV_HUGEPAGE") and len(mm) >= pagesizes.current().huge_bytes:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off on this host: 4 KiB pages, same zeros
    return np.frombuffer(mm, dtype=dtype, count=n)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def shmem_thp() -> bool:
    """Whether ``MADV_HUGEPAGE`` on a memfd mapping can give transparent huge pages:
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is advise, always, within_size
    or force (probed once; False when unknown)."""
    return pagesizes.current().shmem_thp


@dataclass
class Memfd:
    """An anonymous shared-memory file and what backs it (``backing.nbytes == size``)."""

    fd: int
    size: int
    backing: Backing

    @property
    def hugetlb(self) -> bool:
        return self.backing.kind == "hugetlb"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create_memfd(name: str, size: int, *, huge: bool = True, sizes: PageSizes | None = None) -> Memfd:
    """A sealable memfd of ``size`` bytes (rounded up to a whole huge page when it gets reserved
    huge pages: ``Memfd.size``); the first of :func:`.pagesizes.backings` the kernel grants, for
    the kernel's page sizes (``sizes``, read now by default)."""
    sizes = pagesizes.read_page_sizes() if sizes is None else sizes
    return create_memfd_as(name, pagesizes.backings(lambda page: round_up(size, page), sizes, huge=huge))


def create_memfd_as(name: str, options: list[Backing]) -> Memfd:
    """A sealable memfd backed by the first of ``options`` the kernel grants. A hugetlb option
    is granted when the memfd of its size is made and a shared mapping of it reserves its pages
    (the pages are then the file's until it is closed); a refusal is logged and the next option
    tried. An ordinary memfd (the last option) that cannot be made raises OSError."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    for option in options:
        if option.kind != "hugetlb":
            fd = os.memfd_create(name, flags)
            try:
                os.ftruncate(fd, option.nbytes)
            except OSError:
                os.close(fd)
                raise
            return Memfd(fd, option.nbytes, option)
        try:
            fd = os.memfd_create(name, flags | option.memfd_flags)
        except OSError as exc:
            log.info("memfd %s: %s refused by the kernel (%s); trying the next backing", name, option.describe(), exc)
            continue
        try:
            os.ftruncate(fd, option.nbytes)
            mmap.mmap(fd, option.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()  # reserves
        except OSError as exc:
            os.close(fd)
            log.info("memfd %s: %d bytes on %s refused (%s); trying the next backing", name, option.nbytes,
                     option.describe(), exc)
            continue
        log.info("memfd %s: %d bytes on %s", name, option.nbytes, option.describe())
        return Memfd(fd, option.nbytes, option)
    raise ValueError("create_memfd_as: no backing given (pagesizes.backings always ends with ordinary pages)")


def map_fd(fd: int, size: int, *, writable: bool, huge: bool = True, populate: bool = False) -> mmap.mmap:
    """``MAP_SHARED`` mapping of ``fd``; asks for transparent huge pages when ``huge``;
    ``populate`` builds the page tables now (no minor faults on first reads later)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    mm = mmap.mmap(fd, size, flags=flags, prot=prot)
    if huge and hasattr(mmap, "MADV_HUGEPAGE") and size >= pagesizes.current().huge_bytes:
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
