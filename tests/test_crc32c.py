"""crc32c test vectors through every path this CPU has: the hardware instruction (SSE4.2 on x86-64,
the ARMv8 CRC32 extension on aarch64, run for real under qemu by ``make arm64-test``), the C tables
and the numpy reference.

The vectors are the iSCSI ones (RFC 3720, appendix B.4) and the standard check value; pages of
random bytes go through the four-page and the one-page code paths and are compared with the numpy
reference, and which implementation is used is checked against what the CPU itself says (its
cpuinfo flags on x86-64, AT_HWCAP read from /proc/self/auxv on aarch64).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest

from engram_store.format import checksums
from engram_store.format.layout import PAGE_BYTES
from engram_store.ops import probes

native = pytest.importorskip("engram_store.native._pread", reason="the native page reader is not built")

VECTORS = [  # (bytes, crc32c): RFC 3720 B.4 and the check value
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"123456789", 0xE3069283),
    (b"", 0),
]
PATHS = [False, True]  # software=False: the instruction where the CPU has it; True: the C tables


def test_the_implementation_is_the_instruction_the_cpu_has():
    machine = platform.machine()
    has = probes.cpu_crc32c(machine)
    want = {"x86_64": "sse4.2", "aarch64": "armv8-crc32"}.get(machine, "software") if has else "software"
    if has is None and machine in ("x86_64", "aarch64"):
        pytest.skip("this CPU's crc32c support cannot be read here")
    assert native.CRC32C == checksums.implementation() == want


@pytest.mark.parametrize("software", PATHS)
@pytest.mark.parametrize("data, want", VECTORS)
def test_vectors(data, want, software):
    assert native.crc32c(data, 0, software) == want
    assert checksums._crc32c_numpy_bytes(np.frombuffer(data, np.uint8), 0) == want


@pytest.mark.parametrize("software", PATHS)
def test_every_length_and_split_chains_like_zlib(software):
    data = np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8).tobytes()
    for n in range(0, 80):
        want = checksums._crc32c_numpy_bytes(np.frombuffer(data[3:3 + n], np.uint8), 0)
        assert native.crc32c(data[3:3 + n], 0, software) == want, n
        cut = n // 3
        assert native.crc32c(data[3 + cut:3 + n], native.crc32c(data[3:3 + cut], 0, software), software) == want


@pytest.mark.parametrize("software", PATHS)
@pytest.mark.parametrize("n_pages", [1, 3, 4, 5, 9])  # the four-page chains, and pages left over
def test_pages_match_the_reference(software, n_pages):
    pages = np.random.default_rng(n_pages).integers(0, 256, (n_pages, PAGE_BYTES), dtype=np.uint8)
    pages[0] = 0  # a page of zeros too
    out = np.empty(n_pages, dtype=np.uint32)
    native.page_crcs(pages, out, software)
    np.testing.assert_array_equal(out, checksums.page_crcs_numpy(pages))
    assert int(out[-1]) == native.crc32c(pages[-1].tobytes(), 0, not software)  # the other path agrees
