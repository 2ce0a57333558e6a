"""The io_uring page reader: native code (``engram_store/native/readers/_uring.c``), raw syscalls, no liburing.

Each thread that reads gets its own ``_uring.Ring`` (made on its first read, kept in a
thread-local): a ring serves one call at a time, and one per thread means no call waits
on another. A ring owns

- ``queue_depth`` scratch slots registered with the kernel (``IORING_REGISTER_BUFFERS``):
  ``read_rows`` reads into them with ``IORING_OP_READ_FIXED`` and ignores the ``scratch``
  argument of :class:`~engram_store.native.readers.PageReader`;
- the descriptors it has read from, registered on first use (``IORING_REGISTER_FILES``),
  so reads name them by fixed index. The ring keeps its own reference to each: a number
  closed and reused for another file is noticed (fstat) and re-registered, never read stale.

A ring lives as long as its thread or until :meth:`UringReader.close`. A thread asking for
a deeper queue or a longer extent than its ring has gets a larger ring; a forked child
gets new rings (the parent's are not its to use). Memory: ``queue_depth * slot`` bytes per
reading thread (64 x 64 KiB = 4 MiB at the defaults), pinned while registered; where
``RLIMIT_MEMLOCK`` refuses that, the ring reads into the same slots unregistered (logged once).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref

import numpy as np

from ...errors import StorageError
from ..syscalls import PAGE as PAGE_BYTES
from .base import MAX_NATIVE_QD

log = logging.getLogger(__name__)

MIN_SLOT_BYTES = 16 * PAGE_BYTES  # the NVMe tier's default coalesced read; longer extents get larger slots
MAX_REGISTERED_FILES = 64  # descriptors one ring registers; reads of others go by plain fd


@functools.cache
def probe() -> str | None:
    """None when the io_uring reader can run here, else why not; probed once."""
    try:
        from ...native import _uring
    except ImportError as exc:
        return f"engram_store.native._uring is not built ({exc})"
    return _uring.probe()


def available() -> bool:
    return probe() is None


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _slot_bytes(longest: int) -> int:
    """Slot size for extents of up to ``longest`` bytes: a power of two, at least MIN_SLOT_BYTES."""
    size = MIN_SLOT_BYTES
    while size < longest:
        size *= 2
    return size


class UringReader:
    """:class:`~engram_store.native.readers.PageReader` over io_uring; streams rows.
    Thread-safe: one ring per reading thread. ``sqpoll``: rings with a kernel thread polling
    their submission queue (no syscall to submit; costs that thread's CPU, so worth it only
    with cores to spare)."""

    name = "uring"
    streams_rows = True

    def __init__(self, queue_depth: int, *, sqpoll: bool = False) -> None:
        why = probe()
        if why is not None:
            raise ValueError(f"the io_uring reader cannot run here: {why}")
        from ...native import _uring

        self._uring = _uring
        self.queue_depth = queue_depth
        self.sqpoll = sqpoll
        self._local = threading.local()
        self._rings: weakref.WeakSet = weakref.WeakSet()  # every live ring, to close them all
        self._lock = threading.Lock()
        self._closed = False
        self._warned_unregistered = False

    def _ring(self, qd: int, slot_bytes: int):
        ring = getattr(self._local, "ring", None)
        if ring is not None and ring.usable and ring.queue_depth >= qd and ring.slot_bytes >= slot_bytes:
            return ring
        with self._lock:
            if self._closed:
                raise StorageError("the io_uring page reader is closed")
            if ring is not None and ring.usable:  # too small: grow, keeping what it had
                qd, slot_bytes = max(qd, ring.queue_depth), max(slot_bytes, ring.slot_bytes)
                ring.close()
            ring = self._uring.Ring(max(qd, min(self.queue_depth, MAX_NATIVE_QD)), slot_bytes, sqpoll=self.sqpoll)
            self._rings.add(ring)
            if not ring.fixed_buffers and not self._warned_unregistered:
                self._warned_unregistered = True
                log.warning("io_uring refused to register %d KiB of read slots (RLIMIT_MEMLOCK?); reads use "
                            "unregistered buffers", ring.queue_depth * ring.slot_bytes >> 10)
        log.debug("io_uring ring for thread %s: queue depth %d, %d KiB slots, %s", threading.current_thread().name,
                  ring.queue_depth, ring.slot_bytes >> 10, ring.setup)
        self._local.ring = ring
        return ring

    def _register(self, ring, fd: int) -> None:
        """Make ``fd`` one of ``ring``'s fixed files (the others kept while still open)."""
        kept = [f for f in ring.registered_files if f >= 0 and f != fd][: MAX_REGISTERED_FILES - 1]
        try:
            ring.register_files(kept + [fd])
        except OSError:  # one of the kept is closed now, or fd is not a file
            try:
                ring.register_files([fd])
            except OSError:
                ring.unregister_files()

    def _prepare(self, fd: int, qd: int | None, longest: int):
        qd = min(qd or self.queue_depth, MAX_NATIVE_QD)
        ring = self._ring(qd, _slot_bytes(longest))
        if fd not in ring.registered_files:
            self._register(ring, fd)
        return ring, qd

    def read(self, fd: int, buf, file_offsets: np.ndarray, lengths: np.ndarray, buf_offsets: np.ndarray,
             queue_depth: int | None = None) -> int:
        ring, qd = self._prepare(fd, queue_depth, 0)
        return ring.read_batch(fd, buf, _i64(file_offsets), _i64(lengths), _i64(buf_offsets), queue_depth=qd)

    def read_rows(self, fd: int, out: np.ndarray, row_bytes: int, file_offsets: np.ndarray, lengths: np.ndarray,
                  first_row: np.ndarray, row_offsets: np.ndarray, scratch=None, queue_depth: int | None = None,
                  page_crcs: np.ndarray | None = None, stop: np.ndarray | None = None) -> tuple:
        """As the protocol says, but reads land in this thread's ring slots; ``scratch`` is unused. With
        ``stop`` the reads end early once it is raised (see the protocol)."""
        lengths = _i64(lengths)
        ring, qd = self._prepare(fd, queue_depth, int(lengths.max()) if len(lengths) else 0)
        args = (fd, out, row_bytes, _i64(file_offsets), lengths, _i64(first_row), _i64(row_offsets))
        extra = {} if stop is None else {"stop": stop}
        if page_crcs is None:
            got = ring.read_rows(*args, queue_depth=qd, **extra)
            return (got[0], np.empty(0, dtype=np.int64)) + tuple(got[2:])
        bad = np.empty(int(lengths.sum()) // PAGE_BYTES, dtype=np.int64)
        got = ring.read_rows(*args, page_crcs, bad, queue_depth=qd, **extra)
        return (got[0], bad[: got[1]]) + tuple(got[2:])

    def close(self) -> None:
        """Close every ring (of every thread); reads afterwards raise StorageError."""
        with self._lock:
            self._closed = True
            rings = list(self._rings)
        for ring in rings:
            try:
                ring.close()
            except RuntimeError:  # a thread is reading through it still: it goes when that thread drops it
                log.warning("io_uring ring still in use at close; it is freed when its thread lets go")
