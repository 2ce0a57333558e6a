"""STAGING and split lookups: a client's staging (one host copy, ``engram_store/wire/staging.py``), the daemon's side.

A client sends ``STAGING`` with its staging memfd; :func:`attach` checks it before anything of it is
mapped, so that no client can make the daemon fault on it:

- one fd, a memfd (``F_GET_SEALS`` answers) of ordinary pages (no hugetlbfs: a hole punched in
  it could meet a fault no huge page serves), sealed against shrinking and growing, and without
  write seals (the daemon writes it);
- the geometry: the daemon's row format, 1..``max_request_rows`` rows, blocks and gate aligned,
  apart, inside the file's size;
- the bytes it maps taken from the clients' shared-memory budget (``max_total_client_shm_bytes``;
  at most ``max_client_shm_bytes`` for one client), as a region of that size would be.

Anything else is refused with a typed error (the connection goes on with ordinary lookups; a refusal
for the budget is logged at WARNING). The daemon maps each block and the gate on its own (the pages
that hold them, writable, until the connection closes), never the file between them: a sparse memfd
of any size with its blocks far apart costs the daemon the blocks' pages only.

:func:`split` answers a ``LOOKUP`` with ``Flag.SPLIT`` on the Python path: the ids are copied
out of the client's shared region, ``PAD_ID`` positions left alone, the others looked up by the store
into a :class:`~engram_store.native.gather.split_out.SplitOut` (every row checked before the first is written,
under the staging's gate). The native path serves the same requests (``_unixfast.c``).
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from typing import Any

import numpy as np

from ... import errors
from ...native import syscalls
from ...native.gather import native_gather
from ...native.gather.split_out import SplitOut
from ...wire import frames as wire
from ...wire import staging as wst
from .context import Served
from .lookup import rows_into

log = logging.getLogger(__name__)

BLOCK_ALIGN = 64  # blocks start on a cache line
NEEDED_SEALS = syscalls.F_SEAL_SHRINK | syscalls.F_SEAL_GROW
WRITE_SEALS = syscalls.F_SEAL_WRITE | syscalls.F_SEAL_FUTURE_WRITE


class ClientStaging:
    """A client's staging memfd, mapped by the daemon block by block: ``weights`` / ``scales`` (uint8
    ``[rows, *]`` views) and the gate word. ``budget_bytes`` (the mapped bytes) were taken from the
    clients' budget; :meth:`close` gives nothing back (the connection does)."""

    def __init__(self, fd: int, geometry: wst.StagingGeometry) -> None:
        self.geometry = geometry
        self.mappings: list[mmap.mmap] = []
        views = []
        try:
            for _, start, end in geometry.extents():
                if end == start:  # the scale block of rows without block scales
                    views.append(np.empty(0, dtype=np.uint8))
                    continue
                at = start - start % mmap.PAGESIZE
                mapping = mmap.mmap(fd, syscalls.round_up(end - at, mmap.PAGESIZE), mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE, offset=at)
                self.mappings.append(mapping)
                views.append(np.frombuffer(mapping, dtype=np.uint8)[start - at: end - at])
        except BaseException:
            self.close()
            raise
        g = geometry
        self.weights = views[0].reshape(g.rows, g.weight_bytes)
        self.scales = views[1].reshape(g.rows, g.scale_bytes)
        self.gate = views[2]
        self.rows = g.rows
        self.budget_bytes = mapped_bytes(g)

    def close(self) -> None:
        self.weights = self.scales = self.gate = None  # type: ignore[assignment]
        for mapping in self.mappings:
            try:
                mapping.close()
            except BufferError:  # a view still held (the native path's, released first): freed with it
                log.warning("a client staging is still referenced after its connection closed; it is unmapped later")


def mapped_bytes(g: wst.StagingGeometry) -> int:
    """Bytes the daemon maps for a staging of geometry ``g``: the pages of each block and of the gate."""
    page = mmap.PAGESIZE
    return sum(syscalls.round_up(end - (start - start % page), page) for _, start, end in g.extents() if end > start)


def usable(store: Any) -> bool:
    """Whether this daemon takes stagings: a store that writes SplitOut and the native gather."""
    return bool(getattr(store, "accepts_split_out", False)) and native_gather() is not None


def attach(served: Served, current: ClientStaging | None, fds: list[int], payload: bytes) -> ClientStaging:
    """Check and map a client's staging (see the module docstring); ``current``: the staging the
    client has already (refused: one a connection). The fds stay the caller's to close."""
    if current is not None:
        raise errors.InvalidRequest("this connection has a staging already")
    if not usable(served.store):
        raise errors.InvalidRequest("this daemon writes no client staging (its store or native gather cannot); use "
                                    "ordinary lookups")
    store = served.store
    return map_staging(fds, payload, row_bytes=store.row_bytes, dim=store.spec.row_format.payload_bytes,
                       max_rows=served.max_request_rows, max_bytes=served.max_client_shm_bytes,
                       budget=served.region_budget)


def map_staging(fds: list[int], payload: bytes, *, row_bytes: int, dim: int, max_rows: int, max_bytes: int,
                budget: Any) -> ClientStaging:
    """The checks and the mapping of :func:`attach`; the blocks' bytes are taken from ``budget``
    (a ``limits.ByteBudget``)."""
    if len(fds) != 1:
        raise errors.InvalidRequest(f"STAGING carries one memfd, got {len(fds)} file descriptors")
    try:
        g = wst.StagingGeometry.unpack(payload)
    except ValueError as exc:
        raise errors.InvalidRequest(f"STAGING: {exc}") from None
    if (g.weight_bytes, g.scale_bytes) != (dim, row_bytes - dim):
        raise errors.InvalidRequest(f"STAGING: blocks of {g.weight_bytes} + {g.scale_bytes} bytes a row; this daemon's "
                                    f"rows are {dim} + {row_bytes - dim}")
    if not 1 <= g.rows <= max_rows:
        raise errors.InvalidRequest(f"STAGING: {g.rows} rows; 1..{max_rows} (max_request_rows)")
    if g.weight_offset % BLOCK_ALIGN or g.scale_offset % BLOCK_ALIGN or g.gate_offset % wst.GATE_ALIGN:
        raise errors.InvalidRequest(f"STAGING: the blocks must be {BLOCK_ALIGN}-byte aligned and the gate "
                                    f"{wst.GATE_ALIGN}-byte aligned (offsets {g.weight_offset}, {g.scale_offset}, "
                                    f"{g.gate_offset})")
    spans = sorted((start, end, what) for what, start, end in g.extents() if end > start)
    for (_, end, what), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise errors.InvalidRequest(f"STAGING: the {what} and the {other} overlap")
    fd = fds[0]
    try:
        seals = syscalls.seals(fd)
        st = os.fstat(fd)
    except OSError as exc:
        raise errors.InvalidRequest(f"STAGING: the fd is not a sealable memfd ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode) or seals & NEEDED_SEALS != NEEDED_SEALS:
        raise errors.InvalidRequest(f"STAGING: the memfd must be sealed against shrinking and growing (F_SEAL_SHRINK | "
                                    f"F_SEAL_GROW); its seals are {seals:#x}")
    if st.st_blksize != mmap.PAGESIZE:  # hugetlbfs: a hole the client punches could leave a fault no page serves
        raise errors.InvalidRequest(f"STAGING: a memfd of {st.st_blksize}-byte pages; only ordinary pages "
                                    f"({mmap.PAGESIZE} bytes) are taken")
    if seals & WRITE_SEALS:
        raise errors.InvalidRequest(f"STAGING: the memfd is sealed against writes (seals {seals:#x}); the daemon "
                                    "writes the rows into it")
    if st.st_size < g.end:
        raise errors.InvalidRequest(f"STAGING: the memfd holds {st.st_size} bytes, its geometry needs {g.end}")
    nbytes = mapped_bytes(g)
    if nbytes > max_bytes:
        log.warning("a client staging refused: %d rows map %d bytes, more than max_client_shm_bytes %d", g.rows,
                    nbytes, max_bytes)
        raise errors.ResourceExhausted(f"STAGING: {g.rows} rows map {nbytes} bytes; at most {max_bytes} "
                                       "(max_client_shm_bytes)")
    if not budget.take(nbytes):
        message = budget.refusal(nbytes, "client staging")
        log.warning("a client staging refused: %s", message)
        raise errors.ResourceExhausted(message)
    try:
        return ClientStaging(fd, g)
    except (OSError, ValueError) as exc:
        budget.give(nbytes)
        raise errors.InvalidRequest(f"STAGING: the memfd cannot be mapped for writing ({exc})") from None


def split(served: Served, staging: ClientStaging | None, region: np.ndarray, frame: wire.Frame,
          later: list) -> None:
    """Answer a Flag.SPLIT lookup on the Python path: returns once every row is in the staging, else
    raises the typed error. A store that can (``DeferringStore``) leaves its cache admission of the rows
    it read to a callable appended to ``later``, for the caller to run after the reply."""
    if staging is None:
        raise errors.InvalidRequest("a LOOKUP with Flag.SPLIT needs a staging: send STAGING first")
    served.check_layer(frame.layer)
    if frame.dtype != wire.DType.INT64:
        raise errors.InvalidRequest(f"a Flag.SPLIT lookup's ids are int64 (dtype {int(wire.DType.INT64)}), "
                                    f"got dtype code {frame.dtype}")
    served.check_count(frame.count)
    n = frame.count
    if frame.ids_offset % 8 or frame.ids_offset + n * 8 > len(region):
        raise errors.InvalidRequest(f"ids [{frame.ids_offset}, {frame.ids_offset + n * 8}) fall outside the "
                                    f"{len(region)}-byte shared region or are not 8-byte aligned")
    if frame.out_offset + n > staging.rows:
        raise errors.InvalidRequest(f"staging rows [{frame.out_offset}, {frame.out_offset + n}) fall outside its "
                                    f"{staging.rows} rows")
    ids = region[frame.ids_offset: frame.ids_offset + n * 8].view("<i8").copy()  # the client may rewrite them
    taken = np.flatnonzero(ids != wst.PAD_ID)
    out = SplitOut(staging.weights, staging.scales, taken + frame.out_offset, staging.gate, 0,
                   frame.request_id, native_gather())
    if taken.size:
        try:
            rows_into(served.store, frame.layer, ids[taken], out, later)
        finally:
            ok = out.finish()
        revoked = out.revoked
    else:  # all padding: nothing to write, the gate still says so
        revoked = not _close_empty(staging, frame.request_id)
        ok = not revoked
    if not ok:
        if revoked:
            raise errors.Unavailable(f"request {frame.request_id}: the client gave up on it before its rows "
                                     "were written; nothing was written")
        raise errors.StorageError(f"request {frame.request_id}: not every row reached the staging exactly once")


def _close_empty(staging: ClientStaging, request_id: int) -> bool:
    """An all-padding request: claim and end the gate (True when the client had not given up)."""
    native = native_gather()
    if native.gate_claim(staging.gate, 0, request_id):
        native.gate_done(staging.gate, 0, request_id)
        return True
    return False
