"""Stand-ins for the GPU runtimes' libraries (no GPU here): a few lines of C, built into a test's tmp dir.

``build(directory)`` writes ``libamdhip64.so`` (HIP), ``libcudart.so.12`` (CUDA runtime) and
``libcuda.so.1`` (CUDA driver), each with a soname of its own (``libengram-standin-*.so``), so a
``dlopen`` of the real names elsewhere in the process never finds them. They export what
:mod:`engram_store.native.gpu_runtime` calls and record each call in globals a test reads with ctypes
(:class:`Standin`). What they answer follows the runtimes' documented behaviour:

* ``{hip,cu}LaunchHostFunc`` record the stream and data and run the host function on a thread of
  their own (joined before returning, like a driver's callback thread that never holds the GIL);
* ``cudaHostRegister``: flags outside 0x0F -> cudaErrorInvalidValue (1); a range registered before ->
  cudaErrorHostMemoryAlreadyRegistered (712); the read-only flag 0x08 on a device without
  ``cudaDevAttrHostRegisterReadOnlySupported`` -> cudaErrorNotSupported (801); a mapping that is not
  writable, registered without 0x08, on a device not using the host page tables
  (``cudaDevAttrPageableMemoryAccessUsesHostPageTables`` 0) -> cudaErrorInvalidValue (NVIDIA's
  documentation of cudaHostRegisterReadOnly; reported on drivers 580 and 595);
* ``hipHostRegister`` as AMD's runtime (CLR) does it: flags outside Portable | Mapped | IoMemory |
  0x08 | Uncached -> hipErrorInvalidValue; a repeated registration is accepted (no 712).
  ``refuse_read_only`` makes it refuse a read-only mapping (not known for AMD: no AMD GPU here).
Failures set a per-thread last error that ``{hip,cuda}GetLastError`` returns and clears.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef STANDIN_HIP
#define API(x) hip##x
#define ALLOWED_FLAGS (0x1u | 0x2u | 0x4u | 0x8u | 0x80000000u)
#else
#define API(x) cuda##x
#define ALLOWED_FLAGS 0xFu
#endif

#define MAXR 256
int standin_launches, standin_launch_result, standin_ran_elsewhere;
unsigned long long standin_last_stream, standin_last_data;
int standin_registers, standin_unregisters, standin_clears, standin_refuse_all, standin_refuse_read_only;
unsigned long long standin_reg_ptr[MAXR], standin_reg_size[MAXR];
unsigned int standin_reg_flags[MAXR];
int standin_attr_read_only = 1, standin_attr_host_tables = 0;
static __thread int last_error;
static uintptr_t live[MAXR];
static int nlive;

typedef struct { void (*fn)(void *); void *data; pthread_t caller; int elsewhere; } hostcall;

static void *host_thread(void *arg) {
    hostcall *h = arg;
    h->elsewhere = !pthread_equal(pthread_self(), h->caller);
    h->fn(h->data);
    return NULL;
}

static int launch(void *stream, void (*fn)(void *), void *data) {
    standin_launches++;
    standin_last_stream = (unsigned long long)(uintptr_t)stream;
    standin_last_data = (unsigned long long)(uintptr_t)data;
    if (standin_launch_result) return standin_launch_result;
    hostcall h = {fn, data, pthread_self(), 0};
    pthread_t t;
    if (pthread_create(&t, NULL, host_thread, &h) != 0) return 999;
    pthread_join(t, NULL);
    standin_ran_elsewhere = h.elsewhere;
    return 0;
}

int cuLaunchHostFunc(void *stream, void (*fn)(void *), void *data) { return launch(stream, fn, data); }
int hipLaunchHostFunc(void *stream, void (*fn)(void *), void *data) { return launch(stream, fn, data); }
int cuDriverGetVersion(int *v) { *v = 12060; return 0; }
int hipDriverGetVersion(int *v) { *v = 60241134; return 0; }
#ifdef STANDIN_HIP
int hipRuntimeGetVersion(int *v) { *v = 60241134; return 0; }
#else
int cudaRuntimeGetVersion(int *v) { *v = 12040; return 0; }
#endif

/* every page of [p, p + n) in a writable mapping of this process */
static int writable(uintptr_t p, size_t n) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return 0;
    char line[512];
    uintptr_t covered = p;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
        if (lo <= covered && covered < hi) {
            if (perms[1] != 'w') break;
            covered = hi;
            if (covered >= p + n) break;
        }
    }
    fclose(f);
    return covered >= p + n;
}

static int fail(int code) { last_error = code; return code; }

int API(HostRegister)(void *ptr, size_t size, unsigned int flags) {
    uintptr_t p = (uintptr_t)ptr;
    int i = standin_registers++ % MAXR;
    standin_reg_ptr[i] = p;
    standin_reg_size[i] = size;
    standin_reg_flags[i] = flags;
    if (standin_refuse_all) return fail(2);
    if (!ptr || !size || (flags & ~ALLOWED_FLAGS)) return fail(1);
#ifdef STANDIN_HIP
    if (standin_refuse_read_only && !writable(p, size)) return fail(1);
#else
    for (int k = 0; k < nlive; k++)
        if (live[k] == p) return fail(712);
    if ((flags & 0x8u) && !standin_attr_read_only) return fail(801);
    if (!(flags & 0x8u) && !standin_attr_host_tables && !writable(p, size)) return fail(1);
#endif
    if (nlive < MAXR) live[nlive++] = p;
    return 0;
}

int API(HostUnregister)(void *ptr) {
    standin_unregisters++;
    for (int k = 0; k < nlive; k++)
        if (live[k] == (uintptr_t)ptr) { live[k] = live[--nlive]; return 0; }
    return fail(713);
}

int API(GetLastError)(void) { int e = last_error; last_error = 0; standin_clears++; return e; }
int standin_peek_last_error(void) { return last_error; }
int API(GetDevice)(int *d) { *d = 0; return 0; }

int API(DeviceGetAttribute)(int *value, int attr, int device) {
    if (device != 0) return fail(101);
#ifndef STANDIN_HIP
    if (attr == 113) { *value = standin_attr_read_only; return 0; }
    if (attr == 100) { *value = standin_attr_host_tables; return 0; }
#endif
    return fail(1);
}

const char *API(GetErrorName)(int code) {
#ifdef STANDIN_HIP
    switch (code) { case 0: return "hipSuccess"; case 1: return "hipErrorInvalidValue";
                    case 2: return "hipErrorOutOfMemory"; case 712: return "hipErrorHostMemoryAlreadyRegistered"; }
    return "hipErrorUnknown";
#else
    switch (code) { case 0: return "cudaSuccess"; case 1: return "cudaErrorInvalidValue";
                    case 2: return "cudaErrorMemoryAllocation"; case 712: return "cudaErrorHostMemoryAlreadyRegistered";
                    case 801: return "cudaErrorNotSupported"; }
    return "cudaErrorUnknown";
#endif
}
"""

LIBRARIES = {  # file name -> (define, soname)
    "libamdhip64.so": ("STANDIN_HIP", "libengram-standin-hip.so"),
    "libcudart.so.12": ("STANDIN_CUDART", "libengram-standin-cudart.so"),
    "libcuda.so.1": ("STANDIN_CUDA_DRIVER", "libengram-standin-cuda.so"),
}


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def build(directory: Path) -> dict[str, Path]:
    """Compile the three stand-ins into ``directory``; ``{file name: path}``."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) to build the GPU runtime stand-ins")
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "standin.c"
    source.write_text(SOURCE)
    out = {}
    for name, (define, soname) in LIBRARIES.items():
        path = directory / name
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-D{define}", f"-Wl,-soname,{soname}",
                        "-o", str(path), str(source), "-lpthread"], check=True, capture_output=True, text=True)
        out[name] = path
    return out


class Standin:
    """A loaded stand-in library's call record and knobs (ctypes on its globals)."""

    INTS = ("launches", "launch_result", "ran_elsewhere", "registers", "unregisters", "clears", "refuse_all",
            "refuse_read_only", "attr_read_only", "attr_host_tables")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))

    def __getattr__(self, name: str) -> int:
        if name in self.INTS:
            return ctypes.c_int.in_dll(self.lib, f"standin_{name}").value
        if name in ("last_stream", "last_data"):
            return ctypes.c_ulonglong.in_dll(self.lib, f"standin_{name}").value
        raise AttributeError(name)

    def set(self, **values: int) -> None:
        for name, value in values.items():
            assert name in self.INTS, name
            ctypes.c_int.in_dll(self.lib, f"standin_{name}").value = value

    def registration(self, k: int) -> tuple[int, int, int]:
        """(ptr, size, flags) of the k-th register call (negative: from the last)."""
        k %= self.registers
        return (ctypes.c_ulonglong * 256).in_dll(self.lib, "standin_reg_ptr")[k], \
            (ctypes.c_ulonglong * 256).in_dll(self.lib, "standin_reg_size")[k], \
            (ctypes.c_uint * 256).in_dll(self.lib, "standin_reg_flags")[k]

    def pending_error(self) -> int:
        fn = self.lib.standin_peek_last_error
        fn.restype = ctypes.c_int
        return fn()

    def address(self, symbol: str) -> int:
        return ctypes.cast(getattr(self.lib, symbol), ctypes.c_void_p).value
