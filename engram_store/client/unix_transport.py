"""The client side of the Unix-socket protocol: one connection, its shared region, its arena.

The ``unix://`` :class:`~.transport.Transport`. Thread-safe. A lookup takes a
contiguous extent of the shared region (row ids, then rows), writes the ids
there, sends one LOOKUP frame per ``frame_rows`` rows and waits for the
RESULTs; the daemon gathers rows straight into the extent.
:meth:`UnixTransport.submit` hands back the extent as a read-only view (zero
copy) until :meth:`.unix_pending.UnixPending.release`; ``lookup_into`` copies
into the caller's buffer piece by piece, several pieces in flight.

:meth:`UnixTransport.plan_lookup` is one plan-mode round trip (cached daemons):
rows the daemon holds in DRAM come through the region, the others as a read
plan; executing plans, piece by piece with a fallback to the daemon, is
:class:`.plan_lookups.PlannedLookups` (``transport.planned``, behind
:meth:`UnixTransport.lookup_planned`).

Replies are read by :class:`.unix_replies.Replies`: whichever waiting thread
holds no result reads the socket for everyone.

Deadlines: a call waits at most ``timeout`` seconds for its replies, then
raises :class:`~engram_store.errors.DeadlineExceeded` and closes the
connection (a late reply must not land in region space given to another
call); the next call reconnects. Connecting and the handshake
(:mod:`.unix_socket`: retries with backoff while the daemon's backlog is full
or its socket has no listener yet, a restart; then HELLO, and the WELCOME
however slowly a peer sends it) end within ``connect_timeout`` together.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from .. import errors
from ..format import requests
from ..format.arena_layout import ArenaView
from ..native import shm, syscalls
from ..wire import frames as wire
from ..wire.frames import Frame, Op, Status
from . import unix_socket
from .plan_lookups import PlannedLookups
from .region import Extents
from .unix_pending import UnixPending, drain_first
from .unix_replies import Replies

log = logging.getLogger(__name__)

# Rows per LOOKUP frame. Splitting one request over several frames (and so over the
# daemon's workers) measured slower on a 2-core host: random row gathers are bound by
# memory latency, and each frame costs a round of Python work. One frame per request.
FRAME_ROWS = 1 << 30
PIECES, PIECES_IN_FLIGHT, PIECE_MIN_ROWS = 4, 2, 16384  # lookup_into's copy-out pipelining
# A call's deadline: above the slowest honest request (a 1M-row lookup of cold rows from
# NVMe takes seconds), far below what a caller would wait for a daemon that stopped.
DEFAULT_TIMEOUT_SECONDS = 10.0


class UnixTransport:
    """A connection to ``path``; raises Unavailable when the daemon cannot be reached or goes away.
    ``spin_seconds``: busy-poll the socket this long before sleeping on a reply (saves a
    wake-up, about 0.1 ms on a VM, at the price of a CPU while waiting). ``timeout``: the
    longest one call waits for the daemon (DeadlineExceeded after that)."""

    kind = "unix"

    def __init__(self, path: str, shm_bytes: int = 0, connect_timeout: float = 5.0, frame_rows: int = FRAME_ROWS,
                 spin_seconds: float = 0.0, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        if not timeout > 0:
            raise errors.ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.path, self.frame_rows, self.spin_seconds, self.timeout = path, frame_rows, spin_seconds, timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._region = None
        self._replies: Replies | None = None
        self.planned: PlannedLookups | None = None
        self.arena: ArenaView | None = None
        try:
            deadline = time.monotonic() + connect_timeout  # connecting and the handshake, together
            self._sock = unix_socket.connect(self._sock, path, deadline)
            self.info_cached, self._region, self.arena = unix_socket.handshake(self._sock, shm_bytes, deadline)
            self.region = syscalls.as_array(self._region)
            self._sock.settimeout(None)
            # Sends (small frames) give up too when a stopped daemon leaves the socket full.
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                                  struct.pack("ll", int(timeout), int(timeout % 1 * 1e6)))
            self._replies = Replies(self._sock, path, timeout, spin_seconds)
        except socket.timeout:  # Unavailable, as callers retrying a daemon that does not answer expect
            self.close()
            raise errors.Unavailable(f"engram-store at unix://{path} did not complete the handshake within "
                                     f"{connect_timeout:g}s (connect_timeout)") from None
        except OSError as exc:
            self.close()
            raise errors.Unavailable(f"cannot connect to engram-store at unix://{path}: {exc}") from None
        except BaseException:
            self.close()
            raise
        self.row_bytes = int(self.info_cached["row_bytes"])
        self.max_request_rows = int(self.info_cached["max_request_rows"])
        self._extents = Extents(len(self.region))
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._reply = self._replies.wait  # the reply to a request id (bound once: called per lookup)
        self._reserved: dict[int, int] = {}  # offset -> bytes of reserve() buffers
        self.planned = PlannedLookups(self)  # plan mode over this connection (:mod:`.plan_lookups`)

    # --- requests -----------------------------------------------------------
    def _send(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            raise self._replies.lost(f"sending to the daemon failed: {exc}") from None

    def _next_id(self) -> int:
        return next(self._ids)

    def submit(self, layer: int, row_ids: np.ndarray, *, block: bool = True) -> UnixPending | None:
        """Start a lookup; returns None instead of blocking when ``block`` is false and the region is full."""
        ids = requests.row_ids(row_ids)
        n = ids.size
        if n == 0:  # the daemon checks non-empty requests
            requests.check_layer(layer, self.info_cached["layers"])
        requests.check_count(n, self.max_request_rows)
        ids_bytes = wire.align(n * 8)
        need = max(ids_bytes + wire.align(n * self.row_bytes), wire.ALIGN)
        off = self._extents.alloc(need) if block else self._extents.try_alloc(need)
        if off is None:
            return None
        out_off = off + ids_bytes
        try:
            np.copyto(self.region[off: off + n * 8].view("<i8"), ids.reshape(-1), casting="unsafe")
            step = self.frame_rows
            if 0 < n <= step:  # the usual case: one frame
                rids = [next(self._ids)]
                self._send(wire.pack_lookup(rids[0], layer, n, off, out_off))
            else:  # nothing to ask for an empty request
                rids = [self._next_id() for _ in range(0, n, step)]
                self._send(b"".join(wire.pack_lookup(rid, layer, min(step, n - s), off + s * 8,
                                                     out_off + s * self.row_bytes)
                                    for rid, s in zip(rids, range(0, n, step), strict=True)))
        except BaseException:
            self._extents.release(off, need)
            raise
        rows = self.region[out_off: out_off + n * self.row_bytes].reshape(ids.shape + (self.row_bytes,))
        rows.setflags(write=False)  # a new view: the region itself stays writable
        return UnixPending(self._reply, self._extents, rids, (off, need), rows)

    def reserve(self, nbytes: int) -> np.ndarray:
        """A writable uint8 buffer inside the shared region, held until :meth:`unreserve`.
        ``lookup_into`` with ``out`` inside it is one copy (the daemon writes there)."""
        off = self._extents.alloc(wire.align(max(nbytes, 1)))
        buf = self.region[off: off + nbytes]
        self._reserved[off] = wire.align(max(nbytes, 1))
        return buf

    def unreserve(self, buf: np.ndarray) -> None:
        off = self._region_offset(buf)
        if off is None or off not in self._reserved:
            raise errors.InvalidRequest("unreserve: not a buffer from reserve() of this connection")
        self._extents.release(off, self._reserved.pop(off))

    def _region_offset(self, arr: np.ndarray) -> int | None:
        """Byte offset of ``arr`` in the shared region, or None when it lies elsewhere."""
        if self.region is None or not arr.flags.c_contiguous:
            return None
        off = arr.ctypes.data - self.region.ctypes.data
        return off if 0 <= off and off + arr.nbytes <= len(self.region) else None

    def _lookup_in_place(self, layer: int, ids: np.ndarray, out_off: int) -> None:
        """The daemon gathers straight into ``out`` (inside a reserved buffer): one copy."""
        n = ids.size
        off = self._extents.alloc(max(wire.align(n * 8), wire.ALIGN))
        try:
            np.copyto(self.region[off: off + n * 8].view("<i8"), ids, casting="unsafe")
            rid = self._next_id()
            self._send(wire.pack_lookup(rid, layer, n, off, out_off))
            frame, payload = self._reply(rid)
        finally:
            self._extents.release(off, max(wire.align(n * 8), wire.ALIGN))
        if frame.status != Status.OK:
            raise wire.error_of(frame.status, payload.decode(errors="replace"))

    def lookup_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out``: straight from the daemon when ``out`` lies in a :meth:`reserve` buffer, else
        copied out of the region piece by piece."""
        ids = requests.row_ids(row_ids)
        flat = requests.rows_out(out, ids.shape, self.row_bytes)
        ids = ids.reshape(-1)
        if ids.size and ids.size <= self.max_request_rows and (out_off := self._region_offset(out)) is not None \
                and out_off % 8 == 0 and any(o <= out_off < o + n for o, n in self._reserved.items()):
            self._lookup_in_place(layer, ids, out_off)
            return out
        # Pieces of at most a quarter of the region; big requests in PIECES pieces so the copy
        # of one overlaps the daemon's gather of the next (PIECES_IN_FLIGHT at a time).
        piece = max(1, min((self._extents.size // 4) // (8 + self.row_bytes + 2 * wire.ALIGN),
                           max(PIECE_MIN_ROWS, -(-ids.size // PIECES))))
        inflight: list[tuple[int, UnixPending]] = []
        try:
            for start in range(0, max(ids.size, 1), piece):
                chunk = ids[start: start + piece]
                if len(inflight) >= PIECES_IN_FLIGHT:
                    drain_first(inflight, flat)
                while (p := self.submit(layer, chunk, block=not inflight)) is None:
                    drain_first(inflight, flat)
                inflight.append((start, p))
            while inflight:
                drain_first(inflight, flat)
        finally:
            for _, p in inflight:
                p.release()
        return out

    # --- plan mode ----------------------------------------------------------------
    def lookup_planned(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``lookup_into`` in plan mode (:class:`.plan_lookups.PlannedLookups`)."""
        return self.planned.lookup(layer, row_ids, out)

    def plan_info(self) -> dict[str, Any]:
        return self.planned.info()

    def plan_lookup(self, layer: int, row_ids: np.ndarray, out: np.ndarray) -> wire.ReadPlan | None:
        """One plan lookup (at most :meth:`plan_piece_rows` rows): the rows the daemon writes
        (those it holds in DRAM, or all of them) are copied into ``out`` (uint8 ``[n, row_bytes]``);
        returns the read plan of the others (their rows in ``out`` are untouched), or None when
        every row is in ``out`` (a resident layer, all cached, a plan too large to send)."""
        ids = requests.row_ids(row_ids).reshape(-1)
        n = ids.size
        requests.check_count(n, self.max_request_rows)
        ids_bytes = wire.align(n * 8)
        need = max(ids_bytes + wire.align(n * self.row_bytes), wire.ALIGN)
        off = self._extents.alloc(need)
        try:
            np.copyto(self.region[off: off + n * 8].view("<i8"), ids, casting="unsafe")
            rid = self._next_id()
            self._send(wire.pack_lookup(rid, layer, n, off, off + ids_bytes, flags=wire.Flag.PLAN))
            frame, payload = self._reply(rid)
            if frame.status != Status.OK:
                raise wire.error_of(frame.status, payload.decode(errors="replace"))
            rows = self.region[off + ids_bytes: off + ids_bytes + n * self.row_bytes].reshape(n, self.row_bytes)
            if not frame.flags & wire.Flag.PLAN:
                out[...] = rows
                return None
            plan = wire.ReadPlan.unpack(payload, n)
            if len(plan.positions) < n:
                written = np.ones(n, dtype=bool)
                written[plan.positions] = False
                out[written] = rows[written]
            return plan
        finally:
            self._extents.release(off, need)

    def plan_piece_rows(self) -> int:
        """Rows of one plan lookup at most (a quarter of the shared region)."""
        return max(1, min(self.max_request_rows, (self._extents.size // 4) // (8 + self.row_bytes + 2 * wire.ALIGN)))

    # --- hints --------------------------------------------------------------------------
    def hint(self, layer: int, row_ids: np.ndarray, key: int) -> int:
        """Tell the daemon it will be asked for ``row_ids`` of ``layer`` soon (in that order), as the hint
        ``key`` (the same from every rank sending it); returns the rows it queued. Waits only for the
        daemon to copy the ids out of the region (its RESULT), never for a read. Ids go in pieces of at
        most a quarter of the region, all under the same key."""
        ids = requests.row_ids(row_ids).reshape(-1)
        requests.check_count(ids.size, self.max_request_rows)
        piece = max(1, (self._extents.size // 4) // 8)
        queued = 0
        for start in range(0, ids.size, piece):
            part = ids[start: start + piece]
            need = max(wire.align(part.size * 8), wire.ALIGN)
            off = self._extents.alloc(need)
            try:
                np.copyto(self.region[off: off + part.size * 8].view("<i8"), part, casting="unsafe")
                rid = self._next_id()
                self._send(wire.pack_hint(rid, layer, part.size, off, key))
                frame, payload = self._reply(rid)
            finally:
                self._extents.release(off, need)  # the daemon copied the ids before it answered
            if frame.status != Status.OK:
                raise wire.error_of(frame.status, payload.decode(errors="replace"))
            queued += frame.count
        return queued

    def withdraw(self, key: int) -> int:
        """The hints of ``key`` are no longer needed; returns the queued rows the daemon dropped."""
        rid = self._next_id()
        self._send(Frame(Op.WITHDRAW, rid, out_offset=key).pack())
        frame, payload = self._reply(rid)
        if frame.status != Status.OK:
            raise wire.error_of(frame.status, payload.decode(errors="replace"))
        return frame.count

    def _call_json(self, op: Op) -> Any:
        rid = self._next_id()
        self._send(Frame(op, rid).pack())
        frame, payload = self._reply(rid)
        if frame.status != Status.OK:
            raise wire.error_of(frame.status, payload.decode(errors="replace"))
        return json.loads(payload)

    def info(self) -> dict[str, Any]:
        return self._call_json(Op.INFO)

    def stats(self) -> dict[str, float]:
        return self._call_json(Op.STATS)

    @property
    def broken(self) -> bool:
        return self._replies is None or bool(self._replies.why_broken)

    def attach_staging(self, fd: int, geometry: Any) -> None:
        """Hand the daemon a staging memfd (``fd``, sealed against shrinking and growing) for
        ``Flag.SPLIT`` lookups on this connection (:mod:`engram_store.wire.staging`, ``geometry`` a
        ``StagingGeometry``); raises the daemon's typed error when it declines (an older daemon:
        InvalidRequest, unknown op)."""
        rid = self._next_id()
        payload = geometry.pack()
        message = Frame(Op.STAGING, rid).pack(payload)
        try:
            with self._send_lock:  # the header alone, then the payload carrying the fd
                self._sock.sendall(message[: wire.FRAME.size])
                shm.send_with_fds(self._sock, payload, [fd])
        except OSError as exc:
            raise self._replies.lost(f"sending to the daemon failed: {exc}") from None
        frame, answer = self._reply(rid)
        if frame.status != Status.OK:
            raise wire.error_of(frame.status, answer.decode(errors="replace"))

    def hand_over(self) -> tuple[int, Any]:
        """Give this connection to a native owner (an engine's fetch job): returns its socket's fd
        (the caller closes it) and the mapped shared region (release it with ``shm.release`` once the
        owner is done). The transport is closed afterwards; nothing of the region is in use."""
        if self._reserved or self._extents.free != [(0, self._extents.size)]:
            raise errors.InvalidRequest("hand_over: the connection has lookups or reserved buffers in flight")
        region, self._region = self._region, None
        fd = self._sock.detach()
        self.close()
        return fd, region

    def close(self) -> None:
        self._sock.close()
        if self.planned is not None:
            self.planned.close()
        if self._replies is not None:
            self._replies.lost("connection closed by the client")
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.region = None
        region, self._region = self._region, None
        shm.release(region)
