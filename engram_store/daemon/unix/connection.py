"""One Unix client's connection: its reader thread, its shared region and its lookups.

A reader parses frames, refuses bad ones at once, and hands each request to its
handler in :mod:`engram_store.daemon.requests` (called through the one error policy,
:func:`~engram_store.daemon.requests.outcome.outcome`); this module decodes frames
and encodes replies. It runs a lookup itself when nothing else from its client is
waiting, or hands it to the worker pool when the client has pipelined more (so one
client's requests and many clients' requests overlap; the gathers release the GIL).
Rows go from the store straight into the client's region: ``store.lookup_into(layer,
ids, region[out_offset:...])``. Pooled lookups larger than ``piece_rows`` are served
in pieces, connection by connection in turn (:class:`~engram_store.daemon.limits.RoundRobin`).
What every connection shares comes from its listener as one value (:class:`Shared`).

With ``unix_native`` the reader first hands its socket to the native path
(:mod:`.fastpath`): well-formed lookups of resident layers, and of cached
layers whose rows are all cached, are answered there, one after another,
without the interpreter; whatever it leaves comes back here as a frame header
and is answered below. Such a connection never uses the worker pool (the native
path sends on the reader's thread).

A LOOKUP with ``Flag.PLAN`` is answered on the reader's thread (rows in DRAM into
the region, a read plan of the others: :func:`~engram_store.daemon.requests.lookup.region_plan`);
over the native path, plan lookups of resident layers are answered as ordinary lookups.

A connection's region stays mapped until its last in-flight lookup is done,
so a client that dies mid-request costs nothing but the lookup itself.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import struct
import threading
import time

import numpy as np

from ... import errors
from ...native import shm, syscalls
from ...storage.base import PlanningStore
from ...wire import frames as wire
from ...wire.frames import Frame, Op, Status
from .. import limits
from ..requests import hints, info, lookup
from ..requests import staging as client_staging
from ..requests.context import Caller
from ..requests.outcome import failed, outcome
from . import fastpath, handshake, outbox
from .shared import Shared

log = logging.getLogger(__name__)

MAX_INFLIGHT = 64  # lookups one client may have queued in the daemon
MAX_QUEUED_REPLY_BYTES = 4 << 20  # replies one client has not read, beyond its socket buffer; more: dropped


class Connection:
    """One client: its socket, its shared region and its lookups in the worker pool
    (``inflight``; those the reader runs itself end before it can close)."""

    def __init__(self, shared: Shared, sock: socket.socket, uid: int) -> None:
        self.shared = shared
        self.sock = sock
        self.uid = uid
        # Kernel send timeout for the native path's blocking sends (on this connection's reader only).
        timeout = shared.config.client_send_timeout_seconds
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(timeout), int(timeout % 1 * 1e6)))
        self.outbox = outbox.Outbox(sock, shared.sender, MAX_QUEUED_REPLY_BYTES)
        self.lane = limits.Lane()
        self.region = None
        self.region_bytes = 0  # taken from the clients' budget (served.region_budget)
        self.array: np.ndarray | None = None
        self.native: fastpath.NativeConn | None = None
        self.send_lock = threading.Lock()
        self.cond = threading.Condition()
        self.inflight = 0
        self.finished = threading.Event()
        self.connected_at = self.last_active = time.monotonic()
        # Who asks: the client (its uid, all its connections together: bounds, hint rate, keys) and this
        # connection's name as a holder of its hints
        self.served, self.store = shared.served, shared.served.store
        self.caller = Caller(shared.served, hints.owner_name(uid), hints.holder_name(uid))
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
            self.shared.stats.protocol_error()
            log.info("closing unix client: %s", exc)
        except handshake.HandshakeTimeout as exc:
            self.shared.stats.drop("handshake_timeout")
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
        if self.hinted:
            hints.withdraw_holder(self.caller)
        # The replies of the last requests, unless the client does not read them (the sender
        # drops it after client_send_timeout_seconds) or the daemon gives up on it (abort).
        shared = self.shared
        self.outbox.wait_empty(shared.config.client_send_timeout_seconds)
        self.outbox.close()
        if self.outbox.slow:
            shared.stats.drop("slow_reader")
        native, self.native = self.native, None
        if native is not None:
            native.close()  # it holds buffers of the region and the arena
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.close()
            shared.served.region_budget.give(staging.budget_bytes)
        self.sock.close()
        self.array = None  # drop our view first: a live view blocks the unmap
        region, self.region = self.region, None
        if not shm.release(region):
            log.warning("a client region is still referenced after its connection closed; it is freed later")
        shared.served.region_budget.give(self.region_bytes)
        self.region_bytes = 0
        shared.forget(self)
        self.finished.set()

    def _handshake(self) -> None:
        """HELLO, the region (from the clients' budget: given back when the connection closes), WELCOME."""
        shared = self.shared
        cfg = shared.config
        hello = handshake.read_hello(self.sock, self.connected_at + cfg.handshake_timeout_seconds, cfg, self.send)
        self.region_bytes = handshake.region_size(hello, cfg, self.served, shared.stats, self.send)
        fd, self.region = handshake.create_region(self.region_bytes, shared.fd_limit_refusal, self.send)
        try:
            self.array = syscalls.as_array(self.region)
            handshake.welcome(self.sock, fd, self.region_bytes, self.served, self.send_lock)
        finally:
            os.close(fd)
        if shared.native is not None:
            self.native = shared.native.connect(self.sock, self.array)
        self.welcomed = True
        self.last_active = time.monotonic()

    # --- framing ----------------------------------------------------------
    def _read_frame(self, max_payload: int) -> tuple[Frame, bytes]:
        frame = Frame.unpack(shm.recv_exact(self.sock, wire.FRAME.size))
        self.last_active = time.monotonic()
        wire.check_header(frame, max_payload)
        payload = self._payload(frame)
        return frame, payload

    def _payload(self, frame: Frame) -> bytes:
        """A frame's payload; a STAGING frame's memfd comes with it (kept for :meth:`_attach_staging`;
        at most 2 fds kept: more end the connection)."""
        if not frame.payload_bytes:
            return b""
        if frame.op != Op.STAGING:
            return shm.recv_exact(self.sock, frame.payload_bytes)
        data, fds = shm.recv_with_fds(self.sock, frame.payload_bytes, 2)
        if len(data) < frame.payload_bytes:
            data += shm.recv_exact(self.sock, frame.payload_bytes - len(data))
        self._staging_request = data, fds
        return data

    def send(self, data: bytes) -> None:
        """Queue a reply; never blocks a worker. Beside the native path (which writes the
        socket itself, on this connection's reader) replies are sent in line instead."""
        if self.native is None:
            self.outbox.send(data)
            return
        with self.send_lock:
            _send_quietly(self.sock, data)

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
                self.finish(frame, t0, outcome("split lookup", client_staging.split, self.served, self.staging,
                                                self.array, frame, later))
                _admit(later)
            elif frame.op == Op.STAGING:
                self._attach_staging(frame)
            elif frame.op == Op.LOOKUP and frame.flags & wire.Flag.PLAN:
                self._plan_lookup(frame)
            elif frame.op == Op.LOOKUP:
                self._lookup(frame, pooled=native is None)
            elif frame.op == Op.HINT:
                self._hint(frame)
            elif frame.op == Op.WITHDRAW:
                self.send(Frame(Op.RESULT, frame.request_id, count=hints.withdraw(self.caller, frame.out_offset)).pack())
            elif frame.op in (Op.INFO, Op.STATS):
                name = Op(frame.op).name
                body = outcome(name, info.info if frame.op == Op.INFO else info.stats, self.served, internal="")
                if failed(body):  # answered as an error; the connection goes on
                    self._reply_error(frame, wire.status_of(body), f"{name} failed: {body}")
                else:
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
            self.shared.stats.unix.record(count, self.store.row_bytes, seconds, native=True)
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
        shared = self.shared
        if shared.busy_poll_seconds and shared.poll_token.acquire():
            try:
                shm.spin_until_readable(self.sock, shared.busy_poll_seconds)
            finally:
                shared.poll_token.release()

    # --- requests ---------------------------------------------------------
    def _reply_error(self, frame: Frame, status: Status, message: str) -> None:
        self.send(Frame(Op.RESULT, frame.request_id, status=status, layer=frame.layer).pack(message.encode()))

    def _attach_staging(self, frame: Frame) -> None:
        """Op.STAGING: map the client's staging memfd once it passes every check (requests/staging.py)."""
        (payload, fds), self._staging_request = self._staging_request, (b"", [])
        try:
            staging = outcome("staging", client_staging.attach, self.served, self.staging, fds, payload)
        finally:
            for fd in fds:
                os.close(fd)
        if failed(staging):
            self._reply_error(frame, wire.status_of(staging), str(staging))
            return
        self.staging = staging
        if self.native is not None:
            self.native.set_staging(staging)
        self.send(Frame(Op.RESULT, frame.request_id).pack())

    def _hint(self, frame: Frame) -> None:
        """Op.HINT (ids in the region, the key in ``out_offset``); RESULT's count is the rows queued."""
        queued = outcome("hint", hints.region_hint, self.caller, self.array, frame, internal="hint failed: ")
        if failed(queued):
            self._reply_error(frame, wire.status_of(queued), str(queued))
            return
        self.hinted = True
        self.send(Frame(Op.RESULT, frame.request_id, layer=frame.layer, count=queued).pack())

    def _lookup(self, frame: Frame, pooled: bool = True) -> None:
        """Answer one LOOKUP. With ``pooled`` (never beside the native path, which sends on
        this thread) the pool serves it in turns with other connections, in pieces, when it
        is large or more frames wait; otherwise this thread gathers it, with no hand-off."""
        t0 = time.perf_counter()
        self.store.expect(frame.count)  # wake the gather threads while the frame is checked
        refused = outcome("lookup", lookup.check_region, self.served, frame, len(self.array))
        if refused is not None:
            self.finish(frame, t0, refused)
            return
        step = self.shared.piece_rows
        if not pooled or (frame.count <= step and not shm.pending(self.sock)):
            later: list = []  # the cache's admission of the rows read, once the reply is out
            self.finish(frame, t0, self.gather(frame, 0, frame.count, later))
            _admit(later)
            return
        with self.cond:
            while self.inflight >= MAX_INFLIGHT:
                self.cond.wait()
            self.inflight += 1
        request = Pieces(self, frame, t0, -(-frame.count // step))
        self.shared.turns.submit(self.lane, [functools.partial(request.run, start, min(start + step, frame.count))
                                             for start in range(0, frame.count, step)])

    def _plan_lookup(self, frame: Frame) -> None:
        """Answer a LOOKUP with Flag.PLAN on this thread: the cache's rows into the region and a
        read plan of the rest, or every row (a store without plans, a resident layer)."""
        t0 = time.perf_counter()
        refused = outcome("plan lookup", lookup.check_region, self.served, frame, len(self.array))
        if refused is not None:
            self.finish(frame, t0, refused)
            return
        if not isinstance(self.store, PlanningStore):
            self.finish(frame, t0, self.gather(frame, 0, frame.count))
            return
        plan = outcome("plan lookup", lookup.region_plan, self.store, self.array, frame)
        if plan is None or failed(plan):
            self.finish(frame, t0, plan)
            return
        self.send(Frame(Op.RESULT, frame.request_id, flags=wire.Flag.PLAN, layer=frame.layer,
                        count=frame.count).pack(plan.pack()))
        self.shared.stats.unix.record(frame.count, self.store.row_bytes, time.perf_counter() - t0)

    def done_one(self) -> None:
        with self.cond:
            self.inflight -= 1
            self.cond.notify_all()

    def gather(self, frame: Frame, start: int, stop: int, later: list | None = None) -> BaseException | None:
        """Rows ``start:stop`` of ``frame`` into the region; the error, if any, as a value (``later``:
        see :func:`~engram_store.daemon.requests.lookup.rows_into`)."""
        return outcome("lookup", lookup.region_into, self.store, self.array, frame, start, stop, later)

    def finish(self, frame: Frame, t0: float, error: BaseException | None) -> None:
        if error is None:
            self.send(wire.pack_result(frame.request_id, frame.layer, frame.count))
        else:
            self._reply_error(frame, wire.status_of(error), str(error))
        status = None if error is None else wire.status_of(error).name
        self.shared.stats.unix.record(frame.count, self.store.row_bytes, time.perf_counter() - t0, status)


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
            error = None if self.error is not None else self.conn.gather(self.frame, start, stop)
        with self.lock:
            self.error = self.error or error
            self.left -= 1
            last = self.left == 0
        if last:
            try:
                self.conn.finish(self.frame, self.t0, self.error)
            finally:
                self.conn.done_one()


def _admit(later: list) -> None:
    """Run the cache admissions a lookup left until after its reply (a failure is logged: the reply is out)."""
    for admit in later:
        try:
            admit()
        except Exception:
            log.exception("cache admission after a lookup failed")


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # gone, or not reading: end the connection; its reader cleans up
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
