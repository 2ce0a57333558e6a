"""Page sizes from the kernel, never a constant: 4 KiB, 16 KiB and 64 KiB kernels (x86-64, aarch64, Grace).

The kernels' files (``/sys/kernel/mm/hugepages``, ``/proc/meminfo``, ``transparent_hugepage``) are
written as each kind of kernel has them and read back; the arena's backing is chosen for each
(exact sizes, checked by hand: V4.1-Flash's arena is 202,761,043,968 bytes on 2 MiB blocks, 378
pages of 512 MiB or 189 of 1 GiB, 12 of 16 GiB); then a real arena and a real memfd are made with
those sizes given as parameters, the kernel here refusing the huge page pools it lacks (the
fallback taken), and their rows read back exactly against ``TableSet.read_rows``.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import make_tables

from engram_store.format.arena_layout import BLOCK_ALIGN, ArenaLayout, ArenaView
from engram_store.native import pagesizes, syscalls
from engram_store.native.readers import open_reader
from engram_store.native.pagesizes import Backing, HugePagePool, PageSizes, backings, memfd_hugetlb_flags
from engram_store.models.spec import get_spec
from engram_store.storage.gds import posix_bulk_reader
from engram_store.storage.resident import ResidentArena, arena_backings, resident_layout
from engram_store.storage.row_cache import RowCache

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
V41 = get_spec("deepseek-v4.1-flash")
V41_ROWS = [(layer, V41.rows(layer)) for layer in V41.layers]
V41_ARENA = 202_761_043_968  # 2 x (rows x 256 + rows x 8), each block rounded up to 2 MiB (by hand)


def kernel_files(root: Path, *, pools: dict[int, tuple[int, int, int]], default: int, thp: int,
                 shmem: str = "never") -> dict:
    """The files a kernel shows: ``pools`` {page bytes: (total, free, reserved)}."""
    hp = root / "hugepages"
    hp.mkdir(parents=True)
    for size, (total, free, resv) in pools.items():
        d = hp / f"hugepages-{size >> 10}kB"
        d.mkdir()
        for name, value in (("nr_hugepages", total), ("free_hugepages", free), ("resv_hugepages", resv),
                            ("surplus_hugepages", 0), ("nr_overcommit_hugepages", 0)):
            (d / name).write_text(f"{value}\n")
    p = pools.get(default, (0, 0, 0))
    (root / "meminfo").write_text(f"MemTotal:       1000000 kB\nHugePages_Total:   {p[0]}\nHugePages_Free:    {p[1]}\n"
                                  f"HugePages_Rsvd:    {p[2]}\nHugePages_Surp:        0\n"
                                  f"Hugepagesize:    {default >> 10} kB\n")
    thp_dir = root / "thp"
    thp_dir.mkdir()
    (thp_dir / "enabled").write_text("always [madvise] never\n")
    (thp_dir / "shmem_enabled").write_text(" ".join(f"[{c}]" if c == shmem else c for c in
                                                    ("always", "within_size", "advise", "never", "deny", "force")))
    (thp_dir / "hpage_pmd_size").write_text(f"{thp}\n")
    return {"hugepages_dir": hp, "meminfo": root / "meminfo", "thp_dir": thp_dir}


# --- reading the kernel ---------------------------------------------------------------------
def test_a_64k_grace_kernel_is_read_as_it_is(tmp_path):
    files = kernel_files(tmp_path, pools={2 * MiB: (0, 0, 0), 512 * MiB: (380, 379, 1), 16 * GiB: (0, 0, 0)},
                         default=512 * MiB, thp=512 * MiB, shmem="advise")
    sizes = pagesizes.read_page_sizes(page_bytes=64 * KiB, **files)
    assert sizes == PageSizes(64 * KiB, (HugePagePool(2 * MiB, 0, 0), HugePagePool(512 * MiB, 380, 379, 1),
                                         HugePagePool(16 * GiB, 0, 0)), 512 * MiB, 512 * MiB, "madvise", "advise")
    assert sizes.pool(512 * MiB).available == 378 and sizes.shmem_thp and sizes.huge_bytes == 512 * MiB


def test_without_sysfs_the_default_pool_comes_from_meminfo(tmp_path):
    files = kernel_files(tmp_path, pools={32 * MiB: (64, 60, 0)}, default=32 * MiB, thp=32 * MiB)
    sizes = pagesizes.read_page_sizes(page_bytes=16 * KiB, hugepages_dir=tmp_path / "absent",
                                      meminfo=files["meminfo"], thp_dir=files["thp_dir"])
    assert sizes.pools == (HugePagePool(32 * MiB, 64, 60, 0),) and sizes.default_huge_bytes == 32 * MiB
    assert not sizes.shmem_thp  # shmem_enabled [never]


def test_this_kernel_page_size_is_sysconfs():
    sizes = pagesizes.read_page_sizes()
    assert sizes.page_bytes == mmap.PAGESIZE == os.sysconf("SC_PAGE_SIZE")
    meminfo = Path("/proc/meminfo").read_text()
    if "Hugepagesize:" in meminfo:
        kb = int(meminfo.split("Hugepagesize:")[1].split()[0])
        assert sizes.default_huge_bytes == kb * KiB and sizes.pool(kb * KiB) is not None


@pytest.mark.parametrize("size, name", [(64 * KiB, "MFD_HUGE_64KB"), (2 * MiB, "MFD_HUGE_2MB"),
                                        (32 * MiB, "MFD_HUGE_32MB"), (512 * MiB, "MFD_HUGE_512MB"),
                                        (GiB, "MFD_HUGE_1GB"), (16 * GiB, "MFD_HUGE_16GB")])
def test_the_memfd_flag_names_the_size(size, name):
    if not hasattr(os, name):
        pytest.skip(f"os.{name} not in this Python")
    assert memfd_hugetlb_flags(size) == os.MFD_HUGETLB | getattr(os, name)
    with pytest.raises(ValueError):
        memfd_hugetlb_flags(size + 4096)


# --- choosing the arena's pages -------------------------------------------------------------
def grace(free512: int, free2m: int = 0, free16g: int = 0, shmem: str = "advise") -> PageSizes:
    return PageSizes(64 * KiB, (HugePagePool(2 * MiB, free2m, free2m), HugePagePool(512 * MiB, free512, free512),
                                HugePagePool(16 * GiB, free16g, free16g)), 512 * MiB, 512 * MiB, "madvise", shmem)


def test_v41_on_a_64k_kernel_takes_512mib_pages_with_their_size_flag():
    assert resident_layout(V41_ROWS, V41.row_format).size == V41_ARENA
    best = arena_backings(V41_ROWS, V41.row_format, sizes=grace(free512=378, free2m=200_000))[0]
    assert best == Backing("hugetlb", 512 * MiB, 378 * 512 * MiB)
    assert best.memfd_flags == memfd_hugetlb_flags(512 * MiB) and best.memfd_flags != pagesizes.MFD_HUGETLB
    # one page short of 512 MiB pages: the 2 MiB pool (96,686 pages) holds it
    assert arena_backings(V41_ROWS, V41.row_format, sizes=grace(free512=377, free2m=96_686))[0] == \
        Backing("hugetlb", 2 * MiB, V41_ARENA)
    # 16 GiB pages: 12 of them (1.7% more than the arena) are taken when reserved
    assert arena_backings(V41_ROWS, V41.row_format, sizes=grace(free512=378, free16g=12))[0] == \
        Backing("hugetlb", 16 * GiB, 12 * 16 * GiB)
    # nothing reserved: THP (512 MiB on this kernel), else the kernel's 64 KiB pages
    assert arena_backings(V41_ROWS, V41.row_format, sizes=grace(0))[0] == Backing("thp", 512 * MiB, V41_ARENA)
    assert arena_backings(V41_ROWS, V41.row_format, sizes=grace(0, shmem="never"))[0] == \
        Backing("none", 64 * KiB, V41_ARENA)
    assert arena_backings(V41_ROWS, V41.row_format, huge=False, sizes=grace(378)) == [Backing("none", 64 * KiB, V41_ARENA)]


def test_a_16k_kernel_takes_1gib_pages_before_its_32mib_default():
    sizes = PageSizes(16 * KiB, (HugePagePool(2 * MiB, 0, 0), HugePagePool(32 * MiB, 7000, 7000),
                                 HugePagePool(GiB, 189, 189)), 32 * MiB, 32 * MiB, "madvise", "never")
    assert [(b.kind, b.page_bytes, b.nbytes) for b in arena_backings(V41_ROWS, V41.row_format, sizes=sizes)] == [
        ("hugetlb", GiB, 189 * GiB), ("hugetlb", 32 * MiB, 6043 * 32 * MiB), ("none", 16 * KiB, V41_ARENA)]


def test_a_small_arena_never_pads_itself_to_a_large_page():
    tiny = get_spec("tiny")
    rows = [(layer, tiny.rows(layer)) for layer in tiny.layers]
    size = resident_layout(rows, tiny.row_format).size
    chosen = arena_backings(rows, tiny.row_format, sizes=grace(free512=1000, free2m=1000))
    assert chosen[0] == Backing("hugetlb", 2 * MiB, size)  # 512 MiB pages would be mostly padding
    assert [b.kind for b in chosen] == ["hugetlb", "thp", "none"]


def test_a_pool_counts_pages_promised_to_other_mappings_as_taken():
    need = V41_ARENA // (2 * MiB)
    sizes = PageSizes(4 * KiB, (HugePagePool(2 * MiB, need + 10, need + 10, reserved=11),), 2 * MiB, 2 * MiB, "", "never")
    assert backings(lambda page: V41_ARENA, sizes)[0].kind == "none"


@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB, 64 * KiB, 2 * MiB, 32 * MiB, 512 * MiB])
def test_the_layout_keeps_2mib_blocks_and_rounds_its_end_to_the_page(page):
    layout = ArenaLayout.plan(V41_ROWS, 256, 8, page_bytes=page)
    base = ArenaLayout.plan(V41_ROWS, 256, 8)
    assert [a.to_dict() for a in layout.layers] == [a.to_dict() for a in base.layers]
    assert layout.size == -(-V41_ARENA // max(page, BLOCK_ALIGN)) * max(page, BLOCK_ALIGN)
    assert all(o % BLOCK_ALIGN == 0 for a in layout.layers for o in (a.weight_offset, a.scale_offset))
    assert ArenaLayout.from_dict(layout.to_dict()) == layout


# --- real memory, sizes given as parameters ---------------------------------------------------
@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    ts = make_tables(tmp_path_factory.mktemp("pagesizes") / "tiny", seed=5)
    yield ts
    ts.close()


def _kernel_sizes_with_fake_pools(page: int, pools: tuple[int, ...], thp: int) -> PageSizes:
    """``page``-byte pages and pools of ``pools`` sizes with pages to spare, THP never: the kernel
    here (4 KiB, no such pools reserved) refuses every hugetlb option, so the arena falls back."""
    return PageSizes(page, tuple(HugePagePool(p, 1 << 20, 1 << 20) for p in pools), pools[-1], thp, "never", "never")


@pytest.mark.parametrize("page, pools, thp", [(16 * KiB, (2 * MiB, 32 * MiB, GiB), 32 * MiB),
                                              (64 * KiB, (2 * MiB, 512 * MiB, 16 * GiB), 512 * MiB),
                                              (4 * KiB, (2 * MiB, GiB), 2 * MiB)])
def test_an_arena_on_a_kernel_of_other_page_sizes_serves_exact_rows(tables, caplog, page, pools, thp):
    from engram_store.storage.tiered import TieredStore

    sizes = _kernel_sizes_with_fake_pools(page, pools, thp)
    if any(pagesizes.current().pool(p) and pagesizes.current().pool(p).available for p in pools):
        pytest.skip("this host has huge pages of those sizes free: the fallback would not be taken")
    with TieredStore.open(tables.directory, dram_bytes=256 << 10, mode="cached") as store:
        files = [store.parts.files[layer] for layer in store.layers]
        rows = [(lf.layer, lf.layout.rows) for lf in files]
        options = arena_backings(rows, store.spec.row_format, sizes=sizes)
        assert options[0].kind == "hugetlb" and options[-1] == Backing("none", page, resident_layout(rows, store.spec.row_format).size)
        reader = open_reader(4)
        with caplog.at_level(logging.INFO, logger="engram_store.native.syscalls"):
            arena = ResidentArena.build(files, store.spec.row_format, posix_bulk_reader(reader), sizes=sizes)
        try:
            assert (arena.huge_pages, arena.page_bytes) == ("none", page)  # every pool refused by this kernel
            assert arena.nbytes == arena.layout.size == options[-1].nbytes and "refused" in caplog.text
            view = ArenaView.map_fd(arena.memfd.fd, arena.layout)
            rng = np.random.default_rng(page)
            for layer, n in rows:
                ids = rng.integers(0, n, 500)
                out = np.empty((500, tables.spec.row_bytes), np.uint8)
                view.gather_into(layer, ids, out)
                np.testing.assert_array_equal(out, tables.read_rows(layer, ids))
            view.close()
        finally:
            arena.close()
            reader.close()


@pytest.mark.parametrize("page", [16 * KiB, 64 * KiB])
def test_a_memfd_and_a_row_cache_on_larger_pages_round_to_them(page):
    sizes = PageSizes(page, (), 0, 0, "never", "never")
    m = syscalls.create_memfd("engram-test-pages", 100_000, sizes=sizes)
    try:
        assert m.size == -(-100_000 // page) * page == os.fstat(m.fd).st_size and not m.hugetlb
        mm = syscalls.map_fd(m.fd, m.size, writable=True)
        mm[m.size - 4:] = b"last"
        assert os.pread(m.fd, 4, m.size - 4) == b"last"
        mm.close()
    finally:
        m.close()
    cache = RowCache({1: 1000}, 264, 77, huge=False)
    try:
        assert cache.nbytes % mmap.PAGESIZE == 0 and cache.nbytes >= 77 * 264 and cache.slots.shape == (77, 264)
    finally:
        cache.close()


def _free_2mib_pages() -> int:
    pool = pagesizes.read_page_sizes().pool(2 * MiB)
    return pool.available if pool else 0


@pytest.mark.skipif(_free_2mib_pages() < 3, reason="no reserved 2 MiB huge pages free on this host (vm.nr_hugepages)")
def test_reserved_2mib_pages_back_a_memfd_when_the_host_has_them():
    m = syscalls.create_memfd("engram-test-hugetlb", 4 * MiB - 100)
    try:
        assert m.hugetlb and m.backing.page_bytes == 2 * MiB and m.size == 4 * MiB
        assert os.fstat(m.fd).st_blksize == 2 * MiB  # hugetlbfs reports its page as the block size
        mm = syscalls.map_fd(m.fd, m.size, writable=True)
        mm[:5] = b"hello"
        assert os.pread(m.fd, 5, 0) == b"hello"
        mm.close()
    finally:
        m.close()


@pytest.mark.skipif(_free_2mib_pages() < 4, reason="fewer than 4 reserved 2 MiB huge pages free on this host")
def test_an_arena_on_reserved_2mib_pages_serves_exact_rows(tables):
    from engram_store.storage.tiered import TieredStore

    with TieredStore.open(tables.directory, dram_bytes=256 << 10, mode="cached") as store:
        files = [store.parts.files[layer] for layer in store.layers]
        reader = open_reader(4)
        arena = ResidentArena.build(files, store.spec.row_format, posix_bulk_reader(reader))  # this kernel's sizes
        try:
            assert (arena.huge_pages, arena.page_bytes) == ("hugetlb", 2 * MiB)
            assert os.fstat(arena.memfd.fd).st_blksize == 2 * MiB and arena.info().page_bytes == 2 * MiB
            view = ArenaView.map_fd(arena.memfd.fd, arena.layout)
            for lf in files:
                ids = np.arange(lf.layout.rows)
                out = np.empty((ids.size, tables.spec.row_bytes), np.uint8)
                view.gather_into(lf.layer, ids, out)
                np.testing.assert_array_equal(out, tables.read_rows(lf.layer, ids))
            view.close()
        finally:
            arena.close()
            reader.close()
