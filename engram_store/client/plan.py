"""Executing a read plan: the client reads a plan lookup's cold rows from the layer file itself.

A plan lookup (``EngramClient.lookup_planned``, :class:`~.plan_lookups.PlannedLookups`) gets the
rows a cached daemon holds in DRAM through the shared region, and for the others a
:class:`~engram_store.wire.frames.ReadPlan`: which pages of which layer file,
each page's expected crc32c, and where each missing row sits in its page. An
executor (:class:`PlanExecutor`) reads those pages, checks **every page against its
crc32c before any of its rows is copied out**, and scatters the rows into the output: no
unverified row is ever returned (a page that fails raises
:class:`~engram_store.errors.CorruptRows`, naming layer and pages).

This module holds the executors' contract, the layer files they share (:class:`LayerFiles`)
and :class:`HostPlanExecutor` (CPU, and the tests): ``O_DIRECT`` page reads into an
aligned host buffer, adjacent pages coalesced, many in flight (the native
``_pread`` AIO batch reader when built, else ``os.preadv`` one by one), checked
with :func:`engram_store.format.checksums.bad_pages`, rows gathered with numpy.
The device executor (kvikio, pages checked on the GPU) is :mod:`.plan_device`.

Layer files must be readable by the client process (e.g. group-readable by the
engine's group, mode 0640). Every plan carries the identity (device, inode,
size) of the file the daemon reads; an executor checks it on every plan and
opens the path again when the daemon's file changed (:class:`LayerFiles`).
When a file cannot be opened (``PermissionError``, another mount namespace,
another file at that path) the executor raises :class:`PlanUnusable` and the
transport falls back to the daemon reading the rows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from .. import errors
from ..format import checksums
from ..format.layout import PAGE_BYTES, extents
from ..native.readers import PageReader, open_reader
from ..native.syscalls import OpenedFile, aligned_buffer, as_array, open_direct
from ..wire.frames import ReadPlan

log = logging.getLogger(__name__)

QUEUE_DEPTH = 64  # page reads in flight (native reader)
MAX_COALESCE_PAGES = 16  # adjacent pages read as one extent, at most this many
CHUNK_PAGES = 4096  # pages held in host memory at once (16 MiB); larger plans go chunk by chunk
POOLED_BUFFERS = 2


class PlanUnusable(errors.EngramStoreError):
    """This process cannot execute the plan (the layer file cannot be opened here, or the path
    leads to another file than the daemon's): fall back to the daemon reading the rows."""


class PlanExecutor(Protocol):
    """Executes read plans. ``execute(layer, plan, out)``: ``out`` holds one row per position
    of the flattened request (``[n, row_bytes]`` uint8: a numpy array for the host executor,
    a torch tensor for the device one); on return ``out[plan.positions[i]]`` holds the
    verified bytes of its row, and nothing else of ``out`` changed. Raises CorruptRows when a
    page fails its crc32c (rows of verified pages may have been written by then; none of a
    failed page), PlanUnusable when the file cannot be used here, StorageError on an I/O error.
    Thread-safe. ``close()`` closes the files it opened."""

    name: str

    def execute(self, layer: int, plan: ReadPlan, out: Any) -> None: ...

    def close(self) -> None: ...


Identity = tuple[int, int, int]  # (st_dev, st_ino, st_size) of a layer file


def plan_identity(plan: ReadPlan) -> Identity:
    return plan.st_dev, plan.st_ino, plan.file_bytes


class LayerFiles:
    """The layer files an executor has open, each with the identity of the file it was opened on.

    :meth:`lease` gives the handle of the file a plan names, checked against the identity the
    daemon sends with *every* plan: the handle kept when it matches; else the path is opened
    again (the table set was replaced, or the file repaired by a rename) and the new handle
    kept if it matches; else :class:`PlanUnusable` (this process sees another file at that
    path than the daemon reads). A replaced handle is closed once no lease holds it, so a
    read in flight never sees its descriptor closed. Thread-safe.

    ``opener(path) -> (handle, identity)`` opens a path (the identity must be that of the
    file the handle reads: fstat of its descriptor); ``closer(handle)`` closes one."""

    def __init__(self, opener: Callable[[str], tuple[Any, Identity]], closer: Callable[[Any], None]) -> None:
        self._opener, self._closer = opener, closer
        self._lock = threading.Lock()
        self._current: dict[str, list] = {}  # path -> [handle, identity, leases, retired]
        self.reopened = 0  # times a path was opened again because the daemon's file changed

    @contextlib.contextmanager
    def lease(self, plan: ReadPlan) -> Iterator[Any]:
        entry = self._entry(plan)
        try:
            yield entry[0]
        finally:
            self._release(entry)

    def _entry(self, plan: ReadPlan) -> list:
        want = plan_identity(plan)
        with self._lock:
            entry = self._current.get(plan.path)
            if entry is not None and entry[1] == want:
                entry[2] += 1
                return entry
            try:
                handle, got = self._opener(plan.path)
            except OSError as exc:
                raise PlanUnusable(f"cannot open the layer file {plan.path} in this process: {exc}; make the table "
                                   "files readable by the engine (group-readable, mode 0640)") from None
            if got != want:
                self._closer(handle)
                raise PlanUnusable(f"{plan.path} in this process is not the file the daemon reads (device, inode or "
                                   f"size differ: {got[0]}/{got[1]}/{got[2]} here, {want[0]}/{want[1]}/{want[2]} in "
                                   "the daemon)")
            if entry is not None:  # the daemon reads another file now: retire the old handle
                self.reopened += 1
                log.info("%s changed (the daemon's file is %d/%d, %d bytes): opened it again", plan.path, *want)
                entry[3] = True
                if not entry[2]:
                    self._closer(entry[0])
            entry = self._current[plan.path] = [handle, got, 1, False]
            return entry

    def _release(self, entry: list) -> None:
        with self._lock:
            entry[2] -= 1
            if entry[3] and not entry[2]:
                self._closer(entry[0])

    def close(self) -> None:
        with self._lock:
            entries, self._current = list(self._current.values()), {}
        for entry in entries:
            entry[3] = True
            if not entry[2]:
                self._closer(entry[0])


def open_cufile(path: str, cufile: Callable[[str, str], Any]) -> tuple[Any, Identity]:
    """``cufile(path, "r")`` (``kvikio.CuFile``) on the very file whose identity is returned: the
    path is opened once here, fstat'ed, and handed to ``cufile`` as ``/proc/self/fd/N``, so a
    rename between the check and the open cannot swap the file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        return cufile(f"/proc/self/fd/{fd}", "r"), (st.st_dev, st.st_ino, st.st_size)
    finally:
        os.close(fd)


def corrupt_rows(layer: int, plan: ReadPlan, bad_pages: np.ndarray) -> errors.CorruptRows:
    """The error of pages of ``plan`` that failed their crc32c (their rows are not returned)."""
    pages = tuple(int(p) for p in bad_pages)
    shown = ", ".join(map(str, pages[:8])) + (" ..." if len(pages) > 8 else "")
    return errors.CorruptRows(
        f"layer {layer}: {len(pages)} page(s) of {plan.path} read by this client fail their crc32c (pages {shown}; "
        f"file offset = page * {plan.page_bytes}); their rows are not returned. Check the table set "
        "(the daemon's scrub, or re-import it)", layer, pages)


class HostPlanExecutor:
    """Executes plans into host memory: ``O_DIRECT`` reads, every page checked, numpy scatter.
    One fd per layer file, opened at first use and kept until :meth:`close`."""

    name = "host"

    def __init__(self, queue_depth: int = QUEUE_DEPTH, max_coalesce_pages: int = MAX_COALESCE_PAGES,
                 chunk_pages: int = CHUNK_PAGES) -> None:
        self.queue_depth, self.max_coalesce_pages = queue_depth, max(1, max_coalesce_pages)
        self.chunk_pages = max(self.max_coalesce_pages, chunk_pages)
        self._files = LayerFiles(self._open, lambda f: f.close())
        self._lock = threading.Lock()
        self._buffers: queue.SimpleQueue = queue.SimpleQueue()
        self._page_reader: PageReader | None = None  # the NVMe tier's readers (io_uring, AIO, threads)
        self.pages_read = self.bytes_read = 0

    def opener(self, path: str) -> OpenedFile:
        """Open a layer file (``O_DIRECT``, or buffered where refused). A seam for tests."""
        return open_direct(path)

    def _open(self, path: str) -> tuple[OpenedFile, Identity]:
        f = self.opener(path)
        st = os.fstat(f.fd)
        return f, (st.st_dev, st.st_ino, st.st_size)

    def execute(self, layer: int, plan: ReadPlan, out: np.ndarray) -> None:
        if not len(plan.positions):
            return
        with self._files.lease(plan) as f:
            self._execute(layer, plan, out, f)

    def _execute(self, layer: int, plan: ReadPlan, out: np.ndarray, f: OpenedFile) -> None:
        rb, pb = plan.row_bytes, plan.page_bytes
        rpp = pb // rb
        order = np.argsort(plan.page_index, kind="stable")  # the rows of each chunk of pages together
        sorted_pages = plan.page_index[order]
        n_pages = len(plan.pages)
        buf = self._buffer()
        try:
            arr = as_array(buf)
            for lo in range(0, n_pages, self.chunk_pages):
                hi = min(lo + self.chunk_pages, n_pages)
                self._read(f, plan, lo, hi, buf)
                bad = checksums.bad_pages(arr[: (hi - lo) * pb], plan.crcs[lo:hi])
                if len(bad):
                    raise corrupt_rows(layer, plan, plan.pages[lo:hi][bad])
                a, b = np.searchsorted(sorted_pages, (lo, hi))
                sel = order[a:b]
                body = arr[: (hi - lo) * pb].reshape(hi - lo, pb)[:, : rpp * rb].reshape(hi - lo, rpp, rb)
                out[plan.positions[sel]] = body[plan.page_index[sel] - lo, plan.slots[sel]]
        finally:
            if self._buffers.qsize() < POOLED_BUFFERS:
                self._buffers.put(buf)  # else dropped: unmapped once no view (a traceback's) holds it

    def _buffer(self):
        try:
            return self._buffers.get_nowait()
        except queue.Empty:
            return aligned_buffer(self.chunk_pages * PAGE_BYTES)

    def _read(self, f: OpenedFile, plan: ReadPlan, lo: int, hi: int, buf) -> None:
        """Pages ``lo:hi`` of the plan into ``buf`` (page i at ``(i - lo) * page_bytes``)."""
        pb = plan.page_bytes
        begin, npages = extents(plan.pages[lo:hi], self.max_coalesce_pages)
        offsets = plan.pages[lo:hi][begin] * pb
        lengths = npages.astype(np.int64) * pb
        dests = begin.astype(np.int64) * pb
        want = int(lengths.sum())
        try:
            got = self._reader().read(f.fd, buf, offsets, lengths, dests)
        except OSError as exc:
            raise errors.StorageError(f"reading {hi - lo} pages of {plan.path} failed: {exc}") from exc
        if got != want:
            raise errors.StorageError(f"short read of {plan.path}: {got} of {want} bytes (the file is truncated?)")
        self.pages_read += hi - lo
        self.bytes_read += want

    def _reader(self) -> PageReader:
        with self._lock:
            if self._page_reader is None:
                self._page_reader = open_reader(self.queue_depth)
            return self._page_reader

    def close(self) -> None:
        with self._lock:
            reader, self._page_reader = self._page_reader, None
        self._files.close()
        if reader is not None:
            reader.close()
        self._buffers = queue.SimpleQueue()  # pooled buffers are unmapped when no view holds them
