"""The GPU runtime engram-store calls: CUDA or HIP (ROCm), whichever torch runs on. One seam, probed once.

engram-store asks five things of a GPU runtime, and each differs between the two:

==========================  ===========================================  ==========================================
                            CUDA                                         HIP (ROCm)
==========================  ===========================================  ==========================================
the fetch job's host        ``cuLaunchHostFunc`` (the driver,            ``hipLaunchHostFunc`` (the ``libamdhip64``
function launch             ``libcuda.so.1``)                            torch loaded: never a second copy)
host registration flags     ``cudaHostRegister``: Portable 0x01,         ``hipHostRegister``: Portable 0x01, Mapped
                            Mapped 0x02, ReadOnly 0x08                   0x02; no read-only flag (see below)
"already registered"        ``cudaErrorHostMemoryAlreadyRegistered``     ``hipErrorHostMemoryAlreadyRegistered``:
                            712                                          712, 1061 in early HIP; AMD's runtime does
                                                                         not detect a repeated registration at all
clearing the last error     ``cudaGetLastError`` (the ``libcudart``      ``hipGetLastError``
                            torch loaded)
read-only registration      ``cudaDeviceGetAttribute(                    none: ``hipHostRegisterReadOnly`` (0x08)
supported?                  cudaDevAttrHostRegisterReadOnlySupported)``  is ignored on AMD GPUs, and AMD's runtime
                                                                         takes the same bit as
                                                                         ``hipExtHostRegisterCoarseGrained``; it is
                                                                         never passed there
==========================  ===========================================  ==========================================

Both launches have one signature, ``int (stream, void (*)(void *), void *)``: the fetch job
(``fetch/_fetch.c``, through ``host_launch.c``) asks :func:`host_launcher` for the address and never links
either runtime. Registration state is the process's: :mod:`gpu_client.resident` keeps the record of
what it registered, since HIP cannot say "already registered".

:func:`runtime` picks the side at first use from ``torch.version.hip`` and looks its libraries up
among those the process has loaded (``/proc/self/maps``); the result is kept. Without torch, on a
CPU build of torch, or without the libraries, it raises ``EngineUnsupported`` saying which.
Tests route every call through stand-in libraries with :func:`use` (:meth:`GpuRuntime.load` takes
their paths). Nothing here runs at import time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from dataclasses import dataclass

from ...errors import EngineUnsupported

log = logging.getLogger(__name__)

CUDA, HIP = "cuda", "hip"
MAPS = "/proc/self/maps"

# cudaDeviceAttr values (driver_types.h)
CUDA_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported
CUDA_ATTR_USES_HOST_PAGE_TABLES = 100  # cudaDevAttrPageableMemoryAccessUsesHostPageTables


@dataclass(frozen=True)
class RegisterFlags:
    """The runtime's host-registration flags engram-store uses (0: the runtime has none that works)."""

    portable: int
    mapped: int
    read_only: int


@dataclass(frozen=True)
class Side:
    """What differs between CUDA and HIP: names, flags, codes, where the entry points live."""

    kind: str
    label: str  # for people: "CUDA" / "ROCm (HIP)"
    prefix: str  # "cuda" / "hip": the runtime API's names
    launch_symbol: str
    result_type: str  # what the launch returns, for messages
    flags: RegisterFlags
    already_registered: frozenset[int]
    not_registered: frozenset[int]
    not_supported: int


CUDA_SIDE = Side(CUDA, "CUDA", "cuda", "cuLaunchHostFunc", "CUresult",
                 RegisterFlags(portable=0x01, mapped=0x02, read_only=0x08),
                 already_registered=frozenset({712}), not_registered=frozenset({713}), not_supported=801)
# hipHostRegisterReadOnly (0x08) is "ignored on AMD devices" (HIP's header), and AMD's runtime reads that bit
# as hipExtHostRegisterCoarseGrained: never passed. 1061/1062 are early HIP's numbers for the two codes.
HIP_SIDE = Side(HIP, "ROCm (HIP)", "hip", "hipLaunchHostFunc", "hipError_t",
                RegisterFlags(portable=0x01, mapped=0x02, read_only=0),
                already_registered=frozenset({712, 1061}), not_registered=frozenset({713, 1062}), not_supported=801)
SIDES = {CUDA: CUDA_SIDE, HIP: HIP_SIDE}


@dataclass(frozen=True)
class ReadOnlySupport:
    """Whether host memory can be registered read-only: True / False, or None when the runtime has no
    read-only registration (HIP) or could not say; ``detail`` names the attribute values read."""

    supported: bool | None
    detail: str


def loaded_library(fragment: str, maps: str = MAPS) -> str | None:
    """The path of a shared library this process has mapped whose file name contains ``fragment``."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/") and fragment in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


def _symbol(lib: ctypes.CDLL, name: str, restype, argtypes, where: str, required: bool = True):
    try:
        fn = getattr(lib, name)
    except AttributeError:
        if required:
            raise EngineUnsupported(f"{where} has no {name}: not the GPU runtime engram-store expects") from None
        return None
    fn.restype, fn.argtypes = restype, argtypes
    return fn


class GpuRuntime:
    """One GPU runtime's entry points, called through ctypes on its libraries. The calls are stateless
    (the runtimes are thread-safe; their last error is per thread), so one object serves every thread."""

    def __init__(self, side: Side, runtime_lib: str, launch_lib: str) -> None:
        self.side, self.kind, self.flags = side, side.kind, side.flags
        self.runtime_lib, self.launch_lib = runtime_lib, launch_lib
        try:
            rt = ctypes.CDLL(runtime_lib)
            launcher = rt if launch_lib == runtime_lib else ctypes.CDLL(launch_lib)
        except OSError as exc:
            raise EngineUnsupported(f"cannot load the {side.label} runtime ({exc})") from None
        p, vp, i, u, sz = side.prefix, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        ip = ctypes.POINTER(ctypes.c_int)
        launch = _symbol(launcher, side.launch_symbol, i, [vp, vp, vp], launch_lib)
        self.launch_address = int(ctypes.cast(launch, vp).value)
        self._register = _symbol(rt, f"{p}HostRegister", i, [vp, sz, u], runtime_lib)
        self._unregister = _symbol(rt, f"{p}HostUnregister", i, [vp], runtime_lib)
        self._last_error = _symbol(rt, f"{p}GetLastError", i, [], runtime_lib)
        self._get_device = _symbol(rt, f"{p}GetDevice", i, [ip], runtime_lib, required=False)
        self._attribute = _symbol(rt, f"{p}DeviceGetAttribute", i, [ip, i, i], runtime_lib, required=False)
        self._error_name = _symbol(rt, f"{p}GetErrorName", ctypes.c_char_p, [i], runtime_lib, required=False)
        self._versions = {what: _symbol(lib, name, i, [ip], where, required=False) for what, lib, name, where in (
            ("runtime", rt, f"{p}RuntimeGetVersion", runtime_lib),
            ("driver", launcher if side.kind == CUDA else rt, "cuDriverGetVersion" if side.kind == CUDA
             else "hipDriverGetVersion", launch_lib))}

    @classmethod
    def load(cls, kind: str, *, runtime: str | None = None, driver: str | None = None) -> "GpuRuntime":
        """The ``kind`` runtime (``cuda`` or ``hip``) from the libraries this process has loaded, or from
        the paths given. CUDA: ``runtime`` is libcudart (default: the one mapped here, as torch loads it),
        ``driver`` libcuda (default ``libcuda.so.1``). HIP: ``runtime`` is libamdhip64 (default: the one
        mapped here; a second copy would not know torch's streams); ``driver`` is not used."""
        side = SIDES.get(kind)
        if side is None:
            raise EngineUnsupported(f"GPU runtime {kind!r}: engram-store knows {sorted(SIDES)}")
        if kind == HIP:
            lib = runtime or loaded_library("libamdhip64.so")
            if lib is None:
                raise EngineUnsupported("torch runs on ROCm but libamdhip64 is not loaded in this process (import "
                                        "torch and use the GPU first): the fetch job's hipLaunchHostFunc must come "
                                        "from the HIP runtime torch uses")
            return cls(side, lib, lib)
        lib = runtime or loaded_library("libcudart.so")
        if lib is None:  # a torch without a shared libcudart: another copy still registers and launches
            lib = "libcudart.so"
            log.info("torch's libcudart is not mapped in this process; calling the CUDA runtime through %s", lib)
        return cls(side, lib, driver or "libcuda.so.1")

    # --- calls ------------------------------------------------------------------------------
    def register(self, ptr: int, size: int, *, read_only: bool = False) -> int:
        """``{cuda,hip}HostRegister(ptr, size, Portable | Mapped [| ReadOnly])``: the runtime's error code
        (0 success). ``read_only`` adds the read-only flag where the runtime has one (not on HIP)."""
        flags = self.flags.portable | self.flags.mapped | (self.flags.read_only if read_only else 0)
        return int(self._register(ptr, size, flags))

    def unregister(self, ptr: int) -> int:
        return int(self._unregister(ptr))

    def clear_last_error(self) -> int:
        """Reset this thread's last error after a failed call handled here (torch checks it after every
        kernel launch: left set, a refused registration would surface as an unrelated launch failure)."""
        return int(self._last_error())

    def already_registered(self, code: int) -> bool:
        return code in self.side.already_registered

    def not_registered(self, code: int) -> bool:
        return code in self.side.not_registered

    def error_name(self, code: int) -> str:
        name = self._error_name(code) if self._error_name is not None else None
        return name.decode() if name else f"{self.side.result_type} {code}"

    def device(self) -> int | None:
        """The calling thread's current device, or None when the runtime cannot say."""
        if self._get_device is None:
            return None
        value = ctypes.c_int(-1)
        if self._get_device(ctypes.byref(value)) != 0:
            self.clear_last_error()
            return None
        return value.value

    def attribute(self, attr: int, device: int) -> int | None:
        if self._attribute is None:
            return None
        value = ctypes.c_int(-1)
        if self._attribute(ctypes.byref(value), attr, device) != 0:
            self.clear_last_error()
            return None
        return value.value

    def read_only_support(self) -> ReadOnlySupport:
        """Whether this runtime and the current device register host memory read-only (CUDA:
        ``cudaDevAttrHostRegisterReadOnlySupported``, with ``...UsesHostPageTables`` in the detail)."""
        if not self.flags.read_only:
            return ReadOnlySupport(None, f"{self.side.label} has no read-only host registration that AMD GPUs "
                                         "honour (hipHostRegisterReadOnly is ignored there): registered without it")
        device = self.device()
        value = None if device is None else self.attribute(CUDA_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, device)
        if value is None:
            return ReadOnlySupport(None, "cudaDevAttrHostRegisterReadOnlySupported could not be read")
        detail = f"cudaDevAttrHostRegisterReadOnlySupported = {value} on device {device}"
        tables = self.attribute(CUDA_ATTR_USES_HOST_PAGE_TABLES, device)
        if tables is not None:
            detail += f", cudaDevAttrPageableMemoryAccessUsesHostPageTables = {tables}"
        return ReadOnlySupport(bool(value), detail)

    def versions(self) -> dict[str, str]:
        """``{"runtime": "12.4", "driver": "12.6"}`` as the runtime reports them (what it cannot: left out)."""
        out = {}
        for what, fn in self._versions.items():
            value = ctypes.c_int(0)
            if fn is not None and fn(ctypes.byref(value)) == 0 and value.value > 0:
                v = value.value  # CUDA: 1000 * major + 10 * minor; HIP: 10^7 * major + 10^5 * minor + patch
                out[what] = (f"{v // 1000}.{v % 1000 // 10}" if self.kind == CUDA
                             else f"{v // 10_000_000}.{v // 100_000 % 100}.{v % 100_000}")
        return out

    def describe(self) -> str:
        return f"{self.side.label} through {self.runtime_lib}" + (
            f" and {self.launch_lib}" if self.launch_lib != self.runtime_lib else "")


# --- the process's runtime -------------------------------------------------------------------
_lock = threading.Lock()
_override: GpuRuntime | None = None


def torch_runtime() -> tuple[str, str]:
    """``(kind, version)`` of the GPU runtime torch was built for: ``("hip", "6.2.41133")``,
    ``("cuda", "12.4")``; EngineUnsupported without torch or on a CPU build of it."""
    try:
        import torch
    except ImportError:
        raise EngineUnsupported("torch is not installed: no GPU runtime to talk to") from None
    hip, cuda = getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None)
    if hip:
        return HIP, str(hip)
    if cuda:
        return CUDA, str(cuda)
    raise EngineUnsupported(f"torch {torch.__version__} is built for neither CUDA nor ROCm: no GPU runtime here")


@functools.cache
def _default() -> GpuRuntime:
    kind, version = torch_runtime()
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()  # torch's context first, as torch.cuda.cudart() would: the calls here then share it
    rt = GpuRuntime.load(kind)
    log.info("GPU runtime: %s (torch built for %s)", rt.describe(), version)
    return rt


def runtime() -> GpuRuntime:
    """This process's GPU runtime (chosen at first use from torch, then kept)."""
    with _lock:
        override = _override
    return override if override is not None else _default()


def use(rt: GpuRuntime | None) -> GpuRuntime | None:
    """Route this process's GPU calls through ``rt`` (tests: stand-in libraries), or back to torch's
    runtime with None. Returns the runtime used before (None: torch's)."""
    global _override
    with _lock:
        previous, _override = _override, rt
    return previous


def host_launcher() -> tuple[int, str, str]:
    """``(address, name, result type)`` of the host-function launch: what ``host_launch.c`` calls."""
    rt = runtime()
    return rt.launch_address, rt.side.launch_symbol, rt.side.result_type
