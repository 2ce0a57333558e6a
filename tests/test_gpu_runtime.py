"""The GPU-runtime seam (engram_store/native/gpu_runtime/__init__.py) on both sides, through stand-in libraries
built here (tests/support/gpu_standins.py; no GPU on this machine): HIP resolves hipLaunchHostFunc and registers
with HIP's flags and codes, CUDA the same with libcuda / libcudart; the fetch job's launch_host runs a real
fetch through each (exact rows against TableSet.read_rows); EngramStoreTables.register_cuda's decisions
(read-only supported / not / refused / already registered), the staging of each fetch job on its own."""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from support.daemon_helpers import REPO, DaemonProcess
from support.gpu_standins import Standin, build, compiler

from engram_store import errors
from engram_store.fetch.job import FetchJob
from engram_store.format.tableset import TableSet
from engram_store.integrations.tables import EngramStoreTables
from engram_store.native import gpu_runtime
from engram_store.native.gpu_runtime import GpuRuntime
from engram_store.models.spec import get_spec
from engram_store.storage.resident import resident_layout
from gpu_client import resident

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)  # 24 heads, 264-byte rows, ~77k rows a layer
FIRST, CACHED = SPEC.layers
DRAM = resident_layout([(FIRST, SPEC.rows(FIRST))], SPEC.row_format).size + (2 << 20)
STEP_ROWS = 64 * 24  # a decode step of batch 64
HIP_FLAGS, CUDA_READ_ONLY_FLAGS = 0x03, 0x0B  # Portable | Mapped (| cudaHostRegisterReadOnly)

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler to build the GPU runtime stand-ins")


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("standins"))


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=31)


@pytest.fixture(scope="module")
def daemon(tables, tmp_path_factory):
    with DaemonProcess(tables.directory, tmp_path_factory.mktemp("daemon"), dram_bytes=str(DRAM),
                       extra=["--placement", f"{FIRST}=resident,{CACHED}=cached"]) as d:
        yield d


def _use(kind: str, libs) -> tuple[GpuRuntime, Standin, Standin]:
    """The ``kind`` runtime over the stand-ins, made this process's; (runtime, registering lib, launching lib)."""
    if kind == "hip":
        rt = GpuRuntime.load("hip", runtime=str(libs["libamdhip64.so"]))
        lib = Standin(libs["libamdhip64.so"])
        launcher = lib
    else:
        rt = GpuRuntime.load("cuda", runtime=str(libs["libcudart.so.12"]), driver=str(libs["libcuda.so.1"]))
        lib, launcher = Standin(libs["libcudart.so.12"]), Standin(libs["libcuda.so.1"])
    for s in {lib.path: lib, launcher.path: launcher}.values():
        s.set(attr_read_only=1, attr_host_tables=0, refuse_all=0, refuse_read_only=0, launch_result=0)
        _since[str(s.path)] = s.registers
    gpu_runtime.use(rt)
    return rt, lib, launcher


@contextmanager
def _using(kind: str, libs) -> Iterator[tuple[GpuRuntime, Standin, Standin]]:
    """``_use(kind, libs)`` for the length of a ``with``: no runtime is this process's after it."""
    try:
        yield _use(kind, libs)
    finally:
        gpu_runtime.use(None)


@pytest.fixture(params=["hip", "cuda"])
def side(request, libs):
    with _using(request.param, libs) as used:
        yield used
    gc.collect()  # registrations owned by collected test objects end (their finalizers unregister)


def _buffer(nbytes: int = 1 << 20) -> tuple[mmap.mmap, int]:
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_each_side_resolves_its_launch_and_registers_with_its_flags_and_codes(side):
    rt, lib, launcher = side
    hip = rt.kind == "hip"
    symbol = "hipLaunchHostFunc" if hip else "cuLaunchHostFunc"
    assert gpu_runtime.host_launcher() == (launcher.address(symbol), symbol, "hipError_t" if hip else "CUresult")
    assert rt.versions() == ({"runtime": "6.2.41134", "driver": "6.2.41134"} if hip else
                             {"runtime": "12.4", "driver": "12.6"})
    assert rt.already_registered(712) and rt.already_registered(1061) == hip and not rt.already_registered(713)
    support = rt.read_only_support()
    assert support.supported is (None if hip else True)
    assert ("ignored" in support.detail) if hip else (support.detail.startswith(
        "cudaDevAttrHostRegisterReadOnlySupported = 1 on device 0"))

    buf, ptr = _buffer()
    before = lib.registers
    reg = resident.register_read_only(ptr, len(buf), "a test buffer")
    assert reg and reg.owned and lib.registration(-1) == (ptr, len(buf), HIP_FLAGS if hip else CUDA_READ_ONLY_FLAGS)
    # a repeat is answered from this process's record: AMD's runtime would accept it and register twice
    assert resident.register_host_memory(ptr, len(buf)) is None and lib.registers == before + 1
    unregistered = lib.unregisters
    resident.unregister_host_memory(ptr)
    assert lib.unregisters == unregistered + 1 and not resident.registered_here(ptr)
    assert resident.register_host_memory(ptr, len(buf)) is True and lib.registration(-1)[2] == HIP_FLAGS
    resident.unregister_host_memory(ptr)


def test_a_refused_registration_is_named_and_its_last_error_cleared(side, caplog):
    rt, lib, _ = side
    buf, ptr = _buffer()
    lib.set(refuse_all=1)
    clears = lib.clears
    with caplog.at_level(logging.WARNING, logger="gpu_client.resident"):
        assert resident.register_host_memory(ptr, len(buf)) is False
    assert lib.pending_error() == 0 and lib.clears == clears + 1  # torch would otherwise see it at its next launch
    name = "hipErrorOutOfMemory" if rt.kind == "hip" else "cudaErrorMemoryAllocation"
    assert f"{rt.side.prefix}HostRegister refused host memory" in caplog.text and name in caplog.text
    assert not resident.registered_here(ptr)


def test_the_fetch_jobs_launch_host_runs_a_real_fetch_through_the_runtime(side, daemon, tables):
    rt, _, launcher = side
    job = FetchJob(daemon.unix, CACHED, 4 * STEP_ROWS)
    try:
        for step, n in enumerate((STEP_ROWS, 3 * STEP_ROWS, 17)):
            ids = np.random.default_rng(step).integers(0, SPEC.rows(CACHED), n)
            ids[:step] = -1  # padding: zero rows
            job.ids[:n] = ids
            launches = launcher.launches
            job.launch_host(0x5EED000 + step, n)
            assert launcher.launches == launches + 1 and launcher.last_stream == 0x5EED000 + step
            assert launcher.last_data == job.native.call_address(n)  # the call record, one per row count
            assert launcher.ran_elsewhere == 1  # on the stand-in's own thread, which never held the GIL
            job.raise_if_failed()
            want = np.zeros((n, SPEC.row_bytes), np.uint8)
            want[ids >= 0] = tables.read_rows(CACHED, ids[ids >= 0])
            np.testing.assert_array_equal(job.weight[:n], want[:, : SPEC.row_format.dim])
            np.testing.assert_array_equal(job.scales[:n], want[:, SPEC.row_format.dim:])
        launcher.set(launch_result=400)
        symbol, result = ("hipLaunchHostFunc", "hipError_t") if rt.kind == "hip" else ("cuLaunchHostFunc", "CUresult")
        with pytest.raises(RuntimeError, match=f"{symbol} failed: {result} 400"):
            job.launch_host(1, 8)
    finally:
        job.close()


def test_launch_host_without_a_gpu_runtime_says_why(daemon):
    import torch

    if torch.version.cuda or getattr(torch.version, "hip", None):
        pytest.skip("this torch is built for a GPU runtime")
    gpu_runtime.use(None)
    job = FetchJob(daemon.unix, CACHED, 64)
    try:
        with pytest.raises(errors.EngineUnsupported, match="neither CUDA nor ROCm"):
            job.launch_host(1, 8)
    finally:
        job.close()


# --- EngramStoreTables.register_cuda: the decisions ---------------------------------------------------------
def _tables_and_job(daemon):
    t = EngramStoreTables.connect(daemon.unix)
    return t, t.fetch_job(CACHED, STEP_ROWS), t.view.array.ctypes.data


_since: dict[str, int] = {}


def _flags_of(lib: Standin, ptr: int) -> list[int]:
    """The flags of each registration of ``ptr`` since the test began (``_use``)."""
    return [lib.registration(k)[2] for k in range(_since[str(lib.path)], lib.registers)
            if lib.registration(k)[0] == ptr]


def test_register_cuda_read_only_where_supported_and_every_staging_on_its_own(daemon, libs):
    with _using("cuda", libs) as (rt, lib, _):
        t, job, arena = _tables_and_job(daemon)
        reg = t.register_cuda()
        assert reg and t.register_cuda(FIRST).how == "read-only" and t.register_cuda(CACHED)
        assert _flags_of(lib, arena) == [CUDA_READ_ONLY_FLAGS]
        staging = np.frombuffer(job.staging, np.uint8).ctypes.data
        assert _flags_of(lib, staging) == [HIP_FLAGS]  # Portable | Mapped: the job writes it
        second = t.fetch_job(CACHED, 2 * STEP_ROWS)  # made after: registered at once
        assert _flags_of(lib, np.frombuffer(second.staging, np.uint8).ctypes.data) == [HIP_FLAGS]
        registers = lib.registers
        assert t.register_cuda() and lib.registers == registers  # idempotent: nothing asked again
        job.close(), second.close()


def test_register_cuda_without_read_only_support_tries_without_the_flag_once(daemon, libs, caplog):
    with _using("cuda", libs) as (rt, lib, _):
        lib.set(attr_read_only=0, attr_host_tables=1)  # e.g. Grace: the GPU reads through the host's page tables
        t, job, arena = _tables_and_job(daemon)
        with caplog.at_level(logging.WARNING, logger="gpu_client.resident"):
            reg = t.register_cuda(FIRST)
        assert reg and reg.how == "without the read-only flag" and _flags_of(lib, arena) == [HIP_FLAGS]
        assert "cudaDevAttrHostRegisterReadOnlySupported = 0" in caplog.text and t.register_cuda(CACHED)
        job.close()


def test_a_refused_arena_names_the_attribute_and_leaves_cached_layers_served(daemon, libs):
    with _using("cuda", libs) as (rt, lib, _):
        lib.set(attr_read_only=0, attr_host_tables=0)  # read-only unsupported, and a PROT_READ mapping cannot be pinned
        t, job, arena = _tables_and_job(daemon)
        cached = t.register_cuda(CACHED)
        assert cached, cached.message  # the staging is registered on its own
        refused = t.register_cuda(FIRST)
        assert not refused and not t.register_cuda() and refused.code == 1
        for words in ("cudaDevAttrHostRegisterReadOnlySupported = 0 on device 0",
                      "cudaDevAttrPageableMemoryAccessUsesHostPageTables = 0", "cudaErrorInvalidValue",
                      "cached layers are not affected"):
            assert words in refused.message
        assert _flags_of(lib, arena) == [HIP_FLAGS] and lib.pending_error() == 0
        job.close()


def test_an_arena_registered_by_another_owner_is_used_and_the_error_cleared(daemon, libs):
    with _using("cuda", libs) as (rt, lib, _):
        t, job, arena = _tables_and_job(daemon)
        size = t.view.size
        assert lib.lib.cudaHostRegister(ctypes.c_void_p(arena), ctypes.c_size_t(size), CUDA_READ_ONLY_FLAGS) == 0
        reg = t.register_cuda(FIRST)
        assert reg and not reg.owned and "another owner" in reg.how and lib.pending_error() == 0
        assert lib.lib.cudaHostUnregister(ctypes.c_void_p(arena)) == 0
        job.close()


def test_on_hip_the_arena_is_registered_portable_mapped_and_a_refusal_spares_the_staging(daemon, libs):
    with _using("hip", libs) as (rt, lib, _):
        t, job, arena = _tables_and_job(daemon)
        assert t.register_cuda() and _flags_of(lib, arena) == [HIP_FLAGS]
        job.close()
        del t, job
        gc.collect()  # the arena's and the staging's registrations end with them
        lib.set(refuse_read_only=1)  # if AMD's runtime refuses to pin a read-only mapping (not known: no AMD GPU)
        t, job, arena = _tables_and_job(daemon)
        refused = t.register_cuda(FIRST)
        assert not refused and "hipHostRegister refused the arena" in refused.message
        assert "hipErrorInvalidValue" in refused.message and t.register_cuda(CACHED)
        job.close()


# --- the default choice: from torch, with the libraries the process has loaded ------------------------------
CHOOSE = """
import ctypes, json, sys
import torch
torch.version.hip, torch.version.cuda = (sys.argv[2], None) if sys.argv[1] == "hip" else (None, sys.argv[2])
ctypes.CDLL(sys.argv[3])  # as torch loads its runtime
from engram_store.native import gpu_runtime
rt = gpu_runtime.runtime()
launcher = ctypes.CDLL(sys.argv[4])
symbol = "hipLaunchHostFunc" if rt.kind == "hip" else "cuLaunchHostFunc"
print(json.dumps({"kind": rt.kind, "runtime_lib": rt.runtime_lib, "launch_lib": rt.launch_lib,
                  "same_launch": rt.launch_address == ctypes.cast(getattr(launcher, symbol), ctypes.c_void_p).value,
                  "same_again": gpu_runtime.runtime() is rt}))
"""


@pytest.mark.parametrize("kind", ["hip", "cuda"])
def test_the_default_runtime_follows_torch_and_the_libraries_it_loaded(kind, libs):
    loaded = libs["libamdhip64.so"] if kind == "hip" else libs["libcudart.so.12"]
    launcher = libs["libamdhip64.so"] if kind == "hip" else libs["libcuda.so.1"]
    env = dict(os.environ, LD_LIBRARY_PATH=str(launcher.parent))  # dlopen("libcuda.so.1") finds the stand-in
    out = subprocess.run([sys.executable, "-c", CHOOSE, kind, "6.2.41134" if kind == "hip" else "12.4", str(loaded),
                          str(launcher)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kind"] == kind and got["runtime_lib"] == str(loaded)  # found in /proc/self/maps
    assert got["launch_lib"] == (str(loaded) if kind == "hip" else "libcuda.so.1")
    assert got["same_launch"] and got["same_again"]


def test_hip_refuses_a_runtime_torch_did_not_load(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 08:01 1234 /opt/rocm/lib/libamdhip64.so.6.2.60200\n"
                    "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 [heap]\n")
    assert gpu_runtime.loaded_library("libamdhip64.so", str(maps)) == "/opt/rocm/lib/libamdhip64.so.6.2.60200"
    assert gpu_runtime.loaded_library("libcudart.so", str(maps)) is None
    if gpu_runtime.loaded_library("libamdhip64.so") is None:
        with pytest.raises(errors.EngineUnsupported, match="libamdhip64 is not loaded"):
            GpuRuntime.load("hip")


# --- what operators see: status (how rows are read) and doctor (the GPU runtime) ----------------------------
def test_status_says_rows_reach_engines_without_gpudirect_storage(daemon):
    from engram_store.client.client import EngramClient
    from engram_store.client.status import collect, render

    doc = collect(daemon.unix, lambda: EngramClient.connect(daemon.unix))
    assert doc["reads"]["arena_fill"] == "posix"  # no kvikio here: the daemon filled its arena with O_DIRECT reads
    line = next(x for x in render(doc).splitlines() if x.startswith("reads"))
    assert "arena filled by O_DIRECT reads (no GPUDirect Storage)" in line
    assert "pinned staging" in line and "the same on CUDA and ROCm" in line


def test_doctor_names_the_gpu_vendor_runtime_and_read_only_registration(tables):
    from engram_store.ops.doctor import PASS, SKIP, WARN, check_gpu_runtime
    from engram_store.ops.probes import GpuRuntimeFacts

    rocm = GpuRuntimeFacts("2.5.1+rocm6.2", "ROCm", "AMD", "6.2.41134", "6.2.41134", ("AMD Instinct MI300X",) * 8,
                           None, "no read-only host registration")
    c = check_gpu_runtime(rocm)
    assert c.status == PASS and c.found.startswith("AMD, ROCm 6.2.41134 (driver 6.2.41134), torch 2.5.1+rocm6.2; 8 "
                                                   "device(s): AMD Instinct MI300X") and "no GPUDirect" in c.found
    b300 = GpuRuntimeFacts("2.5.1+cu124", "CUDA", "NVIDIA", "12.4", "12.8", ("NVIDIA B300",), False,
                           "cudaDevAttrHostRegisterReadOnlySupported = 0 on device 0")

    class Arena:  # the plan of a config with a resident layer
        arena_bytes = 1 << 30

        @staticmethod
        def layers(where):
            return [FIRST]

    warn = check_gpu_runtime(b300, Arena())
    assert warn.status == WARN and "ReadOnlySupported = 0" in warn.found and f"[{FIRST}]" in warn.fix
    assert check_gpu_runtime(b300).status == PASS  # no arena planned: nothing to register read-only
    assert check_gpu_runtime(GpuRuntimeFacts("2.13.0+cpu", "", "", "")).status == SKIP
    import torch

    if not (torch.version.cuda or getattr(torch.version, "hip", None)):  # this machine's torch, probed for real
        assert check_gpu_runtime().found == f"torch {torch.__version__} is a CPU build: no GPU runtime"
