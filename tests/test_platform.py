"""``doctor``'s platform facts: architecture, page and huge page sizes, the crc32c implementation, the
native modules; and its huge page check on a 64 KiB-page Grace kernel (sizes given as parameters)."""

from __future__ import annotations

import platform
import struct

import pytest
from support.daemon_helpers import make_tables

from engram_store.daemon.config import load_config
from engram_store.format import checksums
from engram_store.format.manifest import Manifest
from engram_store.native.pagesizes import HugePagePool, PageSizes
from engram_store.ops import doctor, probes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GRACE = PageSizes(64 * KiB, (HugePagePool(2 * MiB, 0, 0), HugePagePool(512 * MiB, 380, 380), HugePagePool(16 * GiB, 0, 0)),
                  512 * MiB, 512 * MiB, "madvise", "never")


def test_this_host_is_reported_as_it_is():
    facts = probes.platform_facts()
    assert facts.machine == platform.machine() and facts.kernel == platform.release()
    assert facts.crc32c == checksums.implementation() and facts.sizes.page_bytes == probes.page_sizes().page_bytes
    check = doctor.check_platform(facts)
    assert facts.machine in check.found and f"crc32c {facts.crc32c}" in check.found
    assert check.status == (doctor.WARN if facts.missing_native else doctor.PASS)


def test_grace_facts_and_what_doctor_says_of_them():
    grace = probes.Platform("aarch64", "6.8.0-1008-nvidia-64k", GRACE, "armv8-crc32", True, ())
    check = doctor.check_platform(grace)
    assert check.status == doctor.PASS
    assert check.found == ("aarch64, kernel 6.8.0-1008-nvidia-64k, 64 KiB pages, huge page sizes 2 MiB, 512 MiB, "
                           "16 GiB (default 512 MiB), THP 512 MiB; page checks: crc32c armv8-crc32")
    unbuilt = doctor.check_platform(probes.Platform("aarch64", "6.8", GRACE, "numpy", True, ("_pread", "_fetch")))
    assert unbuilt.status == doctor.WARN and "_pread, _fetch" in unbuilt.found and "aarch64" in unbuilt.fix
    tables_only = doctor.check_platform(probes.Platform("aarch64", "6.8", GRACE, "software", True, ()))
    assert tables_only.status == doctor.WARN and "crc32c instruction" in tables_only.found


def test_the_cpu_says_whether_it_has_crc32c(tmp_path):
    auxv = tmp_path / "auxv"
    auxv.write_bytes(struct.pack("=8Q", 6, 4096, 16, 0xEFF, 26, 0, 0, 0))  # AT_PAGESZ, AT_HWCAP (CRC32: bit 7)
    assert probes.hwcap(auxv) == 0xEFF and probes.cpu_crc32c("aarch64", auxv=auxv) is True
    auxv.write_bytes(struct.pack("=4Q", 16, 0xEFF & ~(1 << 7), 0, 0))
    assert probes.cpu_crc32c("aarch64", auxv=auxv) is False
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_1 sse4_2 popcnt\n")
    assert probes.cpu_crc32c("x86_64", cpuinfo=cpuinfo) is True
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse4_1\n")
    assert probes.cpu_crc32c("x86_64", cpuinfo=cpuinfo) is False
    assert probes.cpu_crc32c("x86_64", cpuinfo=tmp_path / "absent") is None


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    ts = make_tables(tmp_path_factory.mktemp("platform") / "tiny", seed=3)
    ts.close()
    return ts.directory


def test_huge_pages_on_a_64k_kernel(tables):
    plan = doctor.make_plan(load_config({"tables": str(tables), "dram_bytes": "64MiB"}, environ={}),
                            Manifest.load(tables))
    # the tiny arena (8 MiB) is not padded to 512 MiB pages: with only those reserved, it would sit on 64 KiB pages
    bare = doctor.check_huge_pages(plan, GRACE)
    assert bare.status == doctor.WARN and "64 KiB pages" in bare.found and "512 MiB 380 free of 380 (default)" in bare.found
    # 512 MiB pages would be mostly padding: the fix names the 2 MiB pool, not the default one
    assert "the arena takes 4 pages of 2 MiB" in bare.fix and "hugepagesz=2M hugepages=4" in bare.fix
    assert "echo 4 > /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages" in bare.fix and "vm.nr_hugepages" not in bare.fix
    with_2m = PageSizes(64 * KiB, (HugePagePool(2 * MiB, 8, 8),) + GRACE.pools[1:], 512 * MiB, 512 * MiB, "madvise", "never")
    assert doctor.check_huge_pages(plan, with_2m).found.endswith("the arena takes 4 reserved 2 MiB huge pages")
    thp = PageSizes(64 * KiB, GRACE.pools, 512 * MiB, 512 * MiB, "madvise", "advise")
    assert doctor.check_huge_pages(plan, thp).found.endswith("transparent huge pages (512 MiB) (madvise)")
