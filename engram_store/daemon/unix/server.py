"""The Unix-socket server: the listening socket, admission and what connections share.

One accept thread; one reader thread per connection (:mod:`.connection`, which
parses frames and hands requests to :mod:`engram_store.daemon.requests`: rows go
from the store straight into the client's shared region); one sender thread. This
module accepts clients, admits or refuses them, drops idle ones and stops them all;
it owns what every connection draws on (:class:`~.shared.Shared`, built at
:meth:`UnixServer.start`): the worker pool's turns, the region budget, the native
path, the sender.

Bounds (:mod:`.limits`): replies leave with non-blocking sends, and what a
socket does not take waits in the connection's bounded outbox for the sender
thread, so no worker ever blocks on a client. Lookups of more than
:data:`PIECE_BYTES` of rows are split into pieces that the pool serves
connection by connection in turn (a fair share: one client looping 1M-row
lookups delays another's decode lookup by a piece, not by a request). Each
connection has one handshake deadline from its connect, an idle timeout, a
per-uid count (SO_PEERCRED) and its region's share of one budget for all
regions.

With ``unix_native`` lookups of resident layers, and of cached layers whose rows
are all cached, are answered by the native path (:mod:`.fastpath`) on each
connection's reader; large resident ones there are gathered in pieces that take
turns and wait for small ones (``_unixfast.c``).

At the fd limit (accept() or the region's memfd fails with EMFILE/ENFILE) a
client is told so: the daemon keeps one spare fd, closes it to accept the
client, sends a RESOURCE_EXHAUSTED WELCOME naming the limit and reopens it;
the condition is logged once a minute at most, and counted (``fd_limit``).
"""

from __future__ import annotations

import collections
import grp
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

from ... import errors
from ...storage.base import RowStore
from ...wire.frames import Frame, Op, Status
from .. import limits
from ..config import DaemonConfig
from ..requests.context import Served
from ..stats import DaemonStats
from . import fastpath, outbox
from .connection import Connection
from .handshake import FD_LIMIT_ERRNOS
from .shared import Shared

log = logging.getLogger(__name__)

PIECE_BYTES = 4 << 20  # larger lookups are served in pieces of about this many row bytes, in turns
ABORT_SECONDS = 0.5  # stop(): how long before drain_seconds ends it aborts connections still busy
FD_LIMIT_LOG_SECONDS = 60.0  # at the fd limit: one warning per this many seconds at most
FD_LIMIT_BACKOFF_SECONDS = 0.05  # no spare fd to tell clients with: pause before accepting again


class UnixServer:
    """Listens on ``config.socket`` and serves ``store`` to every client that connects."""

    def __init__(self, store: RowStore, config: DaemonConfig, stats: DaemonStats, pool: Executor,
                 info: Callable[[], dict[str, Any]], stats_snapshot: Callable[[], dict[str, float]]) -> None:
        self.store, self.config, self.stats, self.pool = store, config, stats, pool
        self.path = config.socket
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._conns: set[Connection] = set()
        self._lock = threading.Lock()
        self._closing = False
        self.native = fastpath.NativePath.for_store(store, config)
        self.region_budget = limits.ByteBudget(config.max_total_client_shm_bytes, "max_total_client_shm_bytes")
        self.served = Served(store, config.max_request_rows,
                             limits.PeerBuckets(config.hint_rows_per_second),  # hinted rows a second, per client (uid)
                             info, stats_snapshot, self.region_budget, config.max_client_shm_bytes)
        self.sender: outbox.Sender | None = None
        self._shared: Shared | None = None  # what connections draw on, from start()
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
        self.sender = outbox.Sender(self.config.client_send_timeout_seconds)
        cfg = self.config
        self._shared = Shared(self.served, cfg, self.stats, self.sender,
                              limits.RoundRobin(self.pool, per_lane=cfg.worker_count // 4),
                              max(1024, PIECE_BYTES // self.store.row_bytes),
                              fastpath.PollToken(),  # held by the one connection busy-polling, native or Python
                              cfg.busy_poll_us / 1e6, self.native, self.fd_limit_refusal, self.forget)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._accept_loop, name="engram-unix-accept", daemon=True)
        self._thread.start()
        native = self.native
        where = "all in Python" if native is None else ", ".join(
            what for what, on in (("resident lookups", native.views), ("all-hit cached lookups", native.cached)) if on
        ) + " in native code"
        log.info("unix socket listening on %s (mode %o); %s", self.path, self.config.socket_mode, where)
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
                        if exc.errno in FD_LIMIT_ERRNOS:
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
        now = time.monotonic()
        with self._lock:  # the accept thread and readers (their region memfd) both get here
            self._fd_limit_unlogged += 1
            refused = 0  # to warn about now
            if now - self._fd_limit_logged_at >= FD_LIMIT_LOG_SECONDS:
                refused, self._fd_limit_unlogged, self._fd_limit_logged_at = self._fd_limit_unlogged, 0, now
        if refused:
            log.warning("out of file descriptors (%s; RLIMIT_NOFILE %d, %d connections): refused %d unix client(s) "
                        "since the last warning; raise LimitNOFILE or lower max_clients", exc.strerror, soft,
                        len(self._conns), refused)
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
                conn = Connection(self._shared, client, uid)
                self._conns.add(conn)
                self._uids[uid] += 1
        if refuse:
            self.stats.drop("refused")
            _refuse(client, refuse)
            return
        self.stats.unix.client_delta(+1)
        threading.Thread(target=conn.run, name="engram-unix-conn", daemon=True).start()

    def forget(self, conn: Connection) -> None:
        """``conn`` has closed: it no longer counts against max_clients or its uid's limit."""
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
