"""The Unix-socket server: shared-memory regions, fd passing and the one-copy gather.

One accept thread; one reader thread per connection; one sender thread. A
reader parses frames, refuses bad ones at once, and runs a lookup itself when
nothing else from its client is waiting, or hands it to the shared worker pool
when the client has pipelined more (so one client's requests and many clients'
requests overlap; the gathers release the GIL). Rows go from the store
straight into the client's region: ``store.lookup_into(layer, ids,
region[out_offset:...])``.

Bounds (:mod:`.limits`): replies leave with non-blocking sends, and what a
socket does not take waits in the connection's bounded outbox for the sender
thread, so no worker ever blocks on a client. Lookups of more than
:data:`PIECE_BYTES` of rows are split into pieces that the pool serves
connection by connection in turn (a fair share: one client looping 1M-row
lookups delays another's decode lookup by a piece, not by a request). Each
connection has one handshake deadline from its connect, an idle timeout, a
per-uid count (SO_PEERCRED) and its region's share of one budget for all
regions.

In resident mode (``unix_native``) a reader first hands its socket to the
native path (:mod:`.fastpath`): well-formed lookups are answered there, one
after another, without the interpreter; whatever it leaves comes back here as
a frame header and is answered below. Such a connection never uses the worker
pool (the native path sends on the reader's thread).

A connection's region stays mapped until its last in-flight lookup is done,
so a client that dies mid-request costs nothing but the lookup itself.

At the fd limit (accept() or the region's memfd fails with EMFILE/ENFILE) a
client is told so: the daemon keeps one spare fd, closes it to accept the
client, sends a RESOURCE_EXHAUSTED WELCOME naming the limit and reopens it;
the condition is logged once a minute at most, and counted (``fd_limit``).
"""

from __future__ import annotations

import collections
import errno
import functools
import grp
import json
import logging
import os
import resource
import select
import selectors
import socket
import stat
import struct
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable

import numpy as np

from .. import errors
from ..storage.base import RowStore
from . import fastpath, limits, shm, wire
from .config import DaemonConfig
from .stats import DaemonStats
from .wire import DType, Frame, Op, Status

log = logging.getLogger(__name__)

MAX_INFLIGHT = 64  # lookups one client may have queued in the daemon
MAX_QUEUED_REPLY_BYTES = 4 << 20  # replies one client has not read, beyond its socket buffer; more: dropped
PIECE_BYTES = 4 << 20  # larger lookups are served in pieces of about this many row bytes, in turns
ABORT_SECONDS = 0.5  # stop(): how long before drain_seconds ends it aborts connections still busy
FD_LIMIT_LOG_SECONDS = 60.0  # at the fd limit: one warning per this many seconds at most
FD_LIMIT_BACKOFF_SECONDS = 0.05  # no spare fd to tell clients with: pause before accepting again
_FD_LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE)
_NUMPY_DTYPE = {DType.INT64: DType.INT64.numpy, DType.INT32: DType.INT32.numpy}


class UnixServer:
    """Listens on ``config.socket`` and serves ``store`` to every client that connects."""

    def __init__(self, store: RowStore, config: DaemonConfig, stats: DaemonStats, pool: Executor,
                 info: Callable[[], dict[str, Any]], stats_snapshot: Callable[[], dict[str, float]]) -> None:
        self.store, self.config, self.stats, self.pool = store, config, stats, pool
        self.info, self.stats_snapshot = info, stats_snapshot
        self.path = config.socket
        self._layers = frozenset(store.layers)
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._conns: set[_Connection] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._poll_token = threading.Lock()  # held by the one connection busy-polling
        self.expect: Callable[[int], None] = getattr(store, "expect", lambda rows: None)
        self._busy_poll_seconds = config.busy_poll_us / 1e6
        self.native = fastpath.NativePath.for_store(store, config)
        self.region_budget = limits.ByteBudget(config.max_total_client_shm_bytes, "max_total_client_shm_bytes")
        self.turns = limits.RoundRobin(pool, per_lane=config.worker_count // 4)
        self.piece_rows = max(1024, PIECE_BYTES // store.row_bytes)
        self.sender: limits.Sender | None = None
        self._uids: collections.Counter[int] = collections.Counter()
        self._spare_fd = -1  # closed to accept a client at the fd limit, only to tell it so
        self._fd_limit_logged_at = -FD_LIMIT_LOG_SECONDS
        self._fd_limit_unlogged = 0  # refusals since the last warning

    def start(self) -> str:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            _remove_stale_socket(self.path)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, self.config.socket_mode)
            if self.config.socket_group:
                try:
                    gid = grp.getgrnam(self.config.socket_group).gr_gid
                except KeyError:
                    raise errors.ConfigError(f"socket_group {self.config.socket_group!r} is not a group on this host") from None
                os.chown(self.path, -1, gid)
            sock.listen(min(self.config.max_clients, socket.SOMAXCONN))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._spare_fd = _open_spare()
        self.sender = limits.Sender(self.config.client_send_timeout_seconds)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._accept_loop, name="engram-unix-accept", daemon=True)
        self._thread.start()
        log.info("unix socket listening on %s (mode %o); resident lookups in %s", self.path, self.config.socket_mode,
                 "native code" if self.native is not None else "Python")
        return self.path

    def _accept_loop(self) -> None:
        listener = self._sock
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        idle = self.config.client_idle_timeout_seconds
        sweep_every = min(1.0, idle / 10) if idle else None
        next_sweep = time.monotonic() + (sweep_every or 0)
        try:
            while not self._closing:
                if sweep_every and time.monotonic() >= next_sweep:
                    self._drop_idle(idle)
                    next_sweep = time.monotonic() + sweep_every
                for key, _ in sel.select(sweep_every):
                    if key.fileobj == self._wake_r or self._closing:
                        return
                    try:
                        client, _ = listener.accept()
                    except OSError as exc:
                        if exc.errno in _FD_LIMIT_ERRNOS:
                            self._refuse_at_fd_limit(listener, exc)
                        else:
                            log.warning("accept failed: %s", exc)
                        continue
                    self._admit(client)
        finally:
            sel.close()

    def fd_limit_refusal(self, exc: OSError) -> str:
        """Count a client refused for want of file descriptors, warn (once a minute at most)
        and return what to tell it."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.stats.drop("fd_limit")
        self._fd_limit_unlogged += 1
        now = time.monotonic()
        if now - self._fd_limit_logged_at >= FD_LIMIT_LOG_SECONDS:
            log.warning("out of file descriptors (%s; RLIMIT_NOFILE %d, %d connections): refused %d unix client(s) "
                        "since the last warning; raise LimitNOFILE or lower max_clients", exc.strerror, soft,
                        len(self._conns), self._fd_limit_unlogged)
            self._fd_limit_logged_at, self._fd_limit_unlogged = now, 0
        return (f"daemon is out of file descriptors ({exc.strerror}; its limit RLIMIT_NOFILE is {soft} open files, "
                f"with {len(self._conns)} clients connected); try later")

    def _refuse_at_fd_limit(self, listener: socket.socket, exc: OSError) -> None:
        """accept() failed with EMFILE/ENFILE: give up the spare fd to accept one client and
        tell it why, then take the spare back. Without a spare, pause (the listener stays
        readable: accepting again at once would spin)."""
        if self._spare_fd >= 0:
            os.close(self._spare_fd)
            self._spare_fd = -1
            try:
                client, _ = listener.accept()
            except OSError:
                client = None
            if client is not None:
                _refuse(client, self.fd_limit_refusal(exc))
            self._spare_fd = _open_spare()
            if client is not None:
                return
        else:
            self.fd_limit_refusal(exc)
        select.select([self._wake_r], [], [], FD_LIMIT_BACKOFF_SECONDS)  # stop() still wakes it

    def _admit(self, client: socket.socket) -> None:
        cfg = self.config
        _, uid, _ = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        with self._lock:
            if len(self._conns) >= cfg.max_clients:
                refuse = f"daemon serves {cfg.max_clients} clients at most (max_clients); try later"
            elif self._uids[uid] >= cfg.max_clients_per_uid:
                refuse = (f"uid {uid} already has {self._uids[uid]} connections, the most one uid may have "
                          "(max_clients_per_uid); close some or try later")
            else:
                refuse = ""
                conn = _Connection(self, client, uid)
                self._conns.add(conn)
                self._uids[uid] += 1
        if refuse:
            self.stats.drop("refused")
            _refuse(client, refuse)
            return
        self.stats.unix.client_delta(+1)
        threading.Thread(target=conn.run, name="engram-unix-conn", daemon=True).start()

    def _forget(self, conn: "_Connection") -> None:
        with self._lock:
            self._conns.discard(conn)
            self._uids[conn.uid] -= 1
            if not self._uids[conn.uid]:
                del self._uids[conn.uid]
        self.stats.unix.client_delta(-1)

    def _drop_idle(self, idle_seconds: float) -> None:
        """Drop connections that sent nothing for ``idle_seconds`` and wait for nothing."""
        now = time.monotonic()
        with self._lock:
            idle = [c for c in self._conns if c.welcomed and not c.inflight and not c.outbox.queued_bytes
                    and now - c.last_active > idle_seconds]
        for conn in idle:
            self.stats.drop("idle")
            conn.abort(f"idle for {idle_seconds:g}s (client_idle_timeout_seconds)")

    def stop(self, drain_seconds: float) -> int:
        """Stop accepting, let every connection finish its in-flight lookups, close all.
        Returns how many connections were still busy when ``drain_seconds`` ran out."""
        self._closing = True
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.stop_reading()
        deadline = time.monotonic() + drain_seconds
        give_up = deadline - min(ABORT_SECONDS, drain_seconds / 2)  # aborted connections end by the deadline
        late = [conn for conn in conns if not conn.finished.wait(max(0.0, give_up - time.monotonic()))]
        for conn in late:  # out of time: their queued pieces end at once, their sockets close
            conn.abort(f"the daemon is stopping and drain_seconds ({drain_seconds:g}s) ran out")
        busy = sum(not conn.finished.wait(max(0.0, deadline - time.monotonic())) for conn in late)
        if self.sender is not None:
            self.sender.stop()
            self.sender = None
        if self._sock is not None:
            self._sock.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        for fd in (self._wake_r, self._wake_w, self._spare_fd):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = self._spare_fd = -1
        return busy


class _Connection:
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
        self.welcomed = False

    # --- lifecycle --------------------------------------------------------
    def run(self) -> None:
        try:
            self._handshake()
            self._read_loop()
        except wire.ProtocolError as exc:
            self.server.stats.protocol_error()
            log.info("closing unix client: %s", exc)
        except _HandshakeTimeout as exc:
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
        # The replies of the last requests, unless the client does not read them (the sender
        # drops it after client_send_timeout_seconds) or the daemon gives up on it (abort).
        self.outbox.wait_empty(self.server.config.client_send_timeout_seconds)
        self.outbox.close()
        if self.outbox.slow:
            self.server.stats.drop("slow_reader")
        native, self.native = self.native, None
        if native is not None:
            native.close()  # it holds buffers of the region and the arena
        self.sock.close()
        self.array = None  # drop our view first: a live view blocks the unmap
        region, self.region = self.region, None
        if not shm.release(region):
            log.warning("a client region is still referenced after its connection closed; it is freed later")
        self.server.region_budget.give(self.region_bytes)
        self.region_bytes = 0
        self.server._forget(self)
        self.finished.set()

    # --- framing ----------------------------------------------------------
    def _read_frame(self, max_payload: int) -> tuple[Frame, bytes]:
        frame = Frame.unpack(shm.recv_exact(self.sock, wire.FRAME.size))
        self.last_active = time.monotonic()
        wire.check_header(frame, max_payload)
        payload = shm.recv_exact(self.sock, frame.payload_bytes) if frame.payload_bytes else b""
        return frame, payload

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
                raise _HandshakeTimeout(f"HELLO incomplete ({got} of {size} bytes) after "
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
            if exc.errno not in _FD_LIMIT_ERRNOS:
                raise
            msg = self.server.fd_limit_refusal(exc)
            self.send(Frame(Op.WELCOME, status=Status.RESOURCE_EXHAUSTED).pack(msg.encode()))
            raise ConnectionError(msg) from None
        try:
            self.array = shm.as_array(self.region)
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
            if frame.op == Op.LOOKUP:
                self._lookup(frame, pooled=native is None)
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
        if frame.payload_bytes:
            shm.recv_exact(self.sock, frame.payload_bytes)
        native.fit(frame)
        return frame

    def _busy_poll(self) -> None:
        """Poll the socket briefly before blocking on it (``busy_poll_us``), when no other
        connection is polling: a client's next request then needs no wake-up of this thread."""
        server = self.server
        if server._busy_poll_seconds and server._poll_token.acquire(blocking=False):
            try:
                shm.spin_until_readable(self.sock, server._busy_poll_seconds)
            finally:
                server._poll_token.release()

    # --- lookups ----------------------------------------------------------
    def _reply_error(self, frame: Frame, status: Status, message: str) -> None:
        self.send(Frame(Op.RESULT, frame.request_id, status=status, layer=frame.layer).pack(message.encode()))

    def _check(self, frame: Frame) -> None:
        """Raise the typed error of a request that cannot be served; cheap checks before any work."""
        cfg = self.server.config
        if frame.layer not in self.server._layers:
            raise errors.UnknownLayer(f"layer {frame.layer} is not served; layers are {sorted(self.server._layers)}")
        if frame.dtype not in _NUMPY_DTYPE:
            raise errors.InvalidRequest(f"row id dtype code {frame.dtype}: expected "
                                        f"{int(DType.INT64)} (int64) or {int(DType.INT32)} (int32)")
        if frame.count > cfg.max_request_rows:
            raise errors.ResourceExhausted(f"{frame.count} rows asked; at most {cfg.max_request_rows} "
                                           "per request (max_request_rows)")
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
            self._finish(frame, t0, self._gather(frame, 0, frame.count))
            return
        with self.cond:
            while self.inflight >= MAX_INFLIGHT:
                self.cond.wait()
            self.inflight += 1
        request = _Pieces(self, frame, t0, -(-frame.count // step))
        self.server.turns.submit(self.lane, [functools.partial(request.run, start, min(start + step, frame.count))
                                             for start in range(0, frame.count, step)])

    def _done_one(self) -> None:
        with self.cond:
            self.inflight -= 1
            self.cond.notify_all()

    def _gather(self, frame: Frame, start: int, stop: int) -> BaseException | None:
        """Rows ``start:stop`` of ``frame`` into the region; the error, if any, as a value."""
        try:
            self._gather_into_region(frame, start, stop)
        except errors.EngramStoreError as exc:
            return exc.with_traceback(None)  # the traceback would pin views of the region
        except Exception as exc:  # a store bug must not kill the connection's other requests
            log.exception("lookup failed")
            return errors.StorageError(f"internal error: {exc}")
        return None

    def _gather_into_region(self, frame: Frame, start: int, stop: int) -> None:
        arr = self.array
        dtype = _NUMPY_DTYPE[frame.dtype]
        # Copy the ids out of the shared region first: the client could rewrite them mid-gather.
        first = frame.ids_offset + start * dtype.itemsize
        ids = arr[first: first + (stop - start) * dtype.itemsize].view(dtype).copy()
        rb = self.server.store.row_bytes
        out = arr[frame.out_offset + start * rb: frame.out_offset + stop * rb].reshape(stop - start, rb)
        self.server.store.lookup_into(frame.layer, ids, out)

    def _finish(self, frame: Frame, t0: float, error: BaseException | None) -> None:
        if error is None:
            self.send(wire.pack_result(frame.request_id, frame.layer, frame.count))
        else:
            self._reply_error(frame, wire.status_of(error), str(error))
        status = None if error is None else wire.status_of(error).name
        self.server.stats.unix.record(frame.count, self.server.store.row_bytes, time.perf_counter() - t0, status)


class _Pieces:
    """One pooled LOOKUP served in pieces; the last piece to end sends the RESULT."""

    __slots__ = ("conn", "frame", "t0", "left", "error", "lock")

    def __init__(self, conn: _Connection, frame: Frame, t0: float, pieces: int) -> None:
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


class _HandshakeTimeout(TimeoutError):
    """The peer's HELLO was not complete by the connection's handshake deadline."""


def _refuse(client: socket.socket, why: str) -> None:
    """Tell a client that was never admitted why (RESOURCE_EXHAUSTED WELCOME), then close it."""
    try:  # a new socket's buffer is empty: this never blocks
        client.send(Frame(Op.WELCOME, status=Status.RESOURCE_EXHAUSTED).pack(why.encode()),
                    socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    except OSError:
        pass
    client.close()


def _open_spare() -> int:
    """A spare fd (``/dev/null``) to give up at the fd limit; -1 when none can be had."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # gone, or not reading: end the connection; its reader cleans up
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _remove_stale_socket(path: str) -> None:
    """Remove ``path`` if it is a socket nobody listens on; refuse if a daemon is serving it."""
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise errors.ConfigError(f"socket path {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a socket left by a killed daemon
        return
    finally:
        probe.close()
    raise errors.ConfigError(f"socket {path} is served by another running daemon; stop it or choose another path")
