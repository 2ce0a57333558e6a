"""Host facts ``doctor`` weighs, each read on its own and never fatal: the platform (architecture,
page and huge page sizes, THP, the crc32c implementation, the native modules), memlock, free disk, the NVMe reader and O_DIRECT on the tables' file system, CUDA and kvikio, and the GPU runtime
(vendor, CUDA or ROCm, versions, read-only host registration).

Memory (``MemAvailable`` and cgroup limits) comes from :func:`engram_store.daemon.host.memory_limits`,
the daemon's own preflight helper. Every reader takes the paths it reads, so tests point it at
fixture files.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import platform as _platform
import resource
import struct
from dataclasses import dataclass
from pathlib import Path

from ..native import pagesizes
from ..native.pagesizes import PageSizes

THP_DIR = pagesizes.THP_DIR
NATIVE_MODULES = ("engram_store.native._pread", "engram_store.native._uring", "engram_store.native._gather",
                  "engram_store.fetch._fetch", "engram_store.daemon._unixfast")
AT_HWCAP = 16  # linux/auxvec.h
HWCAP_CRC32 = 1 << 7  # aarch64: linux/arch/arm64/include/uapi/asm/hwcap.h


def page_sizes(**paths) -> PageSizes:
    """The kernel's page sizes (:func:`engram_store.native.pagesizes.read_page_sizes`; paths for tests)."""
    return pagesizes.read_page_sizes(**paths)


@dataclass(frozen=True)
class Platform:
    """What this host runs on: the facts a Grace (aarch64) or x86-64 deploy differs by."""

    machine: str  # platform.machine(): x86_64, aarch64
    kernel: str  # platform.release()
    sizes: PageSizes
    crc32c: str  # what page checks use: sse4.2, armv8-crc32, software (C tables) or numpy (no native module)
    cpu_crc32c: bool | None  # whether the CPU offers a crc32c instruction (None: not known here)
    missing_native: tuple[str, ...]  # native modules that are not built (the wheel ships them all)

    def to_dict(self) -> dict:
        return {"machine": self.machine, "kernel": self.kernel, **self.sizes.to_dict(), "crc32c": self.crc32c,
                "cpu_crc32c": self.cpu_crc32c, "missing_native": list(self.missing_native)}


def hwcap(auxv: str | os.PathLike = "/proc/self/auxv") -> int | None:
    """AT_HWCAP of this process (the kernel's, or qemu-user's for an emulated one), None when unreadable."""
    try:
        data = Path(auxv).read_bytes()
    except OSError:
        return None
    for i in range(0, len(data) - 15, 16):
        key, value = struct.unpack_from("=QQ", data, i)
        if key == AT_HWCAP:
            return value
        if key == 0:
            break
    return None


def cpu_crc32c(machine: str, cpuinfo: str | os.PathLike = "/proc/cpuinfo",
               auxv: str | os.PathLike = "/proc/self/auxv") -> bool | None:
    """Whether the CPU has a crc32c instruction: SSE4.2 (cpuinfo flags) on x86-64, the ARMv8
    CRC32 extension (AT_HWCAP) on aarch64; None for another machine or when unreadable."""
    if machine in ("aarch64", "arm64"):
        cap = hwcap(auxv)
        return None if cap is None else bool(cap & HWCAP_CRC32)
    if machine in ("x86_64", "AMD64"):
        try:
            flags = next((line for line in Path(cpuinfo).read_text().splitlines() if line.startswith("flags")), "")
        except OSError:
            return None
        return "sse4_2" in flags.split() if flags else None
    return None


def missing_native() -> tuple[str, ...]:
    """Native modules of this install that do not import (each has a slower fallback, and without
    ``_fetch`` engines refuse cached layers)."""
    missing = []
    for name in NATIVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name.rsplit(".", 1)[1])
    return tuple(missing)


def platform_facts(*, sizes: PageSizes | None = None) -> Platform:
    """This host's :class:`Platform` (the GPU and its runtime: :func:`gpu_runtime`)."""
    from ..format import checksums

    machine = _platform.machine()
    return Platform(machine, _platform.release(), page_sizes() if sizes is None else sizes,
                    checksums.implementation(), cpu_crc32c(machine), missing_native())


def memlock_limit() -> int | None:
    """This process's soft RLIMIT_MEMLOCK in bytes (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def free_bytes(path: str | os.PathLike) -> tuple[int, str]:
    """Bytes an unprivileged writer may still use on ``path``'s file system (its nearest existing
    ancestor), and that directory."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize, str(p)


@dataclass(frozen=True)
class ReadPath:
    """How the daemon would read a table file: reader backend, and whether O_DIRECT holds."""

    reader: str  # "uring", "aio" or "threads"
    why_not_uring: str  # "" when io_uring runs
    direct: bool


def read_path(file: str | os.PathLike) -> ReadPath:
    """The reader the daemon picks (uring -> aio -> threads) and O_DIRECT on ``file``."""
    from ..native.readers import aio, uring
    from ..native.syscalls import open_direct

    why = uring.probe() or ""
    reader = "uring" if not why else ("aio" if aio.available() else "threads")
    quiet = logging.getLogger("engram_store.native.syscalls")
    level, quiet.level = quiet.level, logging.ERROR  # open_direct logs its fallback: the check says it instead
    try:
        opened = open_direct(file)
    finally:
        quiet.setLevel(level)
    try:
        return ReadPath(reader, why, bool(opened.direct))
    finally:
        opened.close()


@dataclass(frozen=True)
class Gpu:
    """CUDA and kvikio, when installed."""

    torch: bool  # torch importable
    cuda: bool  # torch.cuda.is_available()
    devices: tuple[str, ...]
    kvikio: bool  # kvikio importable
    kvikio_mode: str  # "cuFile", "compat" or "" (unknown / absent)
    error: str = ""


def gpu() -> Gpu:
    """CUDA devices and kvikio's mode; torch is imported only when installed (it takes seconds)."""
    has_torch = importlib.util.find_spec("torch") is not None
    has_kvikio = importlib.util.find_spec("kvikio") is not None
    cuda, devices, mode, error = False, (), "", ""
    if has_torch:
        try:
            import torch

            cuda = bool(torch.cuda.is_available())
            devices = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if cuda else ()
        except Exception as exc:  # a broken driver install: reported, not raised
            error = f"torch.cuda: {exc}"
    if has_kvikio:
        try:
            import kvikio.defaults

            compat = getattr(kvikio.defaults, "compat_mode", None) or getattr(kvikio.defaults, "is_compat_mode_preferred")
            mode = "compat" if bool(compat()) else "cuFile"
        except Exception as exc:
            error = (error + "; " if error else "") + f"kvikio: {exc}"
    return Gpu(has_torch, cuda, devices, has_kvikio, mode, error)


@dataclass(frozen=True)
class GpuRuntimeFacts:
    """The GPU runtime torch runs on, with the versions torch and the runtime tell."""

    torch_version: str  # "" without torch
    runtime: str  # "CUDA", "ROCm" or "" (no torch, or a CPU build)
    vendor: str  # "NVIDIA", "AMD" or ""
    runtime_version: str  # torch.version.cuda / torch.version.hip
    driver_version: str = ""  # as the runtime reports it
    devices: tuple[str, ...] = ()
    read_only_supported: bool | None = None  # read-only host registration (None: no such thing, or unknown)
    read_only: str = ""  # the attributes read (or why there is no read-only registration)
    error: str = ""


def gpu_runtime() -> GpuRuntimeFacts:
    """Vendor, runtime and versions from torch (``torch.version.cuda`` / ``.hip``), the driver's version and
    read-only registration from the runtime itself (:mod:`engram_store.native.gpu_runtime`); never raises."""
    if importlib.util.find_spec("torch") is None:
        return GpuRuntimeFacts("", "", "", "")
    try:
        import torch
    except Exception as exc:  # a broken install: reported, not raised
        return GpuRuntimeFacts("", "", "", "", error=f"import torch: {exc}")
    hip, cuda = getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None)
    runtime, vendor, version = ("ROCm", "AMD", str(hip)) if hip else ("CUDA", "NVIDIA", str(cuda)) if cuda else ("", "", "")
    facts = GpuRuntimeFacts(str(torch.__version__), runtime, vendor, version)
    if not runtime:
        return facts
    try:
        if not torch.cuda.is_available():
            return facts
        devices = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        torch.cuda.init()
        from ..native.gpu_runtime import runtime as gpu

        rt = gpu()
        support = rt.read_only_support()
        return GpuRuntimeFacts(facts.torch_version, runtime, vendor, version, rt.versions().get("driver", ""),
                               devices, support.supported, support.detail)
    except Exception as exc:  # a driver that cannot be reached: reported, not raised
        return GpuRuntimeFacts(facts.torch_version, runtime, vendor, version, error=str(exc))
