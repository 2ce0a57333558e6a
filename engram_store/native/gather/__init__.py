"""The row gather, shared by the daemon and every in-process reader of an arena.

:class:`Gatherer` copies rows ``src[index]`` into an output array with the
native module ``_gather`` (``_gather.c``: software prefetch, the GIL released,
a pool of native threads claiming blocks of rows) when it is built, else with
``np.take`` (large requests split across a Python thread pool). The daemon's
resident lookups, its Unix fast path (through the C API in ``gather_api.h``),
clients reading a mapped arena and ``LocalClient`` all gather through it.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ... import errors
from .. import load
from .split_out import SplitOut

log = logging.getLogger(__name__)

PARALLEL_MIN_ROWS = 16384  # fallback only: numpy gathers this large are split across Python threads


def native_gather():
    """The ``_gather`` extension module (row gathers on a native thread pool), or None."""
    return load("_gather", "using np.take on a Python thread pool")


class Gatherer:
    """Copies rows ``src[index]`` into ``out`` (both uint8 ``[*, row_bytes]``, C-contiguous)
    on up to ``threads`` threads. With the native gather (``_gather.c``: software
    prefetch, GIL released, a pool of native threads claiming blocks of rows) when
    built, else ``np.take`` with large requests split across a Python thread pool.
    Thread-safe. Index bounds are checked (IndexError)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._native = native_gather()
        use_pool = self._native is None and self.threads > 1
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="engram-gather") if use_pool else None

    def expect(self, rows: int) -> None:
        """A gather of ``rows`` rows is about to come: wake the native pool's idle threads
        now (tens of microseconds on a VM), so that they are running when it starts."""
        if self._native is not None and self.threads > 1 and rows >= self._native.MIN_SPLIT_ROWS:
            self._native.prime()

    def take(self, src: np.ndarray, index: np.ndarray, out: np.ndarray | SplitOut) -> None:
        index = np.ascontiguousarray(index, dtype=np.int64)
        if isinstance(out, SplitOut):  # a client's staging: split layout, under its gate
            native = self._split_native()
            wb, sb = out.weight_bytes, out.scale_bytes
            out.write(lambda i, pos, w, s: native.gather_to_split(src, wb, sb, i, pos, w, s, self.threads), index)
            return
        if self._native is not None:
            self._native.gather(src, src.shape[1], index, out, self.threads)
            return
        n = len(index)
        if n and (index.min() < 0 or index.max() >= len(src)):
            raise IndexError(f"gather: an index is outside [0, {len(src)})")
        parts = min(self.threads, n // PARALLEL_MIN_ROWS) if self._pool is not None else 1
        if parts <= 1:
            _numpy_take(src, index, out)
            return
        step = -(-n // parts)
        futures = [self._pool.submit(_numpy_take, src, index[lo : lo + step], out[lo : lo + step]) for lo in range(step, n, step)]
        _numpy_take(src, index[:step], out[:step])
        for f in futures:
            f.result()

    def take_split(self, weights: np.ndarray, scales: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = weights[index[i]] ++ scales[index[i]]``: rows of a table kept in the
        engines' two blocks (uint8 ``[rows, wb]`` and ``[rows, sb]``), ``out`` uint8
        ``[n, wb + sb]``. Bounds checked before anything is copied (IndexError)."""
        index = np.ascontiguousarray(index, dtype=np.int64)
        if isinstance(out, SplitOut):
            native, wb, sb = self._split_native(), weights.shape[1], scales.shape[1]
            out.write(lambda i, pos, w, s: native.gather_split_to_split(weights, wb, scales, sb, i, pos, w, s,
                                                                        self.threads), index)
            return
        if self._native is not None:
            self._native.gather_split(weights, weights.shape[1], scales, scales.shape[1], index, out, self.threads)
            return
        if len(index) and (index.min() < 0 or index.max() >= len(weights)):
            raise IndexError(f"gather: an index is outside [0, {len(weights)})")
        wb = weights.shape[1]
        out[:, :wb] = weights[index]
        out[:, wb:] = scales[index]

    def _split_native(self):
        if self._native is None:  # (the daemon takes no staging without it)
            raise errors.StorageError("rows into a client's staging need the native gather (_gather), not built")
        return self._native

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@functools.cache
def shared_gatherer(threads: int = 1) -> Gatherer:
    """A process-wide :class:`Gatherer` per thread count, for in-process readers of an
    arena: clients gathering from a mapped resident arena and ``LocalClient``. One
    thread by default, on purpose: those callers run beside the model's compute and
    must not compete with it for every core unless asked to."""
    return Gatherer(threads)


def _numpy_take(src: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    np.take(src, index, axis=0, out=out, mode="clip")
