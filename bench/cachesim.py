"""The cache simulators of bench/traffic.py: exact LRU, S3-FIFO as the store runs it, Belady's MIN.

Native code (``bench/_cachesim.c``, plain C built with ``cc -O2 -shared`` on first use into
``~/.cache/engram-store``, keyed by the source's hash, loaded with ctypes) over dense int32 ids:
Python would take minutes per 50M accesses. ``tests/test_bench_traffic.py`` holds every
simulator equal, hit for hit, to a pure-Python reference and to the store's own ``S3FifoPolicy``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from engram_store.errors import EngramStoreError
from engram_store.storage.policies import s3fifo
from engram_store.storage.row_cache import ADMIT_DIVISOR

SOURCE = Path(__file__).with_name("_cachesim.c")


# --------------------------------------------------------------------------- native simulators
class NativeUnavailable(EngramStoreError):
    """The native cache simulator cannot be built (no C compiler) or loaded."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "engram-store"


@functools.cache
def native() -> ctypes.CDLL:
    """The simulator library, compiled once per source version into ``~/.cache/engram-store``."""
    source = SOURCE.read_bytes()
    lib = _cache_dir() / f"cachesim-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not lib.exists():
        cc = os.environ.get("CC", "cc")
        if shutil.which(cc) is None:
            raise NativeUnavailable(f"no C compiler {cc!r} on PATH to build {SOURCE.name}; install gcc or set CC")
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=False)
            if done.returncode:
                raise NativeUnavailable(f"{cc} failed to build {SOURCE}: {done.stderr.strip()[:2000]}")
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    dll = ctypes.CDLL(str(lib))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.cs_next_use.argtypes, dll.cs_next_use.restype = [p, i64, i64, p], i32
    dll.cs_lru.argtypes, dll.cs_lru.restype = [p, i64, i64, i64, i64], i64
    dll.cs_belady.argtypes, dll.cs_belady.restype = [p, p, i64, i64, i64, i64], i64
    dll.cs_s3fifo.argtypes = [p, p, i64, i64, p, i64, i64, i32, i32, i64, i64, i64, i64, p]
    dll.cs_s3fifo.restype = i64
    return dll


def _ptr(a: np.ndarray, dtype) -> int:
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise TypeError(f"expected a contiguous {np.dtype(dtype)} array, got {a.dtype}")
    return a.ctypes.data


def _checked(hits: int, what: str) -> int:
    if hits < 0:
        raise MemoryError(f"native {what} simulator could not allocate its state")
    return int(hits)


def _n_ids(ids: np.ndarray, n_ids: int | None) -> int:
    return int(ids.max()) + 1 if n_ids is None and ids.size else int(n_ids or 0)


def next_use(ids: np.ndarray, n_ids: int | None = None) -> np.ndarray:
    """int64 next position of each access's id; ``n + i`` where it is never used again."""
    out = np.empty(ids.size, dtype=np.int64)
    if native().cs_next_use(_ptr(ids, np.int32), ids.size, _n_ids(ids, n_ids), _ptr(out, np.int64)):
        raise MemoryError("native next-use pass could not allocate its state")
    return out


def lru_hits(ids: np.ndarray, capacity: int, count_from: int = 0, n_ids: int | None = None) -> int:
    """Hits of an exact per-access LRU of ``capacity`` entries over dense int32 ``ids``."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    return _checked(native().cs_lru(_ptr(ids, np.int32), ids.size, _n_ids(ids, n_ids), capacity, count_from), "LRU")


def belady_hits(ids: np.ndarray, capacity: int, count_from: int = 0, n_ids: int | None = None,
                nxt: np.ndarray | None = None) -> int:
    """Hits of Belady's MIN with bypass (evict, or do not admit, what is used farthest ahead)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    n_ids = _n_ids(ids, n_ids)
    nxt = next_use(ids, n_ids) if nxt is None else nxt
    return _checked(native().cs_belady(_ptr(ids, np.int32), _ptr(nxt, np.int64), ids.size, n_ids, capacity,
                                       count_from), "Belady")


def s3fifo_params(n_slots: int) -> dict:
    """The parameters S3FifoPolicy(n_slots) and RowCache derive (storage/policies/s3fifo.py, arena.py)."""
    ghost_capacity = max(1, int(n_slots * s3fifo.GHOST_FRACTION))
    return {"small_target": max(1, int(n_slots * s3fifo.SMALL_FRACTION)),
            "ghost_bits": max(int(ghost_capacity - 1).bit_length(), 1), "freq_max": s3fifo.FREQ_MAX,
            "min_window": s3fifo.MIN_WINDOW, "max_rounds": s3fifo.MAX_ROUNDS,
            "admit_limit": max(1, n_slots // ADMIT_DIVISOR)}


S3_STATS = ("small_evicted", "promoted", "main_evicted", "ghost_admitted", "small_at_end")  # _cachesim.c order


def s3fifo_hits(ids: np.ndarray, bounds: np.ndarray, keys: np.ndarray, n_slots: int, count_from: int = 0,
                stats: dict | None = None) -> int:
    """Hits of the store's S3-FIFO, lookup by lookup (``bounds``); ``keys[id]``: the store key of
    each dense id (layer index << 40 | row), which the ghost set hashes. ``stats``, if given, gets
    the policy's counters (:data:`S3_STATS`, over the whole trace)."""
    if n_slots < 1:
        raise ValueError(f"n_slots must be >= 1, got {n_slots}")
    if bounds[0] != 0 or bounds[-1] != ids.size:
        raise ValueError("bounds must run from 0 to len(ids)")
    p = s3fifo_params(n_slots)
    counters = np.zeros(len(S3_STATS), dtype=np.int64)
    hits = _checked(native().cs_s3fifo(
        _ptr(ids, np.int32), _ptr(bounds, np.int64), bounds.size - 1, keys.size, _ptr(keys, np.int64), n_slots,
        p["small_target"], p["ghost_bits"], p["freq_max"], p["min_window"], p["max_rounds"], p["admit_limit"],
        count_from, _ptr(counters, np.int64)), "S3-FIFO")
    if stats is not None:
        stats.update(zip(S3_STATS, counters.tolist()))
    return hits


# --------------------------------------------------------------------------- text -> tokens
