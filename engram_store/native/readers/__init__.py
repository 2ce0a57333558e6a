"""Page readers: what moves 4 KiB pages of a layer file into memory, one module per backend.

A :class:`PageReader` reads extents (file offset, length) of an ``O_DIRECT``
file descriptor with ``queue_depth`` reads in flight. :func:`open_reader` picks
the backend by a probe, in this order, once per process, and logs the choice:

- ``uring`` (:mod:`.uring`): io_uring through raw syscalls in native code
  (``_uring.c``): a ring per reading thread with registered slots and files,
  batched submission and reaping, the GIL released for the whole batch; it
  *streams rows*: reads land in slots and each row is copied out (after its
  page's crc32c check) as soon as its read completes;
- ``aio`` (:mod:`.aio`): Linux AIO from one thread in native code (``_pread.c``),
  the GIL released for the whole batch; streams rows as ``uring`` does;
- ``threads`` (:mod:`.threads`): a pool of threads calling ``os.preadv``, the
  fallback when no native module is built (correct, about half of fio's IOPS).

``native`` asks for the best native backend and fails when none is built. The protocol and the
native readers' limits are in :mod:`.base`.
"""

from __future__ import annotations

import functools
import logging

from . import aio, threads, uring
from .base import DEFAULT_QUEUE_DEPTH, MAX_CHECKED_PAGES, MAX_NATIVE_QD, PageReader

__all__ = ["BACKENDS", "DEFAULT_QUEUE_DEPTH", "MAX_CHECKED_PAGES", "MAX_NATIVE_QD", "PageReader", "best_backend",
           "open_reader"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "native", "uring", "aio", "threads")


@functools.cache
def best_backend() -> str:
    """The backend ``auto`` means on this host: uring, else aio, else threads; probed once, logged."""
    why = uring.probe()
    if why is None:
        log.info("page reader: io_uring (native _uring)")
        return "uring"
    if aio.available():
        log.info("page reader: Linux AIO (native _pread); io_uring unavailable: %s", why)
        return "aio"
    log.warning("page reader: Python threads (os.preadv); io_uring unavailable: %s; _pread not built", why)
    return "threads"


def open_reader(queue_depth: int = DEFAULT_QUEUE_DEPTH, backend: str = "auto") -> PageReader:
    """A reader of the named backend; ``auto``: the best one this host can run (see
    :func:`best_backend`); ``native``: the best native one, or ValueError."""
    if queue_depth < 1:
        raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
    if backend not in BACKENDS:
        raise ValueError(f"reader backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend in ("auto", "native"):
        asked, backend = backend, best_backend()
        if backend == "threads" and asked == "native":
            raise ValueError("reader backend 'native' asked for but neither engram_store.native._uring (io_uring) "
                             "nor _pread (Linux AIO) can run here")
    if backend == "uring":
        why = uring.probe()
        if why is not None:
            raise ValueError(f"reader backend 'uring' asked for but io_uring cannot be used: {why}")
        return uring.UringReader(queue_depth)
    if backend == "aio":
        if not aio.available():
            raise ValueError("reader backend 'aio' asked for but engram_store.native._pread is not built")
        return aio.AioReader(queue_depth)
    return threads.ThreadReader(queue_depth)
