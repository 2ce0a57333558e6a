"""Host facts ``doctor`` weighs, each read on its own and never fatal: huge pages, THP, memlock,
free disk, the NVMe reader and O_DIRECT on the tables' file system, CUDA and kvikio, and the GPU runtime
(vendor, CUDA or ROCm, versions, read-only host registration).

Memory (``MemAvailable`` and cgroup limits) comes from :func:`engram_store.daemon.host.memory_limits`,
the daemon's own preflight helper. Every reader takes the paths it reads, so tests point it at
fixture files.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path

HUGE_PAGE_BYTES = 2 << 20
THP_DIR = "/sys/kernel/mm/transparent_hugepage"


@dataclass(frozen=True)
class HugePages:
    """Reserved (hugetlb) pages of the default size and the THP settings."""

    total: int  # HugePages_Total
    free: int  # HugePages_Free
    page_bytes: int  # Hugepagesize
    thp_enabled: str  # THP_DIR/enabled: always, madvise, never ("" unknown)
    thp_shmem: str  # THP_DIR/shmem_enabled: always, within_size, advise, never, deny, force ("" unknown)

    @property
    def shmem_thp(self) -> bool:
        """Whether a memfd mapping asking with MADV_HUGEPAGE gets transparent huge pages."""
        return self.thp_shmem in ("always", "within_size", "advise", "force")


def _chosen(path: Path) -> str:
    """The bracketed choice of a sysfs setting such as ``always [madvise] never``."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text.strip()


def huge_pages(meminfo: str | os.PathLike = "/proc/meminfo", thp_dir: str | os.PathLike = THP_DIR) -> HugePages:
    values = {}
    try:
        for line in Path(meminfo).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return HugePages(values.get("HugePages_Total", 0), values.get("HugePages_Free", 0),
                     values.get("Hugepagesize", HUGE_PAGE_BYTES), _chosen(Path(thp_dir) / "enabled"),
                     _chosen(Path(thp_dir) / "shmem_enabled"))


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
