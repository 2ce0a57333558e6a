"""The kernel's page sizes, read from the kernel, never assumed, and what backs a shared-memory area.

x86-64 kernels run 4 KiB pages with 2 MiB and 1 GiB huge pages; aarch64 kernels may run 4 KiB,
16 KiB or 64 KiB pages (Grace / GB200 / GB300 hosts commonly 64 KiB), where the huge page sizes
are 64 KiB, 2 MiB, 32 MiB, 1 GiB (4 KiB kernels), 2 MiB, 32 MiB, 1 GiB (16 KiB) or 2 MiB, 512 MiB,
16 GiB (64 KiB), the default (``Hugepagesize``, what ``MFD_HUGETLB`` without a size flag takes)
being 2 MiB, 32 MiB or 512 MiB. So:

- :func:`read_page_sizes`: the memory page size (``sysconf(_SC_PAGE_SIZE)``), every reserved
  huge page pool (``/sys/kernel/mm/hugepages/hugepages-<kB>kB``: total, free, reserved), the
  default huge page size (``/proc/meminfo`` ``Hugepagesize``) and the transparent huge page
  size and setting for shared memory (``/sys/kernel/mm/transparent_hugepage``); every path is
  a parameter, so tests give the files of a 16 KiB or 64 KiB kernel. :func:`current` probes once.
- :func:`backings`: the ways to back an area of memory, best first: each reserved huge page
  size whose pool holds the area rounded up to that page (largest first; a size is skipped when
  the rounding would add more than 1/32 of the area: a 16 GiB page does not hold a 3 GiB table),
  with the ``MFD_HUGE_*`` flag naming that size, then transparent huge pages (``MADV_HUGEPAGE``)
  where shared memory may have them, else ordinary pages. The caller tries them in turn (the
  kernel may still refuse a pool: another process took its pages, or a cgroup limit).

The table format's 4 KiB pages (checksums, O_DIRECT reads) are a file format and do not change
with any of these. Nothing here runs at import time.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HUGEPAGES_DIR = "/sys/kernel/mm/hugepages"
MEMINFO = "/proc/meminfo"
THP_DIR = "/sys/kernel/mm/transparent_hugepage"
MFD_HUGETLB = getattr(os, "MFD_HUGETLB", 4)
MFD_HUGE_SHIFT = 26  # linux/memfd.h: log2(page size) << MFD_HUGE_SHIFT names the hugetlb size
MAX_PADDING_SHARE = 1 / 32  # a huge page size is used only when rounding up to it adds at most this share
SHMEM_THP_CHOICES = ("always", "within_size", "advise", "force")  # shmem_enabled values that give THP on madvise


@dataclass(frozen=True)
class HugePagePool:
    """Reserved (hugetlb) pages of one size."""

    page_bytes: int
    total: int  # nr_hugepages
    free: int  # free_hugepages (reserved ones included)
    reserved: int = 0  # resv_hugepages: promised to mappings already made, not yet faulted

    @property
    def available(self) -> int:
        """Pages a new mapping can still reserve."""
        return max(0, self.free - self.reserved)


@dataclass(frozen=True)
class PageSizes:
    """What the kernel offers: page size, hugetlb pools, default huge page size, THP."""

    page_bytes: int  # sysconf(_SC_PAGE_SIZE): 4096, 16384 or 65536
    pools: tuple[HugePagePool, ...] = ()  # every hugetlb size of the kernel, ascending
    default_huge_bytes: int = 0  # Hugepagesize (0: no hugetlb support)
    thp_bytes: int = 0  # transparent_hugepage/hpage_pmd_size (0: no THP)
    thp_enabled: str = ""  # transparent_hugepage/enabled: always, madvise, never ("" unknown)
    thp_shmem: str = ""  # transparent_hugepage/shmem_enabled: always, within_size, advise, never, deny, force

    @property
    def shmem_thp(self) -> bool:
        """Whether a memfd mapping that asks with MADV_HUGEPAGE gets transparent huge pages."""
        return self.thp_bytes > 0 and self.thp_shmem in SHMEM_THP_CHOICES

    @property
    def huge_bytes(self) -> int:
        """The size a large mapping's TLB entries cover at best: THP's size, else the default
        hugetlb size, else the page (what the MADV_HUGEPAGE threshold uses)."""
        return self.thp_bytes or self.default_huge_bytes or self.page_bytes

    def pool(self, page_bytes: int) -> HugePagePool | None:
        return next((p for p in self.pools if p.page_bytes == page_bytes), None)

    def to_dict(self) -> dict:
        return {"page_bytes": self.page_bytes, "default_huge_bytes": self.default_huge_bytes,
                "huge_page_pools": {str(p.page_bytes): {"total": p.total, "free": p.free, "reserved": p.reserved}
                                    for p in self.pools},
                "thp_bytes": self.thp_bytes, "thp_enabled": self.thp_enabled, "thp_shmem": self.thp_shmem}


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _chosen(path: Path) -> str:
    """The bracketed choice of a sysfs setting such as ``always [madvise] never``."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text.strip()


def read_pools(hugepages_dir: str | os.PathLike = HUGEPAGES_DIR) -> tuple[HugePagePool, ...]:
    """Every ``hugepages-<kB>kB`` directory: its size and counts, ascending by size."""
    pools = []
    try:
        entries = list(Path(hugepages_dir).iterdir())
    except OSError:
        return ()
    for d in entries:
        name = d.name
        if not (name.startswith("hugepages-") and name.endswith("kB") and name[10:-2].isdigit()):
            continue
        pools.append(HugePagePool(int(name[10:-2]) << 10, _read_int(d / "nr_hugepages"),
                                  _read_int(d / "free_hugepages"), _read_int(d / "resv_hugepages")))
    return tuple(sorted(pools, key=lambda p: p.page_bytes))


def read_meminfo(meminfo: str | os.PathLike = MEMINFO) -> dict[str, int]:
    """``/proc/meminfo`` as numbers (kB values in bytes)."""
    values = {}
    try:
        for line in Path(meminfo).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return values


def read_page_sizes(*, page_bytes: int | None = None, hugepages_dir: str | os.PathLike = HUGEPAGES_DIR,
                    meminfo: str | os.PathLike = MEMINFO, thp_dir: str | os.PathLike = THP_DIR) -> PageSizes:
    """The page sizes of the kernel whose files are named (this one by default)."""
    page = page_bytes or os.sysconf("SC_PAGE_SIZE")
    pools = read_pools(hugepages_dir)
    values = read_meminfo(meminfo)
    default = values.get("Hugepagesize", 0)
    if not pools and values.get("HugePages_Total") is not None and default:  # no sysfs: the default pool only
        pools = (HugePagePool(default, values["HugePages_Total"], values.get("HugePages_Free", 0),
                              values.get("HugePages_Rsvd", 0)),)
    thp = Path(thp_dir)
    return PageSizes(page, pools, default, _read_int(thp / "hpage_pmd_size"), _chosen(thp / "enabled"),
                     _chosen(thp / "shmem_enabled"))


@functools.cache
def current() -> PageSizes:
    """This kernel's page sizes (read once: a pool's free count is re-read by :func:`refresh`)."""
    return read_page_sizes()


def refresh() -> PageSizes:
    """Read the pools again (free counts change as other processes map huge pages)."""
    current.cache_clear()
    return current()


def memfd_hugetlb_flags(page_bytes: int) -> int:
    """``MFD_HUGETLB`` with the size flag for ``page_bytes`` (a power of two): without it the
    kernel takes its default size, 512 MiB on 64 KiB-page aarch64 kernels."""
    if page_bytes <= 0 or page_bytes & (page_bytes - 1):
        raise ValueError(f"a huge page size is a power of two, got {page_bytes}")
    return MFD_HUGETLB | (page_bytes.bit_length() - 1) << MFD_HUGE_SHIFT


@dataclass(frozen=True)
class Backing:
    """How an area of memory is backed: ``kind`` is ``"hugetlb"`` (reserved pages of
    ``page_bytes``), ``"thp"`` (ordinary shared memory asking for transparent huge pages of
    ``page_bytes``) or ``"none"`` (ordinary pages of ``page_bytes``). ``nbytes``: the area's size
    rounded up to what this backing needs (a whole number of huge pages for hugetlb)."""

    kind: str
    page_bytes: int
    nbytes: int

    @property
    def memfd_flags(self) -> int:
        return memfd_hugetlb_flags(self.page_bytes) if self.kind == "hugetlb" else 0

    def describe(self) -> str:
        size = format_page(self.page_bytes)
        return {"hugetlb": f"reserved {size} huge pages", "thp": f"transparent huge pages ({size})",
                "none": f"{size} pages"}[self.kind]


def format_page(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def backings(size_at: Callable[[int], int], sizes: PageSizes, *, huge: bool = True) -> list[Backing]:
    """The ways to back an area, best first. ``size_at(page)`` is its size when it is a whole
    number of ``page`` bytes (a layout may also put its blocks on that boundary).

    With ``huge``: each hugetlb pool, largest page first, whose available pages hold
    ``size_at(page)`` and where ``size_at(page)`` exceeds ``size_at(sizes.page_bytes)`` by at most
    :data:`MAX_PADDING_SHARE`; then THP where shared memory may have it. Last, always, ordinary
    pages (``sizes.page_bytes``)."""
    base = size_at(sizes.page_bytes)
    out = []
    if huge and base:
        for pool in sorted(sizes.pools, key=lambda p: -p.page_bytes):
            need = size_at(pool.page_bytes)
            if need - base <= base * MAX_PADDING_SHARE and pool.available * pool.page_bytes >= need:
                out.append(Backing("hugetlb", pool.page_bytes, need))
        if sizes.shmem_thp:
            out.append(Backing("thp", sizes.thp_bytes, base))
    out.append(Backing("none", sizes.page_bytes, base))
    return out


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align
