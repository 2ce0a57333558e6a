"""One Unix client's connection: its reader thread, its shared region and its lookups.

A reader parses frames, refuses bad ones at once, and runs a lookup itself when
nothing else from its client is waiting, or hands it to the server's worker pool
when the client has pipelined more (so one client's requests and many clients'
requests overlap; the gathers release the GIL). Rows go from the store
straight into the client's region: ``store.lookup_into(layer, ids,
region[out_offset:...])``. Pooled lookups larger than the server's
``piece_rows`` are served in pieces, connection by connection in turn
(:class:`~.limits.RoundRobin`).

With ``unix_native`` the reader first hands its socket to the native path
(:mod:`.fastpath`): well-formed lookups of resident layers, and of cached
layers whose rows are all cached, are answered there, one after another,
without the interpreter; whatever it leaves comes back here as a frame header
and is answered below. Such a connection never uses the worker
pool (the native path sends on the reader's thread).

A LOOKUP with ``Flag.PLAN`` (see :mod:`engram_store.wire.frames`) is answered on
the reader's thread by ``store.plan_into``: rows in DRAM go into the region, the
others come back as a read plan for the client to execute; a store without
plans, or a resident layer, answers with every row as usual (no ``Flag.PLAN`` in
the RESULT). Over the native path, plan lookups of resident layers are answered
natively, as ordinary lookups.

A connection's region stays mapped until its last in-flight lookup is done,
so a client that dies mid-request costs nothing but the lookup itself.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from .. import errors
from ..format import requests
from ..native import shm, syscalls
from ..storage.base import PlanningStore
from ..wire import frames as wire
from ..wire.frames import DType, Frame, Op, Status
from . import fastpath, hint_requests, limits
from . import staging as client_staging

if TYPE_CHECKING:
    from .server import UnixServer

log = logging.getLogger(__name__)

MAX_INFLIGHT = 64  # lookups one client may have queued in the daemon
MAX_QUEUED_REPLY_BYTES = 4 << 20  # replies one client has not read, beyond its socket buffer; more: dropped
FD_LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE)  # out of file descriptors (the process's, the system's)
_NUMPY_DTYPE = {DType.INT64: DType.INT64.numpy, DType.INT32: DType.INT32.numpy}


class Connection:
    """One client: its socket, its shared region and its lookups in the worker pool
    (``inflight``; those the reader runs itself end before it can close)."""

    def __init__(self, server: UnixServer, sock: socket.socket, uid: int) -> None:
        self.server = server
        self.sock = sock
        self.uid = uid
        # Kernel send timeout for the native path's blocking sends (on this connection's reader only).
        timeout = server.config.client_send_timeout_seconds
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(timeout), int(timeout % 1 * 1e6)))
        self.outbox = limits.Outbox(sock, server.sender, MAX_QUEUED_REPLY_BYTES)
        self.lane = limits.Lane()
        self.region = None
        self.region_bytes = 0  # taken from server.region_budget
        self.array: np.ndarray | None = None
        self.native: fastpath.NativeConn | None = None
        self.send_lock = threading.Lock()
        self.cond = threading.Condition()
        self.inflight = 0
        self.finished = threading.Event()
        self.connected_at = self.last_active = time.monotonic()
        # HINT / WITHDRAW: the client (its uid, all its connections together: bounds, rate, keys) and this
        # connection's name as a holder of its hints
        self.hint_owner, self.holder = hint_requests.owner_name(uid), hint_requests.holder_name(uid)
        self.hinted = False
        self.welcomed = False
        self.staging: client_staging.ClientStaging | None = None  # Op.STAGING: rows into the client's memfd
        self._staging_request: tuple[bytes, list[int]] = (b"", [])  # a STAGING frame's payload and fds

    # --- lifecycle --------------------------------------------------------
    def run(self) -> None:
        try:
            self._handshake()
            self._read_loop()
        except wire.ProtocolError as exc:
            self.server.stats.protocol_error()
            log.info("closing unix client: %s", exc)
        except HandshakeTimeout as exc:
            self.server.stats.drop("handshake_timeout")
            log.info("closing unix client: %s", exc)
        except (ConnectionError, OSError, TimeoutError) as exc:
            log.debug("unix client gone: %s", exc)
        except Exception:
            log.exception("unix connection failed")
        finally:
            self._close()

    def stop_reading(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def abort(self, why: str) -> None:
        """End the connection now: queued pieces end without gathering, queued replies are
        dropped, the socket is shut down (so the reader, native or not, ends too)."""
        self.lane.cancelled = True
        self.outbox.close(why)

    def _close(self) -> None:
        with self.cond:
            while self.inflight:
                self.cond.wait()
        hint_requests.withdraw_all(self)
        # The replies of the last requests, unless the client does not read them (the sender
        # drops it after client_send_timeout_seconds) or the daemon gives up on it (abort).
        self.outbox.wait_empty(self.server.config.client_send_timeout_seconds)
        self.outbox.close()
        if self.outbox.slow:
            self.server.stats.drop("slow_reader")
        native, self.native = self.native, None
        if native is not None:
            native.close()  # it holds buffers of the region and the arena
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.close()
            self.server.region_budget.give(staging.budget_bytes)
        self.sock.close()
        self.array = None  # drop our view first: a live view blocks the unmap
        region, self.region = self.region, None
        if not shm.release(region):
            log.warning("a client region is still referenced after its connection closed; it is freed later")
        self.server.region_budget.give(self.region_bytes)
        self.region_bytes = 0
        self.server.forget(self)
        self.finished.set()

    # --- framing ----------------------------------------------------------
    def _read_frame(self, max_payload: int) -> tuple[Frame, bytes]:
        frame = Frame.unpack(shm.recv_exact(self.sock, wire.FRAME.size))
        self.last_active = time.monotonic()
        wire.check_header(frame, max_payload)
        payload = self._payload(frame)
        return frame, payload

    def _payload(self, frame: Frame) -> bytes:
        """A frame's payload; a STAGING frame's memfd comes with it (kept for :meth:`_attach_staging`)."""
        if not frame.payload_bytes:
            return b""
        if frame.op != Op.STAGING:
            return shm.recv_exact(self.sock, frame.payload_bytes)
        self._staging_request = client_staging.recv_payload(self.sock, frame.payload_bytes)
        return self._staging_request[0]

    def send(self, data: bytes) -> None:
        """Queue a reply; never blocks a worker. Beside the native path (which writes the
        socket itself, on this connection's reader) replies are sent in line instead."""
        if self.native is None:
            self.outbox.send(data)
            return
        with self.send_lock:
            _send_quietly(self.sock, data)

    def _recv_by(self, size: int, deadline: float) -> bytes:
        """Exactly ``size`` bytes before ``deadline`` (monotonic), however the peer slices them."""
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandshakeTimeout(f"HELLO incomplete ({got} of {size} bytes) after "
                                        f"{self.server.config.handshake_timeout_seconds:g}s (handshake_timeout_seconds)")
            self.sock.settimeout(left)
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                continue  # the deadline check above ends it
            if n == 0:
                raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
            got += n
        return bytes(buf)

    def _handshake(self) -> None:
        cfg = self.server.config
        try:
            frame = Frame.unpack(self._recv_by(wire.FRAME.size, self.connected_at + cfg.handshake_timeout_seconds))
            if frame.magic == wire.MAGIC and frame.version != wire.VERSION:
                msg = f"daemon speaks protocol version {wire.VERSION}, client {frame.version}"
                self.send(Frame(Op.WELCOME, status=Status.VERSION_MISMATCH).pack(msg.encode()))
            wire.check_header(frame, 0)
            if frame.op != Op.HELLO:
                raise wire.ProtocolError(f"first frame must be HELLO, got op {frame.op}")
        finally:
            self.sock.settimeout(None)
        size = frame.count or cfg.client_shm_bytes
        if not 1 << 16 <= size <= cfg.max_client_shm_bytes:
            msg = f"shared region of {size} bytes asked; allowed 65536..{cfg.max_client_shm_bytes} (max_client_shm_bytes)"
            self.send(Frame(Op.WELCOME, status=Status.RESOURCE_EXHAUSTED).pack(msg.encode()))
            raise ConnectionError(msg)
        size = wire.align(size)
        if not self.server.region_budget.take(size):
            msg = self.server.region_budget.refusal(size, "shared region")
            self.server.stats.drop("region_budget")
            self.send(Frame(Op.WELCOME, status=Status.RESOURCE_EXHAUSTED).pack(msg.encode()))
            raise ConnectionError(msg)
        self.region_bytes = size
        try:
            fd, self.region = shm.create_region(size)
        except OSError as exc:
            if exc.errno not in FD_LIMIT_ERRNOS:
                raise
            msg = self.server.fd_limit_refusal(exc)
            self.send(Frame(Op.WELCOME, status=Status.RESOURCE_EXHAUSTED).pack(msg.encode()))
            raise ConnectionError(msg) from None
        try:
            self.array = syscalls.as_array(self.region)
            arena = self.server.store.arena()
            fds = [fd] + ([arena.fd] if arena is not None else [])
            payload = json.dumps(self.server.info()).encode()
            flags = wire.Flag.ARENA if arena is not None else wire.Flag.NONE
            with self.send_lock:
                shm.send_with_fds(self.sock, Frame(Op.WELCOME, flags=flags, count=size).pack(payload), fds)
        finally:
            os.close(fd)
        if self.server.native is not None:
            self.native = self.server.native.connect(self.sock, self.array)
        self.welcomed = True
        self.last_active = time.monotonic()

    def _read_loop(self) -> None:
        native = self.native
        while True:
            if native is None:
                self._busy_poll()
                frame, _ = self._read_frame(wire.MAX_CLIENT_PAYLOAD)
            elif (frame := self._next_native(native)) is None:
                continue
            if frame.op == Op.LOOKUP and frame.flags & wire.Flag.SPLIT:
                t0, later = time.perf_counter(), []
                self._finish(frame, t0, client_staging.serve_split(self, frame, later))
                _admit(later)
            elif frame.op == Op.STAGING:
                self._attach_staging(frame)
            elif frame.op == Op.LOOKUP and frame.flags & wire.Flag.PLAN:
                self._plan_lookup(frame)
            elif frame.op == Op.LOOKUP:
                self._lookup(frame, pooled=native is None)
            elif frame.op == Op.HINT:
                hint_requests.serve_hint(self, frame)
            elif frame.op == Op.WITHDRAW:
                hint_requests.serve_withdraw(self, frame)
            elif frame.op in (Op.INFO, Op.STATS):
                try:
                    body = self.server.info() if frame.op == Op.INFO else self.server.stats_snapshot()
                except Exception as exc:  # answered as an error; the connection goes on
                    log.exception("%s request failed", Op(frame.op).name)
                    self._reply_error(frame, wire.status_of(exc), f"{Op(frame.op).name} failed: {exc}")
                    continue
                self.send(Frame(Op.RESULT, frame.request_id).pack(json.dumps(body).encode()))
            else:
                self._reply_error(frame, Status.INVALID_ARGUMENT, f"unknown op {frame.op}")

    def _next_native(self, native: fastpath.NativeConn) -> Frame | None:
        """Let the native path answer lookups; returns the first frame it leaves to Python
        (None after it answered one, which is recorded here, after the reply went out)."""
        got = native.next()
        self.last_active = time.monotonic()
        if got[0] == fastpath.SERVED:
            _, layer, count, seconds = got
            native.record(layer, count, seconds)
            self.server.stats.unix.record(count, self.server.store.row_bytes, seconds, native=True)
            return None
        if got[0] == fastpath.EOF:
            raise ConnectionError(f"peer closed the connection after {len(got[1])} of {wire.FRAME.size} bytes")
        frame = Frame.unpack(got[1])
        wire.check_header(frame, wire.MAX_CLIENT_PAYLOAD)
        self._payload(frame)
        native.fit(frame)
        return frame

    def _busy_poll(self) -> None:
        """Poll the socket briefly before blocking on it (``busy_poll_us``), when no other
        connection is polling: a client's next request then needs no wake-up of this thread."""
        server = self.server
        if server.busy_poll_seconds and server.poll_token.acquire():
            try:
                shm.spin_until_readable(self.sock, server.busy_poll_seconds)
            finally:
                server.poll_token.release()

    def _attach_staging(self, frame: Frame) -> None:
        """Op.STAGING: map the client's staging memfd once it passes every check (daemon/staging.py)."""
        (payload, fds), self._staging_request = self._staging_request, (b"", [])
        try:
            if self.staging is not None:
                raise errors.InvalidRequest("this connection has a staging already")
            self.staging = client_staging.attach(self.server, fds, payload)
        except errors.EngramStoreError as exc:
            self._reply_error(frame, wire.status_of(exc), str(exc))
            return
        finally:
            for fd in fds:
                os.close(fd)
        if self.native is not None:
            self.native.set_staging(self.staging)
        self.send(Frame(Op.RESULT, frame.request_id).pack())

    # --- lookups ----------------------------------------------------------
    def _reply_error(self, frame: Frame, status: Status, message: str) -> None:
        self.send(Frame(Op.RESULT, frame.request_id, status=status, layer=frame.layer).pack(message.encode()))

    def _check(self, frame: Frame) -> None:
        """Raise the typed error of a request that cannot be served; cheap checks before any work."""
        cfg = self.server.config
        requests.check_layer(frame.layer, self.server.layers)
        if frame.dtype not in _NUMPY_DTYPE:
            raise errors.InvalidRequest(f"row id dtype code {frame.dtype}: expected "
                                        f"{int(DType.INT64)} (int64) or {int(DType.INT32)} (int32)")
        requests.check_count(frame.count, cfg.max_request_rows)
        size = len(self.array)
        ids_end = frame.ids_offset + frame.count * _NUMPY_DTYPE[frame.dtype].itemsize
        out_end = frame.out_offset + frame.count * self.server.store.row_bytes
        if ids_end > size or out_end > size:
            raise errors.InvalidRequest(f"ids [{frame.ids_offset}, {ids_end}) or rows [{frame.out_offset}, {out_end}) "
                                        f"fall outside the {size}-byte shared region")
        if frame.ids_offset % 8 or frame.out_offset % 8:
            raise errors.InvalidRequest("ids_offset and out_offset must be multiples of 8")
        if frame.count and frame.ids_offset < out_end and frame.out_offset < ids_end:
            raise errors.InvalidRequest("the row ids and the rows overlap in the shared region")

    def _lookup(self, frame: Frame, pooled: bool = True) -> None:
        """Answer one LOOKUP. With ``pooled`` (never beside the native path, which sends on
        this thread) the pool serves it in turns with other connections, in pieces, when it
        is large or more frames wait; otherwise this thread gathers it, with no hand-off."""
        t0 = time.perf_counter()
        self.server.expect(frame.count)  # wake the gather threads while the frame is checked
        try:
            self._check(frame)
        except errors.EngramStoreError as exc:
            self._finish(frame, t0, exc)
            return
        step = self.server.piece_rows
        if not pooled or (frame.count <= step and not shm.pending(self.sock)):
            later: list = []  # the cache's admission of the rows read, once the reply is out
            self._finish(frame, t0, self._gather(frame, 0, frame.count, later))
            _admit(later)
            return
        with self.cond:
            while self.inflight >= MAX_INFLIGHT:
                self.cond.wait()
            self.inflight += 1
        request = Pieces(self, frame, t0, -(-frame.count // step))
        self.server.turns.submit(self.lane, [functools.partial(request.run, start, min(start + step, frame.count))
                                             for start in range(0, frame.count, step)])

    def _plan_lookup(self, frame: Frame) -> None:
        """Answer a LOOKUP with Flag.PLAN on this thread: the cache's rows into the region and a
        read plan of the rest, or every row (a store without plans, a resident layer)."""
        t0 = time.perf_counter()
        try:
            self._check(frame)
        except errors.EngramStoreError as exc:
            self._finish(frame, t0, exc)
            return
        if not isinstance(self.server.store, PlanningStore):
            self._finish(frame, t0, self._gather(frame, 0, frame.count))
            return
        try:
            plan = self._plan_into_region(frame)
        except errors.EngramStoreError as exc:
            self._finish(frame, t0, exc.with_traceback(None))
            return
        except Exception as exc:  # a store bug must not kill the connection's other requests
            log.exception("plan lookup failed")
            self._finish(frame, t0, errors.StorageError(f"internal error: {exc}"))
            return
        if plan is None:
            self._finish(frame, t0, None)
            return
        self.send(Frame(Op.RESULT, frame.request_id, flags=wire.Flag.PLAN, layer=frame.layer,
                        count=frame.count).pack(plan.pack()))
        self.server.stats.unix.record(frame.count, self.server.store.row_bytes, time.perf_counter() - t0)

    def _plan_into_region(self, frame: Frame) -> wire.ReadPlan | None:
        arr = self.array
        dtype = _NUMPY_DTYPE[frame.dtype]
        ids = arr[frame.ids_offset: frame.ids_offset + frame.count * dtype.itemsize].view(dtype).copy()
        rb = self.server.store.row_bytes
        out = arr[frame.out_offset: frame.out_offset + frame.count * rb].reshape(frame.count, rb)
        return self.server.store.plan_into(frame.layer, ids, out, max_plan_bytes=wire.MAX_DAEMON_PAYLOAD)

    def _done_one(self) -> None:
        with self.cond:
            self.inflight -= 1
            self.cond.notify_all()

    def _gather(self, frame: Frame, start: int, stop: int, later: list | None = None) -> BaseException | None:
        """Rows ``start:stop`` of ``frame`` into the region; the error, if any, as a value. With
        ``later`` (a list), a store that can (:class:`DeferringStore`) leaves its cache admission of the
        rows it read to a callable appended there, for the caller to run after the reply."""
        try:
            self._gather_into_region(frame, start, stop, later)
        except errors.EngramStoreError as exc:
            return exc.with_traceback(None)  # the traceback would pin views of the region
        except Exception as exc:  # a store bug must not kill the connection's other requests
            log.exception("lookup failed")
            return errors.StorageError(f"internal error: {exc}")
        return None

    def _gather_into_region(self, frame: Frame, start: int, stop: int, later: list | None = None) -> None:
        arr = self.array
        dtype = _NUMPY_DTYPE[frame.dtype]
        # Copy the ids out of the shared region first: the client could rewrite them mid-gather.
        first = frame.ids_offset + start * dtype.itemsize
        ids = arr[first: first + (stop - start) * dtype.itemsize].view(dtype).copy()
        rb = self.server.store.row_bytes
        out = arr[frame.out_offset + start * rb: frame.out_offset + stop * rb].reshape(stop - start, rb)
        store = self.server.store
        deferred = getattr(store, "lookup_into_deferred", None) if later is not None else None  # DeferringStore
        if deferred is not None:
            _, admit = deferred(frame.layer, ids, out)
            if admit is not None:
                later.append(admit)
            return
        store.lookup_into(frame.layer, ids, out)

    def _finish(self, frame: Frame, t0: float, error: BaseException | None) -> None:
        if error is None:
            self.send(wire.pack_result(frame.request_id, frame.layer, frame.count))
        else:
            self._reply_error(frame, wire.status_of(error), str(error))
        status = None if error is None else wire.status_of(error).name
        self.server.stats.unix.record(frame.count, self.server.store.row_bytes, time.perf_counter() - t0, status)


class Pieces:
    """One pooled LOOKUP served in pieces; the last piece to end sends the RESULT."""

    __slots__ = ("conn", "frame", "t0", "left", "error", "lock")

    def __init__(self, conn: Connection, frame: Frame, t0: float, pieces: int) -> None:
        self.conn, self.frame, self.t0, self.left = conn, frame, t0, pieces
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def run(self, start: int, stop: int) -> None:
        if self.conn.lane.cancelled:
            error: BaseException | None = errors.Unavailable("the daemon dropped this connection")
        else:
            error = None if self.error is not None else self.conn._gather(self.frame, start, stop)
        with self.lock:
            self.error = self.error or error
            self.left -= 1
            last = self.left == 0
        if last:
            try:
                self.conn._finish(self.frame, self.t0, self.error)
            finally:
                self.conn._done_one()


def _admit(later: list) -> None:
    """Run the cache admissions a lookup left until after its reply (a failure is logged: the reply is out)."""
    for admit in later:
        try:
            admit()
        except Exception:
            log.exception("cache admission after a lookup failed")


class HandshakeTimeout(TimeoutError):
    """The peer's HELLO was not complete by the connection's handshake deadline."""


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # gone, or not reading: end the connection; its reader cleans up
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
